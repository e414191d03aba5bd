"""A pytest plugin for the real-suite benchmark: the same random state before every test.

Third-party suites have tests that draw unseeded random inputs and compare with a
tolerance (torch_geometric's ``test_segment``): whether such a test passes depends on
how much randomness the tests before it drew, so two runs of one suite can differ in
outcome with no change but luck. Seeding Python's, NumPy's and torch's generators at
every test's setup, in every configuration alike, leaves only the configuration's own
effect. It also sorts the collected tests by node id: torch_geometric parametrizes
over sets of dtypes, whose order (hashes of objects) differs from process to process,
so pytest-xdist's workers would each collect another order and refuse to run.
Loaded with ``-p seed_each_test`` (``benchmarks/`` on ``PYTHONPATH``); it never imports
torch or NumPy itself, and ``torch.manual_seed`` creates no CUDA context.
"""

from __future__ import annotations

import random
import sys

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    random.seed(0)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(0)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.nodeid)
