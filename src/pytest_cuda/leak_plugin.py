"""pytest glue for CUDA memory leak checks (issue 6).

``--cuda-leak-check``, ``--cuda-leak-trace``, ``--cuda-memory-report N``, the
``cuda_leak_check`` marker and the ``no_cuda_leak`` fixture. Loaded with
:mod:`pytest_cuda.plugin` (its ``pytest_plugins``), so ``-p no:cuda`` turns it off.

Always there: the options, the marker's documentation, the fixture, and two hooks that
only read attributes of reports (so an xdist controller shows what its workers found).
The checker (:class:`LeakChecker`) is registered only when an option asks for it or a
collected test carries the marker.

When a checked test is measured (this process's caching allocator, per device):

* baseline: before its first function-scoped fixture is set up, or at the start of the
  call when it has none; fixtures of a wider scope set up later (``getfixturevalue``)
  are not the test's, and their growth is subtracted;
* end: once the test and its function-scoped fixtures are torn down, before any wider
  fixture is (its ``pytest_fixture_post_finalizer``), else at the end of teardown;
* a test whose reading did not grow is clean (a few µs). Otherwise the failed test's
  frames and its fixture values, which pytest drops right after teardown anyway, are
  released (refcounting frees them at once), and :func:`pytest_cuda.leaks.settle`
  decides: garbage collection and the library caches only for what is still there.

A leak fails the test's teardown with an outcome of its own (``leaked``: letter ``L``,
word ``LEAKED``, counted as "1 leaked" and in the exit status) and a report section;
the terminal summary lists every leaking test with its report. The check runs for
failed tests too, so both problems are reported.
"""

from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import pytest

