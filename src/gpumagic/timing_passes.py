"""What a ``%cudatime`` measurement is given and reports, and the passes around its
runs: the SM clock read after each run (and runs set apart by it), the CUPTI kernel
pass (``--kernels``, ``--validate``, and ``--timer cupti``'s headline), ``--sync-check``
and the counting call (planned before the runs, in the budget: :mod:`gpumagic.timing_budget`).

:class:`Passes` is the part of :class:`~gpumagic.timing_runs.Timer` that works on a
finished set of runs. CUDA only through :mod:`gpumagic.cuda`; no IPython.
"""

from __future__ import annotations

import dataclasses
import linecache
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpumagic import cuda
from gpumagic import timing_checks as checks
from gpumagic.stacks import FrameFilter
from gpumagic.timing_budget import count_estimate, count_reserve, count_skipped
from gpumagic.timing_counts import count_work, counting_asked, set_peaks
from gpumagic.timing_plan import FEWEST_RUNS, Body, Run, TimingOptions
from gpumagic.timing_result import CudaTimeResult, KernelStat, SyncSite

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from gpumagic.cuda import KernelProfile

__all__ = ["Passes", "Report", "Setup"]

PROFILE_TARGET = 0.1  # seconds of body time under the profiler
PROFILE_MAX_LOOPS = 1000  # loops per profiled run
CUPTI_RUNS = 7  # profiled runs behind --timer cupti's headline (as MIN_RUNS)
CUPTI_TARGET = 0.25  # seconds of body time under the profiler for them all
SYNC_CHECK_LOOPS = 10
SYNC_CHECK_TARGET = 0.5


@dataclass(frozen=True)
class Setup:
    """What one measurement is given, fixed for its whole length."""

    body: Body
    options: TimingOptions
    label: str
    code_files: tuple[str, ...]
    compile_time: float
    clock: Callable[[], float]
    #: Where to say something before a long wait (``None``: nowhere).
    say: Callable[[str], None] | None = None


@dataclass
class Report:
    """The warnings and notes a measurement gathers as it runs."""

    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Options asked for and not applied, with why (``--graph not used: needs CUDA``).
    not_applied: list[str] = field(default_factory=list)
    interrupted: bool = False

    def interrupt(self, where: str, what: str = "these are the results so far") -> None:
        """Ctrl-C ended the measurement ``where``: the first warning says so, and
        ``what`` the numbers are."""
        self.interrupted = True
        self.warnings.insert(0, f"interrupted (Ctrl-C) {where}" + (f": {what}" if what else ""))


