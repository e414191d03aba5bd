"""The CUDA leak checker: measures the tests that are checked.

Registered by :mod:`pytest_cuda.leaks.plugin` only when ``--cuda-leak-check``,
``--cuda-leak-trace`` or ``--cuda-memory-report`` asks for it or a collected test
carries the ``cuda_leak_check`` marker, so a run that uses none of them never imports
this module (nor the seam and the leak arithmetic it needs).

When a checked test is measured (this process's caching allocator, per device):

* baseline: before its first function-scoped fixture is set up, or at the start of the
  call when it has none; fixtures of a wider scope set up later (``getfixturevalue``)
  are not the test's, and their growth is subtracted;
* end: once the test and its function-scoped fixtures are torn down, before any wider
  fixture is (its ``pytest_fixture_post_finalizer``), else at the end of teardown;
* a test whose reading did not grow is clean (a few µs). Otherwise the failed test's
  frames and its fixture values, which pytest drops right after teardown anyway, are
  released (refcounting frees them at once), and :func:`pytest_cuda.leaks.engine.settle`
  decides: garbage collection and the library caches only for what is still there.
  The collection walks only what the test made (:class:`pytest_cuda.leaks.heap.TestHeap`
  froze the older heap at the baseline), so it costs the test's size, not the process's;
* what is still there is attributed from the run itself: the live blocks allocated
  since the baseline (torch's allocator records their stacks while checks run,
  :class:`pytest_cuda.leaks.stacks.StackRecording`), the line that allocated them, and
  the holder of their tensors (the walk stops after the ``cuda_leak_holder_search``
  ini value, 0.3 s, unless ``--cuda-leak-trace``). When the walk proves every holder
  alive (a module's global, a fixture's value), the leak is certain; otherwise one
  collection of the whole heap decides, so garbage that older objects take part in is
  never called a leak.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import pytest

from gpumagic import cuda
from pytest_cuda.leaks.engine import (
    FULL_COLLECTION,
    CudaLeakWarning,
    CudaMemory,
    LeakResult,
    MemorySource,
    Mode,
    SettleStep,
    growth,
    kept_by_library,
    parse_leak_settings,
    settle,
)
from pytest_cuda.leaks.heap import TestHeap
from pytest_cuda.leaks.report import MARKER, REPORT_LEAK, REPORT_PEAK, LeakReport
from pytest_cuda.leaks.rerun import ENV_OUT, rerun_alone, write_reports
from pytest_cuda.leaks.stacks import StackRecording, attribute
from pytest_cuda.settings import settings_of

if TYPE_CHECKING:
    from collections.abc import Generator, Sequence
    from types import TracebackType

__all__ = ["LeakChecker", "checked_for_leaks", "cuda_leak_check"]

SECTION = "CUDA memory leak"
#: The settle step that collects the whole heap, older objects included.
WHOLE_HEAP = "garbage collection (the whole heap)"


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


def cuda_leak_check(tolerance: object = None, mode: object = "fail") -> tuple[object, object]:
    """The marker's signature (its name shows in the errors about its arguments)."""
    return tolerance, mode


