"""pytest glue for CUDA memory leak checks, memory limits and out-of-memory tests.

``--cuda-leak-check``, ``--cuda-leak-trace``, ``--cuda-memory-report N``,
``--cuda-limit-memory``, ``--cuda-oom``, ``--cuda-memory-snapshot``, the
``cuda_leak_check`` and ``cuda_limit_memory`` markers and the ``no_cuda_leak`` fixture.
Loaded with :mod:`pytest_cuda.plugin` (its ``MODE_PLUGINS``), so ``-p no:cuda`` turns
it off.

Always there: the options, the markers' documentation, the fixture, two hooks that
only read attributes of reports (so an xdist controller shows what its workers found),
and one that looks at a failed test's exception for an out-of-memory error
(:mod:`pytest_cuda.leaks.oom` explains it, then clears its frames). The checker
(:class:`pytest_cuda.leaks.checker.LeakChecker`, which says when a test is measured)
and the limiter (:class:`pytest_cuda.leaks.limiter.MemoryLimiter`) are imported and
registered only when an option asks for them or a collected test carries their
marker: pytest imports this module on every run, so it imports no more than pytest
itself.

A leak fails the test's teardown with an outcome of its own (``leaked``: letter ``L``,
word ``LEAKED``, counted as "1 leaked" and in the exit status) and a report section;
the terminal summary lists every leaking test with its report. The check runs for
failed tests too, so both problems are reported.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import pytest

from pytest_cuda.collection import marker_names
from pytest_cuda.leaks.report import (
    LIMIT_MARKER,
    MARKER,
    REPORT_LEAKS,
    REPORT_PEAK,
    json_report,
    leak_reports,
    peaks,
)
from pytest_cuda.settings import settings_of

if TYPE_CHECKING:
    from collections.abc import Callable, Generator
    from pathlib import Path

    from _pytest.terminal import TerminalReporter

    from pytest_cuda.leaks.block import NoCudaLeak
    from pytest_cuda.leaks.recording import StackRecording

__all__ = ["CHECKER_NAME", "LIMITER_NAME"]

CHECKER_NAME = "cuda.leaks"
LIMITER_NAME = "cuda.memory-limit"
REPORTS_NAME = "cuda.leak-reports"
_SNAPSHOTS = pytest.StashKey["Path | None"]()


def pytest_configure(config: pytest.Config) -> None:
    settings = settings_of(config)
    report_file = _report_file(config)
    if report_file is not None:
        from pytest_cuda.leaks.report_file import ReportFileError, check_report_file

        try:
            check_report_file(report_file, str(settings.leak_report))
        except ReportFileError as exc:
            raise pytest.UsageError(str(exc)) from None
    config.stash[_SNAPSHOTS] = _snapshot_folder(config)
    if settings.memory_limit is not None:
        # First: its recording keeps the events' stacks, which a limit replays.
        _register_limiter(config)
    leaks = settings.leak_check or settings.leak_trace
    if leaks or settings.memory_report:
        _register(config, leaks=leaks)
    elif settings.leak_report is not None or settings.xdist_controller:
        # An xdist controller shows the leaks its workers found (marked tests there).
        _read_reports(config)


def _report_file(config: pytest.Config) -> Path | None:
    """Where this process writes ``--cuda-leak-report`` (relative to where pytest was
    started); ``None`` where it writes none: an xdist worker's reports go to the
    controller, a pytest child's to the session that started it, which write the one
    file."""
    settings = settings_of(config)
    if settings.leak_report is None or hasattr(config, "workerinput") or settings.resume_dir:
        return None
    return config.invocation_params.dir / settings.leak_report


def _snapshot_folder(config: pytest.Config) -> Path | None:
    """``--cuda-memory-snapshot``'s folder (relative to where pytest was started),
    made now: one that cannot be is a usage error before any test runs."""
    given = settings_of(config).memory_snapshot
    if given is None:
        return None
    folder = config.invocation_params.dir / given
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise pytest.UsageError(f"--cuda-memory-snapshot={given}: {exc}") from None
    return folder


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    used = marker_names(config, items)
    if LIMIT_MARKER in used and not config.pluginmanager.has_plugin(LIMITER_NAME):
        _register_limiter(config)
    if MARKER not in used:
        return
    checker = config.pluginmanager.get_plugin(CHECKER_NAME)
    if checker is None:
        _register(config, leaks=True)
    else:
        checker.check_leaks()


def _register(config: pytest.Config, *, leaks: bool) -> None:
    from pytest_cuda.leaks.checker import LeakChecker

    _read_reports(config)
    checker = LeakChecker(config, leaks=leaks, snapshots=config.stash[_SNAPSHOTS])
    config.pluginmanager.register(checker, CHECKER_NAME)
    checker.start()


def _register_limiter(config: pytest.Config) -> None:
    from pytest_cuda.leaks.limiter import MemoryLimiter

    limiter = MemoryLimiter(config, snapshots=config.stash[_SNAPSHOTS])
    config.pluginmanager.register(limiter, LIMITER_NAME)
    checker = config.pluginmanager.get_plugin(CHECKER_NAME)
    recording: StackRecording | None = getattr(checker, "recording", None)
    limiter.start(recording)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A test that failed for lack of CUDA memory: its report says what was alive then
    (``--cuda-oom=skip``: it is a skip), and its frames are cleared."""
    report = yield
    if call.excinfo is None or call.when == "teardown" or not report.failed:
        return report
    from gpumagic.cuda_errors import out_of_memory

    error = out_of_memory(call.excinfo.value)
    if error is not None:
        _out_of_memory(item, report, call.excinfo.value, error)
    return report