class Passes:
    """The SM clock of each run and the passes after the runs (see the module)."""

    setup: Setup
    options: TimingOptions
    report: Report
    body_error: BaseException | None
    devices: list[int]
    device: int
    dram_peak: float | None
    #: Whether to read the SM clock after each run (GPU timing, while NVML answers).
    read_clocks: bool = False
    default_mhz: int | None = None
    #: The counting call: the seconds reserved for it before the runs, those the
    #: counters' set-up took (before the runs where it was planned) and all it took,
    #: and why it was left out.
    count_reserve: float = 0.0
    count_setup: float = 0.0
    count_spent: float = 0.0
    count_left_out: str = ""

    if TYPE_CHECKING:

        def call(self, n: int) -> None: ...

        def _block(self, n: int, spin: bool = True) -> Run: ...

    # -- the SM clock -------------------------------------------------------------------
    def _clocked(self, run: Run) -> Run:
        """``run`` with the SM clock and NVML's reasons read now, right after it (the
        clock moves over milliseconds, so this is the clock the run ran at)."""
        if not self.read_clocks:
            return run
        reading = cuda.sm_clock(self.device)
        if reading is None:
            self.read_clocks = False  # NVML cannot say here: stop asking
            return run
        self.default_mhz = reading.default_mhz
        return dataclasses.replace(run, sm_mhz=reading.mhz, clock_reasons=reading.reasons)

    def _apply_clocks(
        self, result: CudaTimeResult, runs: Sequence[Run], profiled: Sequence[Run] | None
    ) -> None:
        """Put the clocks of the runs behind ``result.all_runs`` (``profiled`` under
        ``--timer cupti``, where ``runs`` are the event runs beside them, else ``runs``)
        on the result: the range, NVML's reasons, the runs set apart by their clock
        (dropped with ``--clock-outliers drop``), and one line when the GPU was held back."""
        if profiled is not None:
            result.event_clocks_mhz = [r.sm_mhz for r in runs]
            runs = profiled
        clocks = [r.sm_mhz for r in runs]
        if len(runs) != len(result.all_runs):
            return  # --timer cupti's runs taken together: no clock per run
        if all(c is None for c in clocks):
            if self.options.clock_outliers == "drop" and result.clock == "gpu":
                self.report.warnings.append(
                    "--clock-outliers drop: the SM clock is unknown here (NVML cannot read "
                    "it), so no runs were set apart"
                )
            return
        keep, apart = checks.split_off_clock(clocks)
        span = checks.clock_range(clocks)
        assert span is not None
        drop = bool(apart) and self.options.clock_outliers == "drop"
        if drop and len(keep) < FEWEST_RUNS:
            self.report.warnings.append(
                f"--clock-outliers drop: {len(keep)} runs would be left, fewer than "
                f"{FEWEST_RUNS}: all {len(runs)} kept"
            )
            drop = False
        if apart:
            timings = result.timings
            result.clock_outliers = [(timings[i], clocks[i] or 0) for i in apart]
            result.clock_outliers_dropped = drop
            self.report.notes.append(
                checks.outlier_note(
                    result.clock_outliers, len(runs), span[1], drop, result.precision
                )
            )
        if drop:
            result.all_runs = [result.all_runs[i] for i in keep]
            if len(result.host_runs) == len(runs):
                result.host_runs = [result.host_runs[i] for i in keep]
            result.repeat = len(keep)
            runs = [runs[i] for i in keep]
        mask = 0
        for r in runs:
            mask |= r.clock_reasons or 0
        result.run_clocks_mhz = [r.sm_mhz for r in runs]
        result.default_clock_mhz = self.default_mhz
        result.throttle_reasons = checks.reason_names(mask)
        result.throttled_runs = sum(checks.is_throttling(r.clock_reasons) for r in runs)
        line = checks.throttle_line(
            result.run_clocks_mhz,
            result.default_clock_mhz,
            result.throttle_reasons,
            result.throttled_runs,
        )
        if line:
            self.report.warnings.append(line)

    # -- optional passes ------------------------------------------------------------------
    def _extra_passes(
        self,
        result: CudaTimeResult,
        measure: Callable[[int], Run],
        loops: int,
        unroll: int,
        flushes: bool = False,
    ) -> list[Run] | None:
        """The passes after the runs; returns the profiled runs when ``--timer cupti``
        made them the headline's runs."""
        options = self.options
        headline = None
        if self.report.interrupted:
            return None  # Ctrl-C in the runs: nothing more is run
        try:
            if options.kernels or options.validate or options.timer == "cupti":
                headline = self._kernel_pass(result, measure, loops, unroll, flushes)
            if options.sync_check:
                self._sync_pass(result, loops)
            self._count(result)
        except KeyboardInterrupt:
            self.report.interrupt("during the optional passes")
        result.interrupted = self.report.interrupted
        return headline

    def _kernel_pass(
        self,
        result: CudaTimeResult,
        measure: Callable[[int], Run],
        loops: int,
        unroll: int,
        flushes: bool,
    ) -> list[Run] | None:
        cupti = self.options.timer == "cupti"
        flag = "--timer cupti" if cupti else "--kernels"
        fallback = ": the headline is CUDA events" if cupti else ""
        steps = CUPTI_RUNS if cupti else 1
        target = CUPTI_TARGET / steps if cupti else PROFILE_TARGET
        per_loop = max(result.host_time, result.median)
        count = int(min(loops, PROFILE_MAX_LOOPS, max(1, target / max(per_loop, 1e-9))))
        count = max(unroll, count - count % unroll)
        done: list[Run] = []

        def work() -> None:
            run = measure(count) if flushes else self._block(count, spin=False)
            done.append(self._clocked(run) if cupti else run)

        try:
            profile = cuda.profile_kernels(
                lambda: measure(unroll),
                work,
                self.devices,
                flushes=count * steps if flushes else 0,
                steps=steps,
            )
        except Exception as exc:
            if exc is self.body_error:
                raise
            self.report.warnings.append(f"{flag}: torch.profiler failed ({exc!r}){fallback}")
            return None
        total = count * steps
        if flushes and profile.flushes_removed != total:
            self.report.warnings.append(
                f"--cold: {profile.flushes_removed} of {total} L2 flushes could be told apart "
                "in the CUPTI record; the kernel figures may include the rest"
            )
        if profile.busy_us == 0 and result.mode != "eager":
            # The graph was not empty when captured: CUPTI missed its kernels.
            self.report.warnings.append(
                f"{flag}: CUPTI recorded no kernels for the CUDA graph replays{fallback}; "
                "run without --graph for kernel figures"
            )
            return None
        result.kernel_loops = total
        result.kernel_time = profile.busy_us * 1e-6 / total
        result.kernel_span = profile.span_us * 1e-6 / total if profile.span_us else None
        result.kernels = [
            KernelStat(name, calls / total, us * 1e-6 / total)
            for name, calls, us in profile.kernels
        ]
        # Busy against the wall time of the same loops: both in the same clock state.
        host = sum(r.host for r in done)
        wall = host / total if host > 0 else result.host_time
        if wall > 0:
            result.busy_fraction = min(1.0, result.kernel_time / wall)
        events = sum(r.gpu for r in done) / total
        result.cupti_events_time = events
        if self.options.validate and result.kernel_time > 0:
            result.cupti_ratio = events / result.kernel_time
        if not cupti:
            return None
        if profile.busy_us == 0:
            self.report.warnings.append(
                f"{flag}: CUPTI recorded no kernels (no GPU work?){fallback}"
            )
            return None
        return self._cupti_headline(result, profile, done, count)

    def _cupti_headline(
        self, result: CudaTimeResult, profile: KernelProfile, done: list[Run], count: int
    ) -> list[Run]:
        """Make CUPTI's kernel time of the profiled runs the headline; the event runs
        stay beside it (:attr:`~CudaTimeResult.event_timings`)."""
        old_loops = result.loops
        result.event_timings = result.timings
        if len(profile.runs_us) == len(done):
            runs, loops = [us * 1e-6 for us in profile.runs_us], count
        else:
            self.report.warnings.append(
                "--timer cupti: CUPTI's record could not be split into the profiled runs: "
                "the headline is their kernel time together, with no spread"
            )
            runs, loops = [profile.busy_us * 1e-6], count * len(done)
            done = []
        result.timer = "cupti"
        result.all_runs = runs
        result.loops = loops
        result.repeat = len(runs)
        # The host wall stays that of the runs without the profiler, per loop.
        result.host_runs = [h / old_loops * loops for h in result.host_runs]
        result.floor = None  # CUPTI times kernels: no empty-run floor
        return done

    def _counting(self) -> bool:
        """Whether a count is asked for and can find anything (torch was imported)."""
        return counting_asked(self.options) and cuda.can_count()

    def _plan_count(self, per_loop: float) -> None:
        """Before the runs, from the warm-up's ``per_loop``: when the counting call looks
        like it fits its share of the budget, the counters loaded (the first count of a
        process imports several hundred modules: timed, outside the budget) and the
        call's time reserved from the runs'. :meth:`_count` decides again on the runs."""
        budget = self.options.budget
        estimate = count_estimate(per_loop)
        if self._counting() and not count_skipped(estimate, budget):
            self._load_counters()
            self.count_reserve = count_reserve(estimate, budget)

    def _load_counters(self) -> None:
        t0 = self.setup.clock()
        if cuda.load_counters():
            self.count_setup = self.setup.clock() - t0
            self.count_spent += self.count_setup

    def _count(self, result: CudaTimeResult) -> None:
        """The counting call: one more call, after every timed one (outside them all),
        in the budget; left out, and a note says so, when the runs' median says it does
        not fit (the warm-up's estimate can be far off on a loaded machine)."""
        if not self._counting():
            return
        self.count_left_out = count_skipped(count_estimate(result.host_time), self.options.budget)
        if self.count_left_out:
            self.report.notes.append(self.count_left_out + ".")
            return
        self._load_counters()
        t0 = self.setup.clock()
        try:
            warnings, notes = count_work(lambda: self.call(1), result, self.options)
            if warnings:
                self.body_error = None  # reported here, not raised
            if self.devices:
                cuda.synchronize(self.devices)
        finally:
            self.count_spent += self.setup.clock() - t0
        set_peaks(result, self.dram_peak)
        self.report.warnings.extend(warnings)
        self.report.notes.extend(notes)

    def _sync_pass(self, result: CudaTimeResult, loops: int) -> None:
        per_loop = max(result.host_time, 1e-9)
        count = max(1, min(loops, SYNC_CHECK_LOOPS, int(SYNC_CHECK_TARGET / per_loop)))
        try:
            events = cuda.catch_syncs(
                lambda: self.call(count),
                self.setup.code_files,
                is_user=FrameFilter.default().is_user,
            )
        finally:
            cuda.synchronize(self.devices)
        sites: dict[tuple[str, str, int], int] = {}
        for e in events:
            key = (e.op, e.filename, e.lineno)
            sites[key] = sites.get(key, 0) + 1
        result.syncs_per_loop = len(events) / count
        result.sync_sites = [
            SyncSite(op, self._where(filename, lineno), _source(filename, lineno), n / count)
            for (op, filename, lineno), n in sorted(sites.items(), key=lambda kv: -kv[1])
        ]

    def _where(self, filename: str, lineno: int) -> str:
        if filename in self.setup.code_files:
            return f"line {lineno}"
        return f"{os.path.basename(filename)}:{lineno}"


def _source(filename: str, lineno: int) -> str:
    return linecache.getline(filename, lineno).strip()
