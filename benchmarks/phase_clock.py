"""A pytest plugin for the real-suite benchmarks: where a run's wall time goes.

Prints ``PHASE <name> <seconds>`` to stderr at each phase of a pytest process (its
configuration, the session's start, the end of collection, the test loop's start and
end, the session's finish, the unconfiguration, the last ``atexit`` hook), counted from
``PHASE_T0`` (a Unix time the caller sets just before starting the process; else this
module's import), and, at the terminal summary, how many CUDA allocations and segments
the caching allocator made. Two configurations of one suite compared phase by phase say
whether a difference lies in the tests or outside them::

    PHASE_T0=$(date +%s.%N) PYTHONPATH=benchmarks python -m pytest ... -p phase_clock

``benchmarks/results/2026-11-27T2041-h100-leaks_phases.txt`` holds such a run.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Generator

T0 = float(os.environ.get("PHASE_T0", time.time()))


def _phase(name: str) -> None:
    sys.stderr.write(f"PHASE {name:28s} {time.time() - T0:8.3f}\n")
    sys.stderr.flush()


_phase("plugin-import")
atexit.register(_phase, "atexit-last")


class _Last:
    """The hooks that must run after everyone else's."""

    @pytest.hookimpl(trylast=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        _phase("configure-last")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        _phase("sessionfinish-last")

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config: pytest.Config) -> None:
        _phase("unconfigure-last")


@pytest.hookimpl(tryfirst=True)
def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.register(_Last(), "phase-clock-last")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    _phase("configure-first")


def pytest_sessionstart(session: pytest.Session) -> None:
    _phase("sessionstart")


def pytest_collection_finish(session: pytest.Session) -> None:
    _phase("collection-finish")


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session: pytest.Session) -> Generator[None, object, object]:
    _phase("loop-start")
    try:
        return (yield)
    finally:
        _phase("loop-end")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    _phase("sessionfinish-first")


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    _phase("unconfigure-first")


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats()
        allocs = stats.get("allocation.all.allocated")
        segments = stats.get("segment.all.allocated")
        _phase(f"allocs={allocs} segs={segments}")
