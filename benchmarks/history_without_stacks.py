"""A pytest plugin for the real-suite benchmark: what the leak check's stacks cost.

Turns on torch's allocator history at session start with events but no Python stacks
(``_record_memory_history("all", context=None)``). pytest_cuda's leak check keeps a
recording the user started, so ``--cuda-leak-check -p history_without_stacks`` runs the
whole check with the same events and no stack capture per allocation: its wall time
against ``--cuda-leak-check`` alone is the price of the stacks (the LEAKED lines of such
a run name no allocating line). Loaded with ``-p history_without_stacks``
(``benchmarks/`` on ``PYTHONPATH``); needs a GPU.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.memory._record_memory_history("all", context=None, max_entries=50_000)