def _out_of_memory(
    item: pytest.Item, report: pytest.TestReport, raised: BaseException, error: BaseException
) -> None:
    from pytest_cuda.leaks.oom import SECTION, drop_frames, explain, first_line

    settings = settings_of(item.config)
    folder = item.config.stash.get(_SNAPSHOTS, None)
    reason = f"{item.name} ran out of CUDA memory: {first_line(error)}"
    # A skip shows its reason only: what was alive is read for a failure or a snapshot.
    if settings.oom == "fail" or folder is not None:
        code = getattr(getattr(item, "function", None), "__code__", None)
        outermost = (code.co_filename, code.co_name) if code is not None else None
        try:
            found, snapshot = explain(error, outermost=outermost, search_s=settings.holder_search_s)
            text = found.text(item.name, str(item.config.rootpath))
            if folder is not None and snapshot is not None:
                from pytest_cuda.leaks.snapshots import snapshot_line

                text += "\n" + snapshot_line(
                    folder, item.nodeid, "out of memory", scan=found.holders, snapshot=snapshot
                )
        except Exception as exc:  # the test's own failure must come out whatever happens here
            text = f"{reason}\nexplaining it failed: {type(exc).__name__}: {exc}"
        report.sections.append((SECTION, text))
    if settings.oom == "skip":
        where, line, _ = item.location
        report.outcome = "skipped"
        report.longrepr = (where, (line or 0) + 1, f"Skipped: {reason} (--cuda-oom=skip)")
    if not settings.debugging:  # pdb's post-mortem reads them
        drop_frames(raised)


def _read_reports(config: pytest.Config) -> None:
    """Reports can carry leak results from now on: give them their outcome."""
    if not config.pluginmanager.has_plugin(REPORTS_NAME):
        config.pluginmanager.register(LeakOutcome(config), REPORTS_NAME)


@pytest.fixture
def no_cuda_leak() -> Callable[..., NoCudaLeak]:
    """``with no_cuda_leak(tolerance=0, mode="fail", trace=True): ...`` checks that a
    block leaves no CUDA memory allocated (the same as ``from pytest_cuda import
    no_cuda_leak``): a leak fails the test with the amounts per device and, with
    ``trace``, the lines that allocated the blocks still alive."""
    from pytest_cuda.leaks.block import no_cuda_leak as factory

    return factory