from gpumagic import cuda
from gpumagic.devices import format_bytes
from pytest_cuda.leaks import (
    CudaLeakWarning,
    CudaMemory,
    LeakResult,
    Mode,
    StackRecording,
    attribute,
    growth,
    parse_leak_settings,
    settle,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Generator
    from types import TracebackType

    from _pytest.config.argparsing import Parser
    from _pytest.terminal import TerminalReporter

    from pytest_cuda.leaks import NoCudaLeak

MARKER = "cuda_leak_check"
MARKER_DOC = (
    "cuda_leak_check(tolerance=0, mode='fail'): fail the test when it leaves more than "
    "tolerance bytes per device (an int or a size like '4KiB') allocated in this "
    "process's CUDA caching allocator, after garbage collection and after releasing "
    "what libraries keep by design. mode='warn' reports without failing; mode='off' "
    "skips the check (also under --cuda-leak-check)."
)
SECTION = "CUDA memory leak"
CHECKER_NAME = "cuda.leaks"
TRACE_HINT = (
    "Stacks not recorded: run again with --cuda-leak-trace to name the lines that "
    "allocated these blocks."
)

#: Attribute on teardown reports (plain data, so it crosses from xdist workers).
REPORT_LEAK = "cuda_leak"
REPORT_PEAK = "cuda_peak"


def pytest_addoption(parser: Parser) -> None:
    group = parser.getgroup("cuda", "CUDA devices (pytest_cuda)")
    group.addoption(
        "--cuda-leak-check",
        action="store_true",
        default=False,
        help="fail every test that leaves CUDA memory allocated (this process's caching "
        "allocator, per device, after garbage collection and after releasing what "
        "cuBLAS, cuFFT and torch.compile keep by design). Tests that never use CUDA "
        "cost a few microseconds.",
    )
    group.addoption(
        "--cuda-leak-trace",
        action="store_true",
        default=False,
        help="record the Python stack of every CUDA allocation (about 2 us each), so a "
        "leak report names the lines that allocated the blocks still alive. Applies "
        "to the tests checked by --cuda-leak-check or the cuda_leak_check marker.",
    )
    group.addoption(
        "--cuda-memory-report",
        type=int,
        default=0,
        metavar="N",
        help="after the run, list the N tests with the largest peak CUDA memory "
        "(resets the allocator's peak counters at the start of each test).",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_DOC)
    if config.getoption("cuda_memory_report") < 0:
        raise pytest.UsageError(
            "--cuda-memory-report takes a number of tests >= 0, got "
            f"{config.getoption('cuda_memory_report')}"
        )
    if (
        config.getoption("cuda_leak_check")
        or config.getoption("cuda_leak_trace")
        or config.getoption("cuda_memory_report")
    ):
        _register(config)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.pluginmanager.get_plugin(CHECKER_NAME) is None and any(
        item.get_closest_marker(MARKER) is not None for item in items
    ):
        _register(config)


def _register(config: pytest.Config) -> None:
    checker = LeakChecker(config)
    config.pluginmanager.register(checker, CHECKER_NAME)
    checker.start()


@pytest.fixture
def no_cuda_leak() -> Callable[..., NoCudaLeak]:
    """``with no_cuda_leak(tolerance=0, mode="fail", trace=True): ...`` checks that a
    block leaves no CUDA memory allocated (the same as ``from pytest_cuda import
    no_cuda_leak``): a leak fails the test with the amounts per device and, with
    ``trace``, the lines that allocated the blocks still alive."""
    from pytest_cuda.leaks import no_cuda_leak as factory

    return factory


@pytest.hookimpl(tryfirst=True)
def pytest_report_teststatus(
    report: pytest.TestReport, config: pytest.Config
) -> tuple[str, str, tuple[str, dict[str, bool]]] | None:
    leak = getattr(report, REPORT_LEAK, None)
    if report.when == "teardown" and leak and leak.get("failed_by_leak") and report.failed:
        return "leaked", "L", ("LEAKED", {"red": True})
    return None


def pytest_terminal_summary(terminalreporter: TerminalReporter, config: pytest.Config) -> None:
    reports = [
        r
        for found in terminalreporter.stats.values()
        for r in found
        if getattr(r, "when", None) == "teardown"
        and (hasattr(r, REPORT_LEAK) or hasattr(r, REPORT_PEAK))
    ]
    if not reports:
        return
    _summarize_leaks(terminalreporter, reports)
    if config.getoption("verbose") > 0:
        _summarize_kept(terminalreporter, reports)
    count = config.getoption("cuda_memory_report")
    if count:
        _summarize_peaks(terminalreporter, reports, count)


# ---------------------------------------------------------------------------
# The checker.


@dataclass
class _Check:
    """One test's measurement, kept in its stash from setup to its teardown report."""

    item: pytest.Item
    tolerance: int
    mode: Mode
    leaks: bool
    first: dict[int, int] | None = None
    start_us: int = 0
    ran: bool = False
    held: dict[int, int] = field(default_factory=dict)
    tearing_down: bool = False
    done: bool = False
    start_stats: dict[int, cuda.AllocatorStats] = field(default_factory=dict)
    result: LeakResult | None = None
    peak: list[list[int]] | None = None
    failure: str | None = None
    raised: bool = False


_CHECK = pytest.StashKey[_Check]()


def cuda_leak_check(tolerance: object = 0, mode: object = "fail") -> tuple[object, object]:
    """The marker's signature (its name shows in the errors about its arguments)."""
    return tolerance, mode


class LeakChecker:
    """Measures the tests that are checked (``--cuda-leak-check``, the marker) and the
    peaks for ``--cuda-memory-report``; registered only when one of them is used."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.everywhere: bool = config.getoption("cuda_leak_check")
        self.peaks = config.getoption("cuda_memory_report") > 0
        self.recording = StackRecording() if config.getoption("cuda_leak_trace") else None
        self.source = CudaMemory()
        self.root = str(config.rootpath)
        self._current: _Check | None = None

    def start(self) -> None:
        """Stack recording on now, or queued for the moment CUDA is initialised (torch is
        imported for that, only when CUDA is usable here)."""
        if self.recording is None:
            return
        if cuda.is_initialized():
            self.recording.ensure()
        elif cuda.status().available:
            cuda.torch_module()
            self.recording.ensure_at_init()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self.recording is not None:
            self.recording.close()

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        status = cuda.status()
        if not status.available:
            return [f"cuda leak check: nothing to check, {status.summary()}"]
        scope = "every test that uses CUDA" if self.everywhere else "tests marked cuda_leak_check"
        stacks = "recorded" if self.recording is not None else "off (--cuda-leak-trace)"
        line = f"cuda leak check: {scope}; this process's allocator; stacks {stacks}"
        return [line] if self.everywhere or self.recording is not None else []

    # -- the phases of one test ------------------------------------------------

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        try:
            check = self._plan(item)
        except (TypeError, ValueError) as exc:
            error: str | None = f"malformed @pytest.mark.{MARKER} on {item.nodeid}: {exc}"
            check = None
        else:
            error = None
        if check is not None:
            item.stash[_CHECK] = check
            self._current = check
        result = yield
        if error is not None:
            # After the other setup hooks, so the teardown finds what they set up.
            pytest.fail(error, pytrace=False)
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(
        self, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
    ) -> Generator[None, object, object]:
        check = self._current
        if check is None:
            return (yield)
        if fixturedef.scope == "function":
            if check.first is None:
                self._begin(check)
            return (yield)
        if check.first is None:
            # Set up before the test's own fixtures: part of its surroundings.
            return (yield)
        before = self.source.read()
        try:
            return (yield)
        finally:
            for device, amount in growth(before, self.source.read()).items():
                check.held[device] = check.held.get(device, 0) + amount

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        check = self._current
        if check is None or check.item is not item:
            return (yield)
        if check.first is None:
            self._begin(check)
        check.ran = True
        if self.peaks:
            check.start_stats = _reset_peaks()
        return (yield)

    def pytest_fixture_post_finalizer(
        self, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
    ) -> None:
        check = self._current
        if check is not None and check.tearing_down and fixturedef.scope != "function":
            # The test is torn down; a wider fixture is next: measure before it goes.
            self._finish(check)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, None, None]:
        check = self._current
        if check is None or check.item is not item:
            return (yield)
        check.tearing_down = True
        try:
            outcome = yield
        finally:
            self._current = None
            self._finish(check)
        self._verdict(check)
        return outcome

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        if call.when != "teardown":
            return report
        check = item.stash.get(_CHECK, None)
        if check is None:
            return report
        del item.stash[_CHECK]
        self._annotate(report, check)
        return report

    # -- inside ----------------------------------------------------------------

    def _plan(self, item: pytest.Item) -> _Check | None:
        marker = item.get_closest_marker(MARKER)
        if marker is None:
            if not (self.everywhere or self.peaks):
                return None
            return _Check(item, 0, "fail", leaks=self.everywhere)
        tolerance, mode = parse_leak_settings(
            *cuda_leak_check(*marker.args, **marker.kwargs), where=MARKER
        )
        if mode == "off" and not self.peaks:
            return None
        return _Check(item, tolerance, mode, leaks=mode != "off")

    def _begin(self, check: _Check) -> None:
        if self.recording is not None and check.leaks:
            self.recording.ensure()
        check.start_us = time.time_ns() // 1000
        check.first = self.source.read()

    def _finish(self, check: _Check) -> None:
        if check.done:
            return
        check.done = True
        if not check.ran:
            return  # setup failed or skipped: the test never ran
        try:
            self._measure(check)
        except Exception as exc:  # a bug here must not hide the test's own outcome
            check.failure = f"{type(exc).__name__}: {exc}"

    def _measure(self, check: _Check) -> None:
        end = self.source.read()
        if self.peaks:
            check.peak = _peaks(check.start_stats, end)
        if not check.leaks:
            return
        baseline = check.first or {}
        if all(g <= check.tolerance for g in growth(baseline, end, check.held).values()):
            return
        # Usually the function-scoped fixtures' values: freed at once by refcount.
        _release_test_references(check.item)
        result = settle(baseline, self.source, check.tolerance, held=check.held)
        if not result.clean:
            result = self._stacks(check, result)
        check.result = result

    def _stacks(self, check: _Check, result: LeakResult) -> LeakResult:
        if self.recording is None:
            return replace(result, stack_note=TRACE_HINT)
        if not cuda.memory_history_enabled():
            return replace(
                result,
                stack_note="Stacks not recorded: allocation-stack recording was off "
                "(switched off by the test?).",
            )
        stacks = attribute(check.start_us, result.leaked, _test_function(check.item))
        return replace(result, stacks=stacks)

    def _verdict(self, check: _Check) -> None:
        if check.failure is not None:
            pytest.fail(
                f"the CUDA leak check of {check.item.nodeid} could not measure: {check.failure}",
                pytrace=False,
            )
        result = check.result
        if result is None or result.clean:
            return
        subject = _subject(check.item)
        if check.mode == "warn":
            text = f"{result.summary(subject, self.root)}\n{result.details(subject, self.root)}"
            path, line, _ = check.item.location
            # Reported at the test, not at this hook.
            warnings.warn_explicit(CudaLeakWarning(text), CudaLeakWarning, path, (line or 0) + 1)
            return
        check.raised = True
        pytest.fail(result.summary(subject, self.root), pytrace=False)

    def _annotate(self, report: pytest.TestReport, check: _Check) -> None:
        if check.peak:
            setattr(report, REPORT_PEAK, check.peak)
        result = check.result
        if result is None:
            return
        subject = _subject(check.item)
        leak = {
            "mode": check.mode,
            "leaked": [[d, b] for d, b in sorted(result.leaked.items())],
            "kept": [
                [step, [[d, b] for d, b in sorted(freed.items()) if b > 0]]
                for step, freed in result.kept_by_libraries()
            ],
            "summary": result.summary(subject, self.root) if result.leaked else "",
            "details": result.details(subject, self.root) if result.leaked else "",
            "top": result.top_frame(self.root),
            "failed_by_leak": check.raised,
        }
        setattr(report, REPORT_LEAK, leak)
        if result.leaked:
            report.sections.append((SECTION, result.details(subject, self.root)))


def _subject(item: pytest.Item) -> str:
    return item.name


def _test_function(item: pytest.Item) -> tuple[str, str] | None:
    """Where the test's own frame is, so the frames that called it (pytest's) are cut."""
    function = getattr(item, "function", None)
    code = getattr(function, "__code__", None)
    return (code.co_filename, code.co_name) if code is not None else None


def _release_test_references(item: pytest.Item) -> None:
    """Drop what pytest still holds of the test before it would itself: the failed
    test's frames (``sys.last_traceback``, kept for ``pdb.pm()``) and the fixture values
    (``item.funcargs``, dropped right after this teardown). Only called when a test's
    memory grew, so a normal run keeps both untouched."""
    seen: set[int] = set()
    exc: BaseException | None = getattr(sys, "last_value", None)
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        _clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
    _clear_frames(getattr(sys, "last_traceback", None))
    if getattr(item, "funcargs", None):
        item.funcargs = {}  # type: ignore[attr-defined]


def _clear_frames(tb: TracebackType | None) -> None:
    while tb is not None:
        frame = tb.tb_frame
        try:
            frame.clear()
        except RuntimeError:  # still running
            pass
        else:
            # Before Python 3.13 a frame keeps the snapshot dict ``f_locals`` made for
            # the traceback's display; reading it again drops the cleared names.
            frame.f_locals  # noqa: B018
        tb = tb.tb_next


def _reset_peaks() -> dict[int, cuda.AllocatorStats]:
    if not cuda.is_initialized():
        return {}
    stats = {}
    for device in range(cuda.visible_device_total()):
        cuda.reset_peak_memory_stats(device)
        stats[device] = cuda.allocator_stats(device)
    return stats


def _peaks(start: dict[int, cuda.AllocatorStats], end: dict[int, int]) -> list[list[int]]:
    """``[[device, peak bytes, bytes at the start of the call]]`` for the devices the test
    allocated on (its allocation count moved)."""
    found = []
    for device in end:
        stats = cuda.allocator_stats(device)
        before = start.get(device)
        if before is not None and stats.allocations == before.allocations:
            continue
        found.append([device, stats.peak_allocated, before.allocated if before else 0])
    return found


# ---------------------------------------------------------------------------
# The terminal summary (works on an xdist controller: reads report attributes only).


def _summarize_leaks(tr: TerminalReporter, reports: list[pytest.TestReport]) -> None:
    leaking = [
        (r, leak)
        for r in reports
        if (leak := getattr(r, REPORT_LEAK, None)) is not None and leak["leaked"]
    ]
    if not leaking:
        return
    tr.write_sep("=", "CUDA memory leaks", red=True)
    for report, leak in leaking:
        if leak["mode"] == "fail":
            tr.write_sep("_", report.nodeid, red=True)
            tr.write_line(leak["details"])
    if any(leak["mode"] == "fail" for _, leak in leaking):
        tr.write_sep("-", "leaking tests")
    for report, leak in leaking:
        amounts = ", ".join(f"{format_bytes(b)} on cuda:{d}" for d, b in leak["leaked"])
        label = "LEAKED" if leak["mode"] == "fail" else "WARNED"
        where = f", allocated at {leak['top']}" if leak.get("top") else ""
        tr.write_line(f"{label} {report.nodeid} - {amounts}{where}")


def _summarize_kept(tr: TerminalReporter, reports: list[pytest.TestReport]) -> None:
    kept = [
        (r, leak["kept"])
        for r in reports
        if (leak := getattr(r, REPORT_LEAK, None)) is not None and leak["kept"]
    ]
    if not kept:
        return
    tr.write_sep("-", "CUDA memory released before judging (kept by design, not leaks)")
    for report, steps in kept:
        parts = "; ".join(
            f"{step}: " + ", ".join(f"{format_bytes(b)} on cuda:{d}" for d, b in freed)
            for step, freed in steps
        )
        tr.write_line(f"{report.nodeid} - {parts}")


def _summarize_peaks(tr: TerminalReporter, reports: list[pytest.TestReport], count: int) -> None:
    rows = []
    for report in reports:
        for device, peak, start in getattr(report, REPORT_PEAK, None) or ():
            rows.append((peak, peak - start, device, report.nodeid))
    rows.sort(key=lambda row: (-row[0], -row[1], row[3]))
    shown = rows[:count]
    tr.write_sep("=", f"CUDA memory: the {len(shown)} largest peaks")
    if not shown:
        tr.write_line("no test allocated CUDA memory")
        return
    width = max(len(format_bytes(peak)) for peak, *_ in shown)
    for peak, above, device, nodeid in shown:
        tr.write_line(
            f"{format_bytes(peak):>{width}}  cuda:{device}  {nodeid} "
            f"(+{format_bytes(above)} over its start)"
        )
