"""The CUDA leak checker: measures the tests that are checked.

Registered by :mod:`pytest_cuda.leaks.plugin` only when ``--cuda-leak-check``,
``--cuda-leak-trace`` or ``--cuda-memory-report`` asks for it or a collected test
carries the ``cuda_leak_check`` marker, so a run that uses none of them never imports
this module (nor the seam and the leak arithmetic it needs).

Each checked test runs one :class:`~pytest_cuda.leaks.engine.LeakCheck`, as
``no_cuda_leak`` and every rank process do:

* it begins before the test's first function-scoped fixture is set up, or at the start
  of the call when it has none; fixtures of a wider scope set up later
  (``getfixturevalue``) are not the test's, and their growth is subtracted;
* it finishes once the test and its function-scoped fixtures are torn down, before any
  wider fixture is (its ``pytest_fixture_post_finalizer``), else at the end of
  teardown; what pytest still holds of the test (its fixture values, a failure's
  frames, :mod:`pytest_cuda.leaks.remains`) is dropped first, only when memory grew;
* at the teardown the verdict takes in what the test's ranks sent back (a
  ``cuda_distributed`` test), each report goes through the ``pytest_cuda_leak_report``
  hooks, and a leak fails the teardown (``LEAKED``) or warns.

The holder search stops after the ``cuda_leak_holder_search`` ini value (0.3 s)
unless ``--cuda-leak-trace``.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import pytest

from gpumagic import cuda
from gpumagic.units import format_bytes
from pytest_cuda.leaks.call_peaks import CallPeaks
from pytest_cuda.leaks.engine import TRACEBACK_STEP, LeakCheck, LeakSettings
from pytest_cuda.leaks.peaks import PeakStart, peaks_since
from pytest_cuda.leaks.recording import StackRecording
from pytest_cuda.leaks.remains import drop_failure, release_test_references
from pytest_cuda.leaks.report import (
    MARKER,
    REPORT_LEAKS,
    REPORT_PEAK,
    RERUN_OUT_ENV,
    LeakReport,
    junit_properties,
)
from pytest_cuda.leaks.result import CudaLeakWarning, LeakResult, parse_leak_settings
from pytest_cuda.leaks.settle import CudaMemory, growth, kept_by_library
from pytest_cuda.settings import settings_of

if TYPE_CHECKING:
    from collections.abc import Generator, Iterable
    from pathlib import Path

__all__ = [
    "LeakChecker",
    "add_rank_reports",
    "checked_for_leaks",
    "cuda_leak_check",
]

SECTION = "CUDA memory leak"


@dataclass
class _Check:
    """One test's measurement, kept in its stash from setup to its teardown report."""

    item: pytest.Item
    settings: LeakSettings
    leaks: bool
    engine: LeakCheck | None = None
    began: bool = False
    ran: bool = False
    held: dict[int, int] = field(default_factory=dict)
    tearing_down: bool = False
    done: bool = False
    #: The peaks reset at the start of its call (``--cuda-memory-report``).
    start: PeakStart | None = None
    result: LeakResult | None = None
    peak: list[tuple[int, int, int | None]] | None = None
    failure: str | None = None
    #: Where ``--cuda-memory-snapshot`` wrote its snapshot (or why it could not).
    snapshot: str | None = None
    #: What its ranks' checks sent back (a ``cuda_distributed`` test).
    ranks: list[LeakReport] = field(default_factory=list)
    #: Every check's report, as the ``pytest_cuda_leak_report`` hooks left them.
    reports: list[LeakReport] = field(default_factory=list)


_CHECK = pytest.StashKey[_Check]()


def cuda_leak_check(tolerance: object = None, mode: object = "fail") -> tuple[object, object]:
    """The marker's signature (its name shows in the errors about its arguments)."""
    return tolerance, mode


