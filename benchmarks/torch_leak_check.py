"""A pytest plugin for the real-suite benchmark: PyTorch's own leak checker per test.

``torch.testing._internal.common_utils.CudaMemoryLeakCheck`` is what PyTorch's test
suites wrap their test methods in: it collects garbage, empties the cache and reads the
allocator and the driver before and after each test. Loaded with ``-p torch_leak_check``
(``benchmarks/`` on ``PYTHONPATH``, the ``expecttest`` package installed), it wraps the
call of the first ``$TORCH_LEAK_CHECK_TESTS`` tests (default 200) that take a CUDA
``device`` parameter or fixture value; a leak it finds fails the test with its message.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from collections.abc import Generator

_LIMIT = int(os.environ.get("TORCH_LEAK_CHECK_TESTS", "200"))
_checked: list[str] = []


def _uses_cuda(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    params = getattr(callspec, "params", {}) if callspec is not None else {}
    return any("cuda" in str(value) for value in params.values())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    if len(_checked) >= _LIMIT or not _uses_cuda(item):
        return (yield)
    from torch.testing._internal.common_utils import CudaMemoryLeakCheck

    _checked.append(item.nodeid)

    class Case:
        def id(self) -> str:
            return item.nodeid

        def before_cuda_memory_leak_check(self) -> None:
            pass

    checker: Any = CudaMemoryLeakCheck(Case())
    with checker:
        return (yield)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(f"torch_leak_check: {len(_checked)} tests checked")
