"""What the sync plugin and its per-test checks share: the names, the run's notes and
the session's culprits (a section of the terminal summary).

A leaf module: :mod:`pytest_cuda.sync.plugin` (loaded on every run) and
:mod:`pytest_cuda.sync.checks` (loaded when there is work) both import it, never each
other for it.
"""

from __future__ import annotations

from typing import Any, Literal

import pytest

__all__ = [
    "LAUNCH_BLOCKING",
    "NOTES",
    "SUMMARY_NAME",
    "WORKER_EXIT_STATUS",
    "Action",
    "CulpritReports",
    "PoisonSummary",
    "note",
]

LAUNCH_BLOCKING = "CUDA_LAUNCH_BLOCKING"
#: Exit status of an xdist worker that ends itself after a sticky CUDA error.
WORKER_EXIT_STATUS = 3
#: What happens to the rest of a process's tests after a sticky CUDA error.
Action = Literal["continue", "stop", "skip", "replace-worker", "stop-child"]

SUMMARY_NAME = "cuda.poison-summary"
CULPRIT_REPORTS_NAME = "cuda.poison-culprit-reports"
NOTES = pytest.StashKey[dict[str, None]]()


def note(config: pytest.Config, text: str) -> None:
    """A line for the end of the run (``cuda debug: ...``), once however often noted."""
    config.stash.setdefault(NOTES, {})[text] = None


class PoisonSummary:
    """The session's culprits, in a section of the terminal summary.

    Reports are read (:class:`CulpritReports`) once this process's guard has blamed a
    test: before that, no report can name a culprit (the culprit's own, or those of the
    fresh process that continues the session), so a clean run reads none. A plain
    class: pytest keeps plugins in sets, so they must stay hashable.
    """

    def __init__(self) -> None:
        self.culprits: list[tuple[str, dict[str, Any], str | None]] = []

    def listen(self, manager: pytest.PytestPluginManager) -> None:
        if not manager.has_plugin(CULPRIT_REPORTS_NAME):
            manager.register(CulpritReports(self), CULPRIT_REPORTS_NAME)

    def record(self, report: pytest.TestReport) -> None:
        poison = getattr(report, "cuda_poison", None)
        if isinstance(poison, dict):
            self.culprits.append((report.nodeid, poison, getattr(report, "worker_id", None)))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.culprits:
            return
        terminalreporter.write_sep("=", "CUDA context poisoned", yellow=True)
        for nodeid, poison, worker in self.culprits:
            consequence = {
                "continue": "the tests after it ran in a fresh process",
                "stop-child": "the tests after it ran in another fresh process",
                "replace-worker": f"xdist worker {worker or '?'} was replaced; the test is "
                "reported once, above",
                "stop": "the run stopped there (--cuda-on-poison=stop)",
                "skip": "the tests after it in that process were skipped",
            }.get(str(poison.get("action")), "")
            terminalreporter.write_line(
                f"{nodeid} left a sticky CUDA error: {poison.get('error')}; {consequence}"
            )


class CulpritReports:
    """Hands every report to :meth:`PoisonSummary.record`."""

    def __init__(self, summary: PoisonSummary) -> None:
        self.summary = summary

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.summary.record(report)