class LeakChecker:
    """Measures the tests that are checked (``--cuda-leak-check``, the marker) and the
    peaks for ``--cuda-memory-report``; registered only when one of them is used."""

    def __init__(
        self, config: pytest.Config, *, leaks: bool = True, snapshots: Path | None = None
    ) -> None:
        self.config = config
        #: ``--cuda-memory-snapshot``'s folder: a leaking test's snapshot goes there.
        self.snapshots = snapshots
        settings = settings_of(config)
        self.everywhere = settings.leak_check
        self.peaks = settings.memory_report > 0
        self.search_s = settings.holder_search_s
        # Stacks of live blocks are recorded whenever a test may be checked for leaks.
        self.recording = StackRecording() if leaks else None
        self.source = CudaMemory(reset_caches=settings.leak_reset_caches)
        self.tolerance = settings.leak_tolerance
        self.root = str(config.rootpath)
        self._current: _Check | None = None
        # Opt-in: a leak is re-run alone in a fresh process (never from a re-run child).
        rerun_child = bool(os.environ.get(RERUN_OUT_ENV))
        reruns = settings.leak_reruns
        self.reruns_left = 0 if rerun_child else reruns
        self.reports: dict[str, dict[str, Any]] | None = {} if rerun_child else None

    def check_leaks(self) -> None:
        """A collected test carries the marker: record stacks for leak checks too (a
        checker made for ``--cuda-memory-report`` alone records none)."""
        if self.recording is None:
            self.recording = StackRecording()
            self.start()

    def start(self) -> None:
        """Stack recording on now, or queued for the moment CUDA is initialised (torch is
        imported for that, only when CUDA is usable here)."""
        if self.recording is None:
            return
        if not cuda.is_initialized() and cuda.status().available:
            cuda.start_torch()
        self.recording.arm()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self._current is not None and self._current.engine is not None:
            self._current.engine.close()
        if self.recording is not None:
            self.recording.close()
        if self.reports is not None:
            from pytest_cuda.leaks.rerun import write_reports

            write_reports(self.reports)

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        status = cuda.status()
        if not status.available:
            if self.recording is None:
                return [f"cuda memory report: nothing to measure, {status.summary()}"]
            return [f"cuda leak check: nothing to check, {status.summary()}"]
        if self.recording is None:
            return []  # peaks alone (--cuda-memory-report): no leak check
        scope = "every test that uses CUDA" if self.everywhere else "tests marked cuda_leak_check"
        walk = "to the end" if self.search_s is None else f"up to {self.search_s:g} s a test"
        line = (
            f"cuda leak check: {scope}; this process's allocator; stacks of live blocks "
            f"recorded; holders searched {walk}"
        )
        return [line] if self.everywhere or self.search_s is None else []

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
            if not check.began:
                self._begin(check)
            return (yield)
        if not check.began:
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
        if not check.began:
            self._begin(check)
        check.ran = True
        if not self.peaks:
            return (yield)
        with CallPeaks(item) as start:  # the memory limit's too, when there is one
            check.start = start
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
            self._collect(check)
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
        if not cuda.status().available:
            # Nothing to check or measure, as the header says: no test is counted as
            # checked at the end either (issue 39).
            return None
        marker = item.get_closest_marker(MARKER)
        if marker is None:
            if not (self.everywhere or self.peaks):
                return None
            return _Check(item, self._settings(self.tolerance, "fail"), leaks=self.everywhere)
        tolerance, mode = cuda_leak_check(*marker.args, **marker.kwargs)
        tolerance, mode = parse_leak_settings(
            self.tolerance if tolerance is None else tolerance, mode, where=MARKER
        )
        if mode == "off" and not self.peaks:
            return None
        return _Check(item, self._settings(tolerance, mode), leaks=mode != "off")

    def _settings(self, tolerance: int, mode: Any) -> LeakSettings:
        return LeakSettings(
            tolerance, mode, self.search_s, reset_caches=self.source.reset_caches, root=self.root
        )

    def _begin(self, check: _Check) -> None:
        check.began = True
        if check.leaks:
            check.engine = LeakCheck(
                check.settings.tolerance,
                self.source,
                self.recording,
                search_s=self.search_s,
                outermost=_test_function(check.item),
            )
            check.engine.begin()

    def _finish(self, check: _Check) -> None:
        if check.done:
            return
        check.done = True
        engine = check.engine
        try:
            if check.ran:  # else setup failed or skipped: the test never ran
                self._measure(check)
        except Exception as exc:  # a bug here must not hide the test's own outcome
            check.failure = f"{type(exc).__name__}: {exc}"
        finally:
            if engine is not None:
                engine.close()

    def _measure(self, check: _Check) -> None:
        if self.peaks:
            check.peak = peaks_since(check.start)
        if check.engine is None:
            return
        item = check.item
        result = check.engine.finish(
            held=check.held,
            release=lambda: release_test_references(item),
            drop_failure=lambda: drop_failure(item),
        )
        if not result.clean and self.reruns_left > 0:
            self.reruns_left -= 1
            from pytest_cuda.leaks.rerun import rerun_alone

            result = kept_by_library(replace(result, rerun=rerun_alone(self.config, item.nodeid)))
        check.result = result
        if not result.clean and self.snapshots is not None:
            from pytest_cuda.leaks.snapshots import snapshot_line

            check.snapshot = snapshot_line(
                self.snapshots, item.nodeid, "leaked", scan=result.holders, search_s=self.search_s
            )

    def _collect(self, check: _Check) -> None:
        """The test's checks' reports, its own and its ranks', through the
        ``pytest_cuda_leak_report`` hooks."""
        found = [] if check.failure is not None else self._own_report(check)
        check.reports = [self._hooked(check.item, r) for r in (*found, *check.ranks)]

    def _verdict(self, check: _Check) -> None:
        """A leak fails the teardown (``LEAKED``), or warns."""
        check.reports = [
            replace(r, failed_by_leak=bool(r.leaked) and r.mode == "fail") for r in check.reports
        ]
        path, line, _ = check.item.location
        for report in check.reports:
            if report.leaked and report.mode == "warn":
                # Reported at the test, not at this hook.
                text = CudaLeakWarning(f"{report.summary}\n{report.details}")
                warnings.warn_explicit(text, CudaLeakWarning, path, (line or 0) + 1)
        lines = [r.summary for r in check.reports if r.failed_by_leak]
        if check.failure is not None:
            lines.insert(
                0,
                f"the CUDA leak check of {check.item.nodeid} could not measure: {check.failure}",
            )
        if lines:
            pytest.fail("\n".join(lines), pytrace=False)

    def _own_report(self, check: _Check) -> list[LeakReport]:
        if not (check.leaks and check.ran):
            return []  # not checked, or never ran
        settings = check.settings
        report = LeakReport.of(
            check.result,
            mode=settings.mode,
            tolerance=settings.tolerance,
            subject=check.item.name,
            root=self.root,
        )
        return [report]

    def _hooked(self, item: pytest.Item, report: LeakReport) -> LeakReport:
        found = item.ihook.pytest_cuda_leak_report(report=report, item=item)
        return found if isinstance(found, LeakReport) else report

    def _annotate(self, report: pytest.TestReport, check: _Check) -> None:
        if check.peak:
            setattr(report, REPORT_PEAK, check.peak)
        if check.snapshot is not None:
            report.sections.append((f"{SECTION}: snapshot", check.snapshot))
        if not check.reports:
            return  # not checked, never ran, or could not be measured (an error says so)
        data = [leak.to_dict() for leak in check.reports]
        setattr(report, REPORT_LEAKS, data)
        # JUnit XML properties: junitxml writes a test's at its teardown report.
        report.user_properties.extend(junit_properties(check.reports))
        if self.reports is not None:
            self.reports[check.item.nodeid] = data[0]
        for leak in check.reports:
            rank = "" if leak.rank is None else f" (rank {leak.rank})"
            if leak.leaked:
                report.sections.append((SECTION + rank, leak.details))
            for step, freed in leak.kept:
                if step.startswith(TRACEBACK_STEP):
                    # Shown with the test's failure (a section named for the teardown).
                    report.sections.append(
                        (f"{SECTION} check{rank}: teardown", _traceback_note(step, freed))
                    )


