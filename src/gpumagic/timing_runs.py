"""The runs behind a ``%cudatime`` measurement: the first call, warm-up, runs of
back-to-back calls between CUDA events (or host clock reads), CUDA graph replays,
cold-L2 single calls (with their L2 check); the SM clock after each run and the passes
after the runs are :class:`~gpumagic.timing_passes.Passes`'.

Called by :func:`gpumagic.timing.time_cuda`, which decides the verdict; the rules for
sizing, stopping and warnings are :mod:`gpumagic.timing_plan`'s. CUDA only through
:mod:`gpumagic.cuda`; no IPython.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
from typing import TYPE_CHECKING, Any, NamedTuple

from gpumagic import cuda
from gpumagic import timing_checks as checks
from gpumagic.gc_pause import paused_gc
from gpumagic.timing_budget import WARMUP_SHARE, BudgetSpent, wait_note
from gpumagic.timing_counts import set_peaks
from gpumagic.timing_passes import Passes, Report, Setup
from gpumagic.timing_plan import (
    FEWEST_RUNS,
    Body,
    Loops,
    Run,
    block_target,
    enough_runs,
    loops_for,
    side_work,
    unroll_for,
    warnings_for,
)
from gpumagic.timing_result import CudaTimeResult
from gpumagic.units import format_time, quantile

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["Measured", "Timer"]

# A spin kernel ahead of each run's start events, long enough that the host has
# launched the body (and recorded the end events) before the GPU reaches it. 30 µs was
# not: once torch.profiler has run in a process, launches are slower for a while, and
# single cold calls of a 7 µs kernel measured 26 to 54 µs instead of 9.5 µs (H100).
SPIN_US = 100.0
STEADY = 0.10  # two warm-up batches this close count as steady
MAX_RESIZES = 3  # times the runs may be resized when a run is far from the target length
COLD_PASS_LOOPS = 20  # single cold calls profiled / sync-checked
COLD_CHECK_RUNS = 9  # warm single calls beside the cold ones, for --cold's L2 check


class Measured(NamedTuple):
    """A measurement before its verdict: the result, the runs behind it, and whether
    the body launched GPU work at all."""

    result: CudaTimeResult
    runs: Sequence[Run]
    gpu_work: bool = True


class Timer(Passes):
    """One measurement's moving parts. Set once: the :class:`Setup`; the devices and
    their calibration (:meth:`_gpu`, :meth:`_calibrate`). Grown as it runs: the report
    and the body's own exception (told apart from ours)."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.options = setup.options
        self.clock = setup.clock
        self.report = Report()
        self.body_error: BaseException | None = None
        self.runner: Body = self.call  # the body, or replays of its CUDA graph
        self.devices: list[int] = []
        self.device = 0
        self.baseline_tail = 0.0
        self.floor = 0.0
        self.dram_peak: float | None = None  # what the hardware reports
        # The budget's clock: its start (the first call's end), when the runs kept began
        # (warm-up and sizing before), and when they ended.
        self.began = self.sized = self.ran = 0.0
        self.per_loop = 0.0  # the warm-up's estimate, per loop of the body
        self.count_before_runs = 0.0  # seconds of the counting call's set-up before them
        # What Ctrl-C in the first run leaves: the loops that run finished, timed, and
        # the last warm-up or sizing batch.
        self.partial: Run | None = None
        self.last_batch: Run | None = None

    # -- the body, and telling its exceptions from ours ---------------------------------
    def call(self, n: int) -> None:
        try:
            self.setup.body(n)
        except BaseException as exc:
            if not isinstance(exc, KeyboardInterrupt):
                self.body_error = exc
            raise

    def host_only(self, why: str) -> Measured:
        """Time on the host (``--device cpu``, or no GPU here: ``why``)."""
        self._cuda_options_ignored("--device cpu" if self.options.host_only else "needs CUDA")
        self.report.notes.append(f"Timed on the host like %timeit ({why}).")
        return self._host(first_call=None)

    def _cuda_options_ignored(self, reason: str) -> None:
        """One warning for the options that need CUDA (the note that follows says why),
        and each of them as not applied, for ``reason``."""
        flags = self.options.cuda_only()
        self.report.not_applied.extend(f"{flag} not used: {reason}" for flag in flags)
        if flags:
            named = flags[0] if len(flags) == 1 else ", ".join(flags[:-1]) + " and " + flags[-1]
            self.report.warnings.append(
                f"{named} {'needs' if len(flags) == 1 else 'need'} CUDA: not used"
            )

    # -- host timing ------------------------------------------------------------------
    def _host_run(self, n: int) -> Run:
        # paused_gc, written out: this runs once per run, 200000 times for -r 200000.
        enabled = gc.isenabled()
        gc.disable()
        try:
            t0 = self.clock()
            try:
                self.call(n)
            except KeyboardInterrupt:
                elapsed = self.clock() - t0
                self._cut_short(math.nan, elapsed, elapsed)
                raise
            elapsed = self.clock() - t0
        finally:
            if enabled:
                gc.enable()
        return Run(n, math.nan, elapsed, elapsed)

    def _cut_short(self, gpu: float, host: float, enqueue: float, tail: float = 0.0) -> None:
        """Keep what a run of the body cut short by Ctrl-C measured: the loops it
        finished (all it started but the one interrupted), when the body counts them."""
        body = self.setup.body
        if self.runner == self.call and isinstance(body, Loops) and body.started() > 1:
            self.partial = Run(body.started() - 1, gpu, host, enqueue, tail)

    def _host(self, first_call: float | None) -> Measured:
        if first_call is None:
            t0 = self.clock()
            self.call(1)
            first_call = self.clock() - t0
        self.began = self.clock()
        per_loop = self._warm_up(self._host_run)
        loops = self._loops(self._host_run, 1, per_loop)
        self.floor = self._host_floor()
        runs = self._runs(self._host_run, loops, primary="host")
        result = self._result(runs, clock="host", mode="eager", first_call=first_call)
        try:
            if not self.report.interrupted:
                self._count(result)
        except KeyboardInterrupt:
            self.report.interrupt("while counting FLOPs and bytes")
            result.interrupted = True
        self._account(result, runs)
        return Measured(result, runs)

    def _host_floor(self) -> float:
        """What a run of no loops takes: the clock reads and the calls that reach the
        body (of no loops, so none of its code runs)."""
        return quantile([self._host_run(0).host for _ in range(5)], 0.5)

    # -- GPU timing -------------------------------------------------------------------
    def gpu(self) -> Measured:
        """Time on the GPU, or on the host when the body launches no GPU work."""
        options = self.options
        t0 = self.clock()
        self.call(1)
        if not cuda.is_initialized():
            first_call = self.clock() - t0
            self._cuda_options_ignored("no GPU work in the body")
            self.report.notes.append(
                "The body never initialised CUDA, so it launched no GPU work (CPU tensors?): "
                "timed on the host like %timeit."
            )
            return self._host(first_call=first_call)._replace(gpu_work=False)
        self.device = options.device if options.device is not None else cuda.current_device()
        # Work can only have been queued on devices with a context, and the current one.
        self.devices = sorted({self.device, cuda.current_device(), *cuda.devices_with_context()})
        cuda.synchronize(self.devices)
        first_call = self.clock() - t0
        streams = cuda.current_streams(self.devices)
        try:
            measured = self._gpu_measure(first_call)
        except BaseException:
            with contextlib.suppress(Exception):
                cuda.synchronize(self.devices)
            with contextlib.suppress(Exception):
                cuda.restore_streams(streams)
            raise
        cuda.synchronize(self.devices)
        cuda.restore_streams(streams)
        return measured

    def _gpu_measure(self, first_call: float) -> Measured:
        options = self.options
        self.began = self.clock()
        self._calibrate()
        mode = "eager"
        per_loop = self._warm_up(self._block)
        unroll = 1
        if options.graph:
            graph = self._capture(per_loop)
            if graph is not None:
                self.runner, unroll = graph
                mode = "graph"
        self.read_clocks = True
        if options.cold:
            buffer = self._flush_buffer()
            if buffer is not None:
                return self._cold(buffer, first_call, mode)
        measure = self._block
        loops = self._loops(measure, unroll, per_loop if mode == "eager" else None)
        runs = self._runs(measure, loops, primary="gpu", unroll=unroll)
        result = self._result(runs, clock="gpu", mode=mode, first_call=first_call)
        profiled = self._extra_passes(result, measure, loops, unroll)
        self._apply_clocks(result, runs, profiled)
        self._account(result, runs)
        return Measured(result, runs)

    def _calibrate(self) -> None:
        """The idle devices' sync latency and the event floor, from empty runs."""
        runs = [self._block(0) for _ in range(5)]
        self.baseline_tail = quantile([r.tail for r in runs], 0.5)
        self.floor = quantile([r.gpu for r in runs], 0.5) + 0.5e-6  # event quantum

    def _block(self, n: int, spin: bool = True) -> Run:
        run = self.runner
        devices = self.devices
        cuda.synchronize(devices)
        if spin:
            for d in devices:
                cuda.spin(d, SPIN_US)
        starts = [cuda.record_event(d) for d in devices]
        with paused_gc():
            t0 = self.clock()
            try:
                run(n)
            except KeyboardInterrupt:
                # The loops launched so far, to their end on the GPU (nothing else waits).
                t_enqueued = self.clock()
                ends, t_end, t1 = self._finish()
                spans = [cuda.elapsed_ms(s, e) / 1e3 for s, e in zip(starts, ends, strict=True)]
                self._cut_short(max(spans), t1 - t0, t_enqueued - t0, t1 - t_end)
                raise
            t_enqueued = self.clock()
            ends, t_end, t1 = self._finish()
        spans = [cuda.elapsed_ms(s, e) / 1e3 for s, e in zip(starts, ends, strict=True)]
        return Run(n, max(spans), t1 - t0, t_enqueued - t0, t1 - t_end)

    def _finish(self) -> tuple[list[Any], float, float]:
        """End events on the timed streams; returns them, the host time they were seen
        passed (polled: no wake-up latency) and the time the devices were idle."""
        devices = self.devices
        ends = [cuda.record_event(d) for d in devices]
        for end in ends:
            while not cuda.event_completed(end):
                pass
        t_end = self.clock()
        cuda.synchronize(devices)
        return ends, t_end, self.clock()

    # -- warm-up and run sizing -------------------------------------------------------
    def _warm_up(self, measure: Callable[[int], Run]) -> float:
        """Warm up; returns the estimated wall time per loop."""
        options = self.options
        if options.warmup is not None:
            if options.warmup:
                self.call(options.warmup)
            self.last_batch = measure(1)
            self.per_loop = self.last_batch.per_loop
            return self.per_loop
        target = block_target(options.budget)
        end = self.began + WARMUP_SHARE * options.budget  # warm-up and sizing's share
        n, previous, settled = 1, None, False
        start = self.clock()
        while True:
            r = self.last_batch = measure(n)
            per = r.per_loop
            settled = previous is not None and abs(per - previous) <= STEADY * previous
            spent = self.clock() - start
            # No batch is started that could end past the share (a batch is at most
            # twice as long as the last: doubled, or the same loops on a noisy machine).
            if settled or self.clock() + 2 * r.host > end:
                break
            previous = per
            if r.host < target / 2:  # batches grow until they are about a run long
                n *= 2
        if not settled and previous is not None:
            self.report.warnings.append(
                f"warm-up did not settle within {format_time(spent)}: the time per loop still "
                f"changed by {abs(per - previous) / previous * 100:.0f} % between batches; "
                "give it more with -w or --budget"
            )
        self.per_loop = per
        return per

    def _loops(self, measure: Callable[[int], Run], unroll: int, per_loop: float | None) -> int:
        if per_loop is None:  # graph replays: time one replay for the estimate
            measure(unroll)
            r = self.last_batch = measure(unroll)
            per_loop = max(r.host, r.gpu) / unroll
        loops, note = loops_for(self.options, per_loop, unroll)
        if note:
            self.report.notes.append(note)
        return loops

    def _runs(
        self,
        measure: Callable[[int], Run],
        loops: int,
        primary: str,
        unroll: int = 1,
        fixed: bool = False,
    ) -> list[Run]:
        """Runs of ``loops`` loops until :func:`~gpumagic.timing_plan.enough_runs`, after
        the counting call is planned (its time reserved from the budget) and, before
        runs that will last long past the budget, the wait is said.

        While ``-n`` is not given, a run far from the target length (the warm-up estimate
        was off: the body was still getting faster, say) resizes the runs and starts
        over, while the fewest runs of the target length still fit in the budget.
        """
        options = self.options
        runs: list[Run] = []
        values: list[float] = []  # the runs' primary clock, grown with them (not rebuilt)
        target = block_target(options.budget)
        resizes = MAX_RESIZES if fixed or options.loops is not None else 0
        self.sized = self.clock()
        try:
            self._plan_count(self.per_loop)
            self.count_before_runs = self.count_spent  # the counters' set-up, if made
            # The counters' set-up (once a session, seconds on some machines) is outside
            # the budget, like the first call: it does not take the runs' time.
            deadline = self.began + self.count_setup + options.budget - self.count_reserve
            self.sized = self.clock()  # the start of the runs kept (after the last resize)
            self._say_wait(loops, deadline)
            while True:
                run = self._clocked(measure(loops))
                if (
                    resizes < MAX_RESIZES
                    and self.clock() + FEWEST_RUNS * target <= deadline
                    and self._off_target(run, target, unroll)
                ):
                    resizes += 1
                    loops = max(unroll, round(target / run.per_loop / unroll) * unroll)
                    runs.clear()
                    values.clear()
                    self.sized = self.clock()
                    continue
                runs.append(run)
                values.append(run.gpu if primary == "gpu" else run.host)
                if enough_runs(
                    options, values, now=self.clock(), next_run=run.host, deadline=deadline
                ):
                    break
        except KeyboardInterrupt:
            if not self._interrupted(runs, loops):
                raise
        self.ran = self.clock()
        return runs

    def _say_wait(self, loops: int, deadline: float) -> None:
        """Say how long runs expected to last long past the budget will take."""
        say, batch = self.setup.say, self.last_batch
        if say is None or batch is None:
            return
        text = wait_note(batch.per_loop, loops, self.options.repeat, deadline - self.clock())
        if text:
            say(text)

    def _interrupted(self, runs: list[Run], loops: int) -> bool:
        """Ctrl-C in the runs: keep those made; in the first one, the loops it finished,
        else the last warm-up or sizing batch if it had more. ``False``: nothing to keep."""
        if runs:
            self.report.interrupt(f"after {len(runs)} run{'s' if len(runs) > 1 else ''}")
            return True
        partial, batch = self.partial, self.last_batch
        if partial is not None and (batch is None or partial.loops >= batch.loops):
            runs.append(partial)
            self.report.interrupt(f"after {partial.loops:,} of {loops:,} loops", "")
        elif batch is not None:
            runs.append(batch)
            self.report.interrupt(
                "before the first run ended",
                f"timed over the warm-up's {batch.loops:,} loop{'s' if batch.loops > 1 else ''}",
            )
        else:
            return False
        return True

    def _account(self, result: CudaTimeResult, runs: Sequence[Run]) -> None:
        """Where the budget went, on the result, and the note that says it when it
        matters (not after Ctrl-C: the user stopped it)."""
        spent = BudgetSpent(
            budget=self.options.budget,
            warmup=max(0.0, self.sized - self.began - self.count_before_runs),
            runs=self.ran - self.sized,
            count=self.count_spent,
            count_setup=self.count_setup,
            count_skipped=self.count_left_out,
        )
        result.budget_spent = spent
        if self.report.interrupted:
            return
        run_length = quantile([r.host for r in runs], 0.5)
        note = spent.note(len(runs), run_length, runs_fixed=self.options.repeat is not None)
        if note:
            self.report.notes.append(note)

    @staticmethod
    def _off_target(run: Run, target: float, unroll: int) -> bool:
        """Whether ``run`` is far from the target length (and can be resized)."""
        if not run.per_loop > 0:
            return False
        return run.host < target / 4 or (run.host > 4 * target and run.loops > unroll)

    # -- CUDA graphs --------------------------------------------------------------------
    def _capture(self, per_loop: float) -> tuple[Body, int] | None:
        unroll = 1 if self.options.cold else unroll_for(per_loop)
        try:
            replay = cuda.capture_graph(self.call, unroll, self.device)
        except cuda.GraphCaptureError as exc:
            self.report.warnings.append(f"--graph: capture failed, timed eagerly instead: {exc}")
            self.report.not_applied.append("--graph not used: capture failed")
            return None

        def replays(n: int) -> None:
            for _ in itertools.repeat(None, n // unroll):
                replay()

        self.report.notes.append(
            f"--graph: {unroll} loop{'s' if unroll > 1 else ''} captured in one CUDA graph; "
            f"eager warm-up measured {format_time(per_loop)} per loop with launches."
        )
        return replays, unroll

    # -- cold L2 -------------------------------------------------------------------------
    def _flush_buffer(self) -> Any:
        try:
            return cuda.l2_flush_buffer(self.device)
        except Exception as exc:  # an out-of-memory error must not lose the measurement
            self.report.warnings.append(f"--cold: no memory for the L2 flush buffer ({exc})")
            return None

    def _cold_run(self, buffer: Any) -> Run:
        runner = self.runner
        devices = self.devices
        # GPU time: flush, a spin kernel, then the start event queued behind them: the
        # flush is outside the interval, and so is the host's launch of the body (a
        # flush alone can end before the body is launched; it reads no memory).
        cuda.synchronize(devices)
        cuda.flush_l2(buffer)
        for d in devices:
            cuda.spin(d, SPIN_US)
        starts = [cuda.record_event(d) for d in devices]
        runner(1)
        ends, t_end, t_idle = self._finish()
        spans = [cuda.elapsed_ms(s, e) / 1e3 for s, e in zip(starts, ends, strict=True)]
        # Host time: the flush finished first, so the wait is the body's own.
        cuda.flush_l2(buffer)
        cuda.synchronize(devices)
        t0 = self.clock()
        runner(1)
        t_enqueued = self.clock()
        cuda.synchronize(devices)
        host = self.clock() - t0
        return Run(1, max(spans), host, t_enqueued - t0, t_idle - t_end)

    def _cold(self, buffer: Any, first_call: float, mode: str) -> Measured:
        def measure(n: int) -> Run:
            return self._cold_run(buffer)

        mode = "cold graph" if mode == "graph" else "cold"
        runs = self._runs(measure, 1, primary="gpu", fixed=True)
        result = self._result(runs, clock="gpu", mode=mode, first_call=first_call)
        result.flush_bytes = buffer.numel() * buffer.element_size()
        self.report.notes.append(
            f"--cold: {result.flush_bytes >> 20} MiB overwritten before "
            "each call, outside the timed interval; each run is a single call."
        )
        try:
            self._cold_check(result)
        except KeyboardInterrupt:
            self.report.interrupt("during --cold's L2 check")

        def profiled_measure(n: int) -> Run:
            total = Run(0, 0.0, 0.0, 0.0)
            for _ in range(n):
                r = self._cold_profiled_call(buffer)
                total = Run(total.loops + 1, total.gpu + r.gpu, 0.0, 0.0)
            return total

        profiled = self._extra_passes(result, profiled_measure, COLD_PASS_LOOPS, 1, flushes=True)
        self._apply_clocks(result, runs, profiled)
        self._account(result, runs)
        return Measured(result, runs)

    def _cold_check(self, result: CudaTimeResult) -> None:
        """Evidence that the flush worked: warm single calls of the same body, timed as
        the cold ones are but without the flush (the first, after a flush, left out)."""
        self._block(1)
        warm = [self._block(1).gpu for _ in range(COLD_CHECK_RUNS)]
        result.cold_warm_timings = warm
        result.cold_warm_time = quantile(warm, 0.5)
        interval = checks.cold_interval(result.timings, warm)
        warning = checks.cold_warning(result.median, result.cold_warm_time, interval)
        if warning:
            self.report.warnings.append(warning)

    def _cold_profiled_call(self, buffer: Any) -> Run:
        cuda.flush_l2(buffer)  # no spin: CUPTI would count its kernel as the body's
        start = cuda.record_event(self.device)
        self.runner(1)
        end = cuda.record_event(self.device)
        cuda.synchronize(self.devices)
        return Run(1, cuda.elapsed_ms(start, end) / 1e3, 0.0, 0.0)

    # -- the result ---------------------------------------------------------------------
    def _result(
        self, runs: Sequence[Run], *, clock: str, mode: str, first_call: float | None
    ) -> CudaTimeResult:
        loops = runs[0].loops
        status = cuda.status()
        primary = [r.host for r in runs]
        side = False
        if clock == "gpu":
            wide = side_work(runs, self.baseline_tail)
            side = wide is not None
            primary = wide if wide is not None else [r.gpu for r in runs]
        result = CudaTimeResult(
            loops=loops,
            repeat=len(runs),
            all_runs=primary,
            host_runs=[r.host for r in runs],
            clock=clock,
            mode=mode,
            compile_time=self.setup.compile_time,
            first_call=first_call,
            label=self.setup.label,
            devices=list(self.devices),
            torch_version=status.torch_version,
            cuda_version=status.cuda_version,
            floor=self.floor / loops,
            side_streams=side,
            precision=self.options.precision,
            flops=self.options.flops,
            bytes=self.options.bytes,
        )
        if clock == "gpu":
            peaks = cuda.device_peaks(self.device)
            result.device_index = self.device
            result.device_name = peaks.name
            self.dram_peak = peaks.dram_bytes_per_s
            result.l2_bytes = peaks.l2_bytes
            set_peaks(result, self.dram_peak)
        self.report.warnings.extend(warnings_for(result))
        result.warnings = self.report.warnings
        result.notes = self.report.notes
        result.not_applied = self.report.not_applied
        result.interrupted = self.report.interrupted
        return result