class LeakChecker:
    """Measures the tests that are checked (``--cuda-leak-check``, the marker) and the
    peaks for ``--cuda-memory-report``; registered only when one of them is used."""

    def __init__(self, config: pytest.Config, *, leaks: bool = True) -> None:
        self.config = config
        settings = settings_of(config)
        self.everywhere = settings.leak_check
        self.peaks = settings.memory_report > 0
        self.search_s = settings.holder_search_s
        # Stacks of live blocks are recorded whenever a test may be checked for leaks.
        self.recording = StackRecording() if leaks else None
        self.heap = TestHeap()
        self.source = CudaMemory(reset_caches=settings.leak_reset_caches)
        self.tolerance = settings.leak_tolerance
        self.root = str(config.rootpath)
        self._current: _Check | None = None
        # Opt-in: a leak is re-run alone in a fresh process (never from a re-run child).
        rerun_child = bool(os.environ.get(ENV_OUT))
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
        if cuda.is_initialized():
            self.recording.ensure()
        elif cuda.status().available:
            cuda.start_torch()
            self.recording.ensure_at_init()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.heap.thaw()
        if self.recording is not None:
            self.recording.close()
        if self.reports is not None:
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
            return _Check(item, self.tolerance, "fail", leaks=self.everywhere)
        tolerance, mode = cuda_leak_check(*marker.args, **marker.kwargs)
        tolerance, mode = parse_leak_settings(
            self.tolerance if tolerance is None else tolerance, mode, where=MARKER
        )
        if mode == "off" and not self.peaks:
            return None
        return _Check(item, tolerance, mode, leaks=mode != "off")

    def _begin(self, check: _Check) -> None:
        if self.recording is not None and check.leaks:
            self.recording.ensure()
            self.heap.begin()
        check.start_us = time.time_ns() // 1000
        check.first = self.source.read()

    def _finish(self, check: _Check) -> None:
        if check.done:
            return
        check.done = True
        try:
            if check.ran:  # else setup failed or skipped: the test never ran
                self._measure(check)
        except Exception as exc:  # a bug here must not hide the test's own outcome
            check.failure = f"{type(exc).__name__}: {exc}"
        finally:
            self.heap.thaw()

    def _measure(self, check: _Check) -> None:
        end = self.source.read()
        if self.peaks:
            check.peak = _peaks(check.start_stats, end)
        if not check.leaks:
            return
        baseline = check.first or {}
        if _within(check, baseline, end):
            return
        # Usually the function-scoped fixtures' values: freed at once by refcount, and
        # the test is as clean as one that never grew.
        _release_test_references(check.item)
        end = self.source.read()
        if _within(check, baseline, end):
            return
        # The collection walks only what the test made where the older heap is frozen;
        # else (the collector is off, or the user froze objects first) it would walk
        # the whole heap, so it waits until the walk has not proven the leak alive, as
        # a collection of the older objects does.
        source = self.source if self.heap.frozen else _without(self.source, FULL_COLLECTION)
        result = settle(baseline, source, check.tolerance, held=check.held, after=end)
        if not result.clean:
            # Where the test's own tensors are: among the objects it made. Only the
            # tensors are kept: the list of every young object would be one more
            # referrer of each, for the walk to go through.
            young = self.heap.young_objects()
            tensors = None if young is None else cuda.tensors_among(young)
            del young
            # The walk goes up among them first, and thaws before it scans the whole
            # heap (the first step that needs to).
            result = self._stacks(check, result, tensors)
            self.heap.thaw()
            del tensors
            if not (result.holders is not None and result.holders.alive):
                result = self._collect_whole_heap(check, result)
        if not result.clean:
            result = kept_by_library(result)
        if not result.clean and self.reruns_left > 0:
            self.reruns_left -= 1
            result = replace(result, rerun=rerun_alone(self.config, check.item.nodeid))
        check.result = result

    def _collect_whole_heap(self, check: _Check, result: LeakResult) -> LeakResult:
        """Garbage that objects older than the test take part in is freed only by a
        collection of the whole heap: run it unless the walk proved the leak alive."""
        step = SettleStep(WHOLE_HEAP, self.heap.collect_everything)
        again = settle(
            check.first or {}, _Steps(self.source, (step,)), check.tolerance, held=check.held
        )
        released = (*result.released, *again.released)
        if again.clean:
            return replace(again, released=released)
        if again.leaked == result.leaked:
            return replace(result, released=released)
        # Part of it was garbage: attribute what is left.
        return replace(self._stacks(check, again, None), released=released)

    def _stacks(
        self, check: _Check, result: LeakResult, objects: Sequence[object] | None
    ) -> LeakResult:
        if self.recording is None:
            return result
        if not cuda.memory_history_enabled():
            return replace(
                result,
                stack_note="Stacks not recorded: allocation-stack recording was off "
                "(switched off by the test?).",
            )
        stacks, holders = attribute(
            check.start_us,
            result.leaked,
            _test_function(check.item),
            objects=objects,
            budget_s=self.search_s,
            frozen_before=self.heap.frozen_before,
            # Still frozen: the walk goes up among the test's objects first.
            thaw=self.heap.thaw if self.heap.frozen else None,
        )
        return replace(result, stacks=stacks, holders=holders)

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
        if not (check.leaks and check.ran) or check.failure is not None:
            return  # not checked, never ran, or could not be measured (an error says so)
        result = check.result
        if result is None:  # nothing grew
            leak = LeakReport(check.mode, (), (), tolerance=check.tolerance)
        else:
            leak = LeakReport(
                mode=check.mode,
                leaked=tuple(sorted(result.leaked.items())),
                kept=tuple(
                    (step, tuple((d, b) for d, b in sorted(freed.items()) if b > 0))
                    for step, freed in result.kept_by_libraries()
                ),
                details=result.details(_subject(check.item), self.root) if result.leaked else "",
                top=result.top_frame(self.root) or (result.rerun.top if result.rerun else None),
                failed_by_leak=check.raised,
                holder=result.holder() or (result.rerun.holder if result.rerun else None),
                tolerance=check.tolerance,
            )
        data = leak.to_dict()
        setattr(report, REPORT_LEAK, data)
        # JUnit XML properties: junitxml writes a test's at its teardown report.
        report.user_properties.extend(leak.properties())
        if self.reports is not None:
            self.reports[check.item.nodeid] = data
        if leak.leaked:
            report.sections.append((SECTION, leak.details))


@dataclass(frozen=True)
class _Steps:
    """A source read as ``source`` is, settled by ``steps`` alone."""

    source: MemorySource
    steps: tuple[SettleStep, ...]

    def read(self) -> dict[int, int]:
        return self.source.read()

    def settle_steps(self) -> Sequence[SettleStep]:
        return self.steps


def _without(source: MemorySource, name: str) -> MemorySource:
    """``source`` with its settle step ``name`` left out."""
    return _Steps(source, tuple(s for s in source.settle_steps() if s.name != name))


def checked_for_leaks(item: pytest.Item) -> tuple[int, Mode] | None:
    """The tolerance and mode the checker measures ``item`` with (planned at its setup),
    ``None`` when the test is not checked for leaks."""
    check = item.stash.get(_CHECK, None)
    return (check.tolerance, check.mode) if check is not None and check.leaks else None


def _within(check: _Check, baseline: dict[int, int], reading: dict[int, int]) -> bool:
    """No device grew past the test's tolerance between ``baseline`` and ``reading``."""
    return all(g <= check.tolerance for g in growth(baseline, reading, check.held).values())


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