def add_rank_reports(item: pytest.Item, reports: Iterable[dict[str, Any]]) -> None:
    """What the ranks' checks of ``item`` sent back (:meth:`LeakReport.to_dict`), for its
    teardown's verdict with its own check."""
    check = item.stash.get(_CHECK, None)
    if check is not None:
        check.ranks += [LeakReport.from_dict(data) for data in reports]


def _traceback_note(step: str, freed: tuple[tuple[int, int], ...]) -> str:
    amounts = ", ".join(f"{format_bytes(b)} on cuda:{d}" for d, b in freed)
    return (
        f"{amounts} {step}: released with it, so not a leak (pytest keeps a failed "
        "test's traceback until the next test runs)."
    )


def checked_for_leaks(item: pytest.Item) -> LeakSettings | None:
    """How the checker checks ``item`` for leaks (planned at its setup), ``None`` when
    the test is not checked for leaks."""
    check = item.stash.get(_CHECK, None)
    return check.settings if check is not None and check.leaks else None


def _test_function(item: pytest.Item) -> tuple[str, str] | None:
    """Where the test's own frame is, so the frames that called it (pytest's) are cut."""
    function = getattr(item, "function", None)
    code = getattr(function, "__code__", None)
    return (code.co_filename, code.co_name) if code is not None else None
