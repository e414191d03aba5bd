"""Running the rest of a session elsewhere after its process's CUDA context is lost.

The pytest glue of :mod:`pytest_cuda.sync.poison`. In the poisoned process,
:class:`Continuation` (``--cuda-on-poison=continue``) takes over the protocol of every
later test: a fresh pytest process runs them (:class:`pytest_cuda.child.ResumedRun` on
its side), and their reports are replayed here as they come, so the terminal, JUnit
XML, ``--lf`` and the exit status hold one session. :class:`SkipRemaining` (``skip``) reports them
skipped instead. The poison plugin registers one of them right after the culprit.
"""

from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING, Any, Literal

import pytest

from pytest_cuda.child import ChildRun, child_argv_for, child_env, write_nodeids

if TYPE_CHECKING:
    from pytest_cuda.child import Workdirs

__all__ = ["Continuation", "SkipRemaining", "report_from_data"]


def _keywords(item: pytest.Item) -> dict[str, Literal[1]]:
    return dict.fromkeys(item.keywords, 1)


def _log_alone(item: pytest.Item, reports: list[pytest.TestReport]) -> None:
    ihook = item.ihook
    ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in reports:
        ihook.pytest_runtest_logreport(report=report)
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)


def _made_report(
    item: pytest.Item,
    when: Literal["setup", "call", "teardown"],
    outcome: Literal["passed", "failed", "skipped"],
    longrepr: Any,
) -> pytest.TestReport:
    return pytest.TestReport(item.nodeid, item.location, _keywords(item), outcome, longrepr, when)


class SkipRemaining:
    """``--cuda-on-poison=skip``: every later test of this process is reported skipped."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> bool:
        lineno = (item.location[1] or 0) + 1
        skipped = (str(item.path), lineno, f"Skipped: {self.reason}")
        _log_alone(
            item,
            [
                _made_report(item, "setup", "skipped", skipped),
                _made_report(item, "teardown", "passed", None),
            ],
        )
        return True


class Continuation:
    """``--cuda-on-poison=continue``: the tests after the culprit run in a fresh pytest
    process (another one after each further culprit), and their reports are replayed
    here as they come, so the terminal, JUnit XML and the exit status hold one session.
    """

    def __init__(self, config: pytest.Config, workdirs: Workdirs) -> None:
        self.config = config
        self.workdirs = workdirs
        self.child: ChildRun | None = None
        self.planned: set[str] | None = None
        self.ran = 0
        self.children = 0

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> bool:
        for _ in range(2):
            if self.child is None:
                self._start(item)
            outcome = self._relay(item)
            if outcome == "done":
                return True
            if outcome == "not-planned":
                self._fail(
                    item,
                    "setup",
                    "the fresh pytest process did not collect this test "
                    "(its collection differs from this session's)",
                )
                return True
            child = self.child
            assert child is not None
            status = child.wait()
            tail = child.output_tail()
            ran, self.child = self.ran, None
            child.stop()
            self.workdirs.discard(child.workdir)
            if outcome == "crashed":
                self._fail(
                    item,
                    "call",
                    f"the fresh pytest process running this test ended "
                    f"unexpectedly (exit status {status}); its last output:\n{tail}",
                )
                return True
            if ran == 0:
                self._fail(
                    item,
                    "setup",
                    "pytest_cuda could not continue the session in a "
                    f"fresh process: it exited with status {status} before running a "
                    f"test; its last output:\n{tail}",
                )
                item.session.shouldstop = "pytest_cuda: could not continue in a fresh process"
                return True
            # That child stopped after a culprit of its own: start another one here.
        return True

    def _start(self, item: pytest.Item) -> None:
        items = item.session.items
        remaining = items[items.index(item) :]
        workdir = self.workdirs.new("continue")
        write_nodeids(workdir, (i.nodeid for i in remaining))
        config = self.config
        argv = child_argv_for(config, workdir, ())
        self.child = ChildRun(argv, workdir, cwd=config.invocation_params.dir, env=child_env())
        self.planned, self.ran = None, 0
        self.children += 1

    def _relay(self, item: pytest.Item) -> str:
        child = self.child
        assert child is not None
        if self.planned is None:
            event = child.next_event()
            if event is None or event["event"] != "plan":
                return "ended"
            self.planned = set(event["nodeids"])
        if item.nodeid not in self.planned:
            return "not-planned"
        started = finished = False
        ihook = item.ihook
        while (event := child.next_event()) is not None:
            kind = event["event"]
            if kind == "logstart" and event["nodeid"] == item.nodeid:
                ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
                started = True
            elif kind == "report":
                ihook.pytest_runtest_logreport(
                    report=report_from_data(self.config, event["report"])
                )
            elif kind == "warning":
                _replay_warning(self.config, event)
            elif kind == "logfinish" and event["nodeid"] == item.nodeid:
                ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
                finished = True
            elif kind == "done" and event["nodeid"] == item.nodeid:
                break
        if finished:
            self.ran += 1
            return "done"
        return "crashed" if started else "ended"

    def _fail(self, item: pytest.Item, when: Literal["setup", "call"], text: str) -> None:
        _log_alone(
            item,
            [
                _made_report(item, when, "failed", f"pytest_cuda: {text}"),
                _made_report(item, "teardown", "passed", None),
            ],
        )

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()
            self.child = None


def report_from_data(config: pytest.Config, data: dict[str, Any]) -> pytest.TestReport:
    report: pytest.TestReport = config.hook.pytest_report_from_serializable(
        config=config, data=data
    )
    # JSON has no tuples; the terminal and JUnit XML unpack the location.
    report.location = tuple(report.location)  # type: ignore[assignment]
    return report


def _replay_warning(config: pytest.Config, event: dict[str, Any]) -> None:
    category: type[Warning] = UserWarning
    module = sys.modules.get(str(event.get("category_module")))
    found = getattr(module, str(event.get("category")), None)
    if isinstance(found, type) and issubclass(found, Warning):
        category = found
    try:
        message = category(event["message"])
    except Exception:
        message = UserWarning(event["message"])
    warning = warnings.WarningMessage(
        message, category, str(event.get("filename")), int(event.get("lineno") or 0)
    )
    location = event.get("location")
    config.hook.pytest_warning_recorded.call_historic(
        kwargs={
            "warning_message": warning,
            "when": event.get("when", "runtest"),
            "nodeid": event.get("nodeid", ""),
            "location": tuple(location) if location else None,
        }
    )