class LeakOutcome:
    """The ``leaked`` outcome of a test whose leak failed it, and the
    ``--cuda-leak-report`` file; registered only where reports can carry leak results
    (a checker here, or an xdist controller)."""

    def __init__(self, config: pytest.Config) -> None:
        self.path = _report_file(config)
        #: ``--cuda-leak-report`` as given, once the file is written.
        self.written: str | None = None
        self.rows: list[dict[str, Any]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.path is not None and report.when == "teardown":
            self.rows += [leak.row(report.nodeid) for leak in leak_reports(report)]

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.path is None:
            return
        from pytest_cuda.leaks.report_file import write_report_file

        text = json.dumps(json_report(self.rows), indent=1)
        try:
            write_report_file(self.path, text + "\n")
        except OSError as exc:
            # The checked folder changed during the run. Said in one line, and the run
            # does not pass: CI must not read on as if the file were there.
            failed = session.exitstatus == pytest.ExitCode.OK
            if failed:
                session.exitstatus = pytest.ExitCode.INTERNAL_ERROR
            status = f"; exit status {int(session.exitstatus)}" if failed else ""
            message = f"--cuda-leak-report: could not write {self.path}: {exc}{status}"
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(message, red=True)
            else:
                sys.stderr.write(message + "\n")
        else:
            self.written = settings_of(session.config).leak_report

    @pytest.hookimpl(tryfirst=True)
    def pytest_report_teststatus(
        self, report: pytest.TestReport
    ) -> tuple[str, str, tuple[str, dict[str, bool]]] | None:
        leaked = report.when == "teardown" and report.failed
        if leaked and any(leak.failed_by_leak for leak in leak_reports(report)):
            return "leaked", "L", ("LEAKED", {"red": True})
        return None


def pytest_terminal_summary(terminalreporter: TerminalReporter, config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin(REPORTS_NAME):
        return  # no report of this run can carry leak results
    reports = [
        r
        for found in terminalreporter.stats.values()
        for r in found
        if getattr(r, "when", None) == "teardown"
        and (hasattr(r, REPORT_LEAKS) or hasattr(r, REPORT_PEAK))
    ]
    if not reports:
        return
    _summarize_leaks(terminalreporter, reports)
    outcome = config.pluginmanager.get_plugin(REPORTS_NAME)
    _summarize_totals(terminalreporter, reports, getattr(outcome, "written", None))
    if config.get_verbosity() > 0:
        _summarize_kept(terminalreporter, reports)
    count = settings_of(config).memory_report
    if count:
        _summarize_peaks(terminalreporter, reports, count)


# ---------------------------------------------------------------------------
# The terminal summary (works on an xdist controller: reads report attributes only).


def _summarize_leaks(tr: TerminalReporter, reports: list[pytest.TestReport]) -> None:
    leaking = [(r, leak) for r in reports for leak in leak_reports(r) if leak.leaked]
    if not leaking:
        return
    from gpumagic.units import format_bytes

    tr.write_sep("=", "CUDA memory leaks", red=True)
    for report, leak in leaking:
        if leak.mode == "fail":
            tr.write_sep("_", leak.where(report.nodeid), red=True)
            tr.write_line(leak.details)
    if any(leak.mode == "fail" for _, leak in leaking):
        tr.write_sep("-", "leaking tests")
    for report, leak in leaking:
        amounts = ", ".join(f"{format_bytes(b)} on cuda:{d}" for d, b in leak.leaked)
        label = "LEAKED" if leak.mode == "fail" else "WARNED"
        where = f", allocated at {leak.top}" if leak.top else ""
        held = f", held by {leak.holder}" if leak.holder else ""
        tr.write_line(f"{label} {leak.where(report.nodeid)} - {amounts}{where}{held}")


def _summarize_totals(
    tr: TerminalReporter, reports: list[pytest.TestReport], written: str | None
) -> None:
    """One line over every checked test, workers' included: how many, and what came of
    them (pytest-xdist's controller sees its workers' reports); ``written``: the
    ``--cuda-leak-report`` file, once written."""
    rows = [leak.row(r.nodeid) for r in reports for leak in leak_reports(r)]
    if not rows:
        return
    from gpumagic.units import format_bytes

    document = json_report(rows)["summary"]
    parts = [f"{document[v]} {v}" for v in ("leaked", "warned", "kept") if document[v]]
    amounts = ", ".join(f"{format_bytes(b)} on {d}" for d, b in document["leaked_bytes"].items())
    checked = document["checked"]
    text = f"cuda leak check: {checked} test{'s' if checked != 1 else ''} checked"
    text += f", {', '.join(parts)}" if parts else ", no leak"
    text += f" ({amounts} leaked)" if amounts else ""
    tr.write_line(text + (f"; report written to {written}" if written else ""))


def _summarize_kept(tr: TerminalReporter, reports: list[pytest.TestReport]) -> None:
    kept = [(r, leak) for r in reports for leak in leak_reports(r) if leak.kept]
    if not kept:
        return
    from gpumagic.units import format_bytes

    tr.write_sep("-", "CUDA memory released before judging (kept by design, not leaks)")
    for report, leak in kept:
        parts = "; ".join(
            f"{step}: " + ", ".join(f"{format_bytes(b)} on cuda:{d}" for d, b in freed)
            for step, freed in leak.kept
        )
        tr.write_line(f"{leak.where(report.nodeid)} - {parts}")


def _summarize_peaks(tr: TerminalReporter, reports: list[pytest.TestReport], count: int) -> None:
    from gpumagic.units import format_bytes

    rows = []
    for report in reports:
        for device, peak, start in peaks(report):
            rows.append((peak, peak - start, device, report.nodeid))
    rows.sort(key=lambda row: (-row[0], -row[1], row[3]))
    shown = rows[:count]
    if not shown:
        tr.write_sep("=", "CUDA memory: no peaks")
        tr.write_line("no test allocated CUDA memory")
        return
    largest = "the largest peak" if len(shown) == 1 else f"the {len(shown)} largest peaks"
    tr.write_sep("=", f"CUDA memory: {largest}")
    width = max(len(format_bytes(peak)) for peak, *_ in shown)
    for peak, above, device, nodeid in shown:
        tr.write_line(
            f"{format_bytes(peak):>{width}}  cuda:{device}  {nodeid} "
            f"(+{format_bytes(above)} over its start)"
        )
