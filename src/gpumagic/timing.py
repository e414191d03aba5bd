"""The ``%cudatime`` measurement engine (pure: no IPython; CUDA only through ``gpumagic.cuda``).

How a GPU measurement goes (``time_cuda``):

1. **First call**, host wall time with every device synchronized: compilation, autotuning,
   cuBLAS heuristics and lazy module loading land here and are reported on their own.
   If the body never initialised CUDA, it launched no GPU work: the rest is host timing.
2. **Warm-up** in doubling batches until two batches agree within 10 % (or a quarter of
   the budget is gone); the last batch sizes the runs.
3. **Runs**: blocks of ``loops`` back-to-back calls. Each run synchronizes every device
   with a context, queues a short spin kernel (so the start event fires when the GPU
   reaches the body, not when the host enqueued it), records a start event on each
   device's current stream, calls the body ``loops`` times, records end events,
   synchronizes every device (work on side streams and other devices included) and
   records a second end event. When that device-wide end lands later than the stream's
   own end by more than the calibrated sync latency, the body left work on other
   streams and the device-wide span is used. Host wall time comes from the same runs.
4. **Stop** once at least 7 runs have a relative IQR under 1 %, or at the time budget
   (never fewer than 3 runs). Ctrl-C returns the runs measured so far.
5. Optional passes: ``--kernels``/``--validate`` (one run under torch.profiler: CUPTI
   kernel time, the busy fraction and the events/CUPTI ratio of the same loops) and
   ``--sync-check`` (a few calls under ``set_sync_debug_mode("warn")``).

``--graph`` captures the body (unrolled) in a CUDA graph and times replays; ``--cold``
times single calls, each after an L2 flush that runs before the start event.
"""

from __future__ import annotations

import ast
import contextlib
import gc
import itertools
import linecache
import math
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from gpumagic import cuda
from gpumagic.timing_result import FIRST_CALL_WARNING, TIMES, CudaTimeResult, KernelStat, SyncSite
from gpumagic.units import format_time, parse_size, quantile

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Sequence

__all__ = [
    "Body",
    "TimingOptions",
    "check_device",
    "device_scope",
    "loop",
    "parse_amount",
    "settle",
    "time_cuda",
]

SPIN_US = 30.0  # spin kernel ahead of each run's start events
SIDE_WORK_MIN = 100e-6  # a device sync this much slower than when idle: side-stream work
SIDE_WORK_SHARE = 0.05  # ... and at least this share of the timed streams' time
MIN_RUNS = 7  # runs before the noise criterion may stop a measurement (as %timeit's 7)
MIN_COLD_RUNS = 15  # single cold calls vary more: more of them before the noise stop
DRIFT = 0.05  # warn when the first run was this much faster than the later ones
FEWEST_RUNS = 3  # runs measured even when the budget is spent
NOISE_TARGET = 0.01  # stop when IQR / median of the runs is below this
COLD_NOISE_TARGET = 0.02  # single cold calls vary more
WARMUP_SHARE = 0.25  # of the budget, at most, for warm-up
STEADY = 0.10  # two warm-up batches this close count as steady
MAX_RESIZES = 3  # times the runs may be resized when a run is far from the target length
NOISY = 0.10  # warn above this relative IQR (torch.utils.benchmark uses 10 %)
FLOOR_FACTOR = 5  # warn when the result is within this many timing floors
FIRST_CALL_FACTOR = FIRST_CALL_WARNING  # warn when the first call took this many times longer
GRAPH_REPLAY_TARGET = 2e-3  # GPU seconds per graph replay, for the unroll factor
GRAPH_MAX_UNROLL = 256
PROFILE_TARGET = 0.1  # seconds of body time under the profiler
PROFILE_MAX_LOOPS = 1000
SYNC_CHECK_LOOPS = 10
COLD_PASS_LOOPS = 20  # single cold calls profiled / sync-checked
SYNC_CHECK_TARGET = 0.5
CUDA_OPTIONS = ("cold", "graph", "kernels", "validate", "sync_check")


class Body(Protocol):
    """The timed code: ``body(n)`` runs it ``n`` times back to back."""

    def __call__(self, n: int, /) -> object: ...


def loop(fn: Callable[[], object]) -> Body:
    """Turn a zero-argument callable into a :class:`Body`."""

    def run(n: int) -> None:
        for _ in itertools.repeat(None, n):
            fn()

    return run


@dataclass(frozen=True)
class TimingOptions:
    """What ``%cudatime``'s options ask for. ``ValueError`` names a bad value."""

    loops: int | None = None
    repeat: int | None = None
    warmup: int | None = None
    budget: float = 1.0
    precision: int = 3
    cold: bool = False
    graph: bool = False
    kernels: bool = False
    validate: bool = False
    sync_check: bool = False
    device: int | None = None
    host_only: bool = False
    flops: float | None = None
    bytes: float | None = None

    def __post_init__(self) -> None:
        for name, low in (("loops", 1), ("repeat", 1), ("warmup", 0), ("precision", 1)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name} must be at least {low}, got {value}")
        if not (self.budget > 0 and math.isfinite(self.budget)):
            raise ValueError(f"the budget must be a positive number of seconds, got {self.budget}")
        for name in ("flops", "bytes"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, got {value}")
        if self.device is not None and self.device < 0:
            raise ValueError(f"the device index must be 0 or more, got {self.device}")

    def cuda_only(self) -> list[str]:
        """The options given that need CUDA, as the user typed them."""
        given = ["--" + n.replace("_", "-") for n in CUDA_OPTIONS if getattr(self, n)]
        if self.device is not None:
            given.append(f"--device {self.device}")
        return given


def check_device(options: TimingOptions) -> None:
    """``ValueError`` when ``--device N`` names a GPU this process cannot see."""
    status = cuda.status()
    if options.device is None or options.host_only or not status.available:
        return
    if options.device >= len(status.devices):
        raise ValueError(
            f"--device {options.device}: this process sees {len(status.devices)} GPU(s) "
            f"(cuda:0 to cuda:{len(status.devices) - 1})"
        )


@contextlib.contextmanager
def device_scope(options: TimingOptions) -> Iterator[None]:
    """Make ``--device N`` the current device for setup and timing, then put it back
    (nothing happens without CUDA: the engine then says the option was not used)."""
    if options.device is None or options.host_only or not cuda.status().available:
        yield
        return
    check_device(options)
    with cuda.use_device(options.device):
        yield


def settle() -> None:
    """Wait for the GPU work queued so far (after the setup), creating no context."""
    if cuda.is_initialized():
        cuda.synchronize(cuda.context_devices())


@dataclass(frozen=True)
class _Run:
    """One run: ``loops`` calls; times in seconds for the whole run."""

    loops: int
    gpu: float
    host: float
    enqueue: float
    # Host seconds from the timed streams' end (polled, so no wake-up latency) to the
    # devices' idle: other streams' work the timed streams did not wait for.
    tail: float = 0.0


@dataclass
class _Report:
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    interrupted: bool = False

    def interrupt(self, where: str) -> None:
        self.interrupted = True
        self.warnings.append(f"interrupted (Ctrl-C) {where}: these are the results so far")


def time_cuda(
    body: Body | Callable[[], object],
    options: TimingOptions | None = None,
    *,
    label: str = "",
    code_files: Iterable[str] = (),
    compile_time: float = 0.0,
    takes_count: bool | None = None,
) -> CudaTimeResult:
    """Time ``body`` on the GPU (or on the host when there is none) and return the result.

    ``body`` is either a :class:`Body` (``body(n)`` runs ``n`` calls; ``%cudatime``
    compiles the cell into one) or, with ``takes_count=False``, a zero-argument callable.
    ``code_files`` are the file names the body's code was compiled under, so
    ``--sync-check`` can name its lines. Exceptions raised by the body propagate (CUDA
    errors with a note on what to do); global state is restored on every path.
    """
    options = options or TimingOptions()
    run = loop(cast("Callable[[], object]", body)) if takes_count is False else cast("Body", body)
    timer = _Timer(run, options, label=label, code_files=tuple(code_files))
    timer.compile_time = compile_time
    return timer.run()


class _Timer:
    def __init__(
        self, body: Body, options: TimingOptions, *, label: str, code_files: Sequence[str]
    ) -> None:
        self.body = body
        self.options = options
        self.label = label
        self.code_files = code_files
        self.clock = time.perf_counter
        self.report = _Report()
        self.compile_time = 0.0
        self.body_error: BaseException | None = None
        self.runner: Body = self.call  # the body, or replays of its CUDA graph
        self.devices: list[int] = []
        self.device = 0
        self.baseline_tail = 0.0
        self.floor = 0.0
        self.began = 0.0

    # -- the body, and telling its exceptions from ours ---------------------------------
    def call(self, n: int) -> None:
        try:
            self.body(n)
        except BaseException as exc:
            if not isinstance(exc, KeyboardInterrupt):
                self.body_error = exc
            raise

    def run(self) -> CudaTimeResult:
        options = self.options
        status = cuda.status()
        if options.host_only or not status.available:
            why = "--device cpu" if options.host_only else f"no GPU here: {status.reason}"
            self._cuda_options_ignored(why)
            self.report.notes.append(f"Timed on the host like %timeit ({why}).")
            return self._host(first_call=None)
        try:
            with device_scope(options):
                return self._gpu()
        except Exception as exc:
            # CUDA reports a kernel's fault at a later call, often one of ours.
            hint = cuda.cuda_error_hint(exc)
            if hint and (exc is self.body_error or self.body_error is None):
                exc.add_note(hint)
            raise

    def _cuda_options_ignored(self, why: str) -> None:
        for flag in self.options.cuda_only():
            self.report.warnings.append(f"{flag} needs CUDA ({why}): not used")

    # -- host timing ------------------------------------------------------------------
    def _host_run(self, n: int) -> _Run:
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            t0 = self.clock()
            self.call(n)
            elapsed = self.clock() - t0
        finally:
            if gc_was_enabled:
                gc.enable()
        return _Run(n, math.nan, elapsed, elapsed)

    def _host(self, first_call: float | None) -> CudaTimeResult:
        if first_call is None:
            t0 = self.clock()
            self.call(1)
            first_call = self.clock() - t0
        self.began = self.clock()
        per_loop = self._warm_up(self._host_run)
        loops = self._loops(self._host_run, 1, per_loop)
        self.floor = self._host_floor()
        runs = self._runs(self._host_run, loops, primary="host")
        return self._result(runs, clock="host", mode="eager", first_call=first_call)

    def _host_floor(self) -> float:
        times = []
        for _ in range(5):
            t0 = self.clock()
            self.clock()
            times.append(self.clock() - t0)
        return quantile(times, 0.5)

    # -- GPU timing -------------------------------------------------------------------
    def _gpu(self) -> CudaTimeResult:
        options = self.options
        t0 = self.clock()
        self.call(1)
        if not cuda.is_initialized():
            first_call = self.clock() - t0
            self._cuda_options_ignored("the body launched no GPU work")
            self.report.notes.append(
                "The body never initialised CUDA, so it launched no GPU work (CPU tensors?): "
                "timed on the host like %timeit."
            )
            result = self._host(first_call=first_call)
            result.verdict = "no GPU work was launched"
            return result
        self.device = options.device if options.device is not None else cuda.current_device()
        self.devices = cuda.context_devices(self.device)
        cuda.synchronize(self.devices)
        first_call = self.clock() - t0
        streams = cuda.current_streams(self.devices)
        try:
            result = self._gpu_measure(first_call)
        except BaseException:
            with contextlib.suppress(Exception):
                cuda.synchronize(self.devices)
            with contextlib.suppress(Exception):
                cuda.restore_streams(streams)
            raise
        cuda.synchronize(self.devices)
        cuda.restore_streams(streams)
        return result

    def _gpu_measure(self, first_call: float) -> CudaTimeResult:
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
        if options.cold:
            buffer = self._flush_buffer()
            if buffer is not None:
                return self._cold(buffer, first_call, mode)
        measure = self._block
        loops = self._loops(measure, unroll, per_loop if mode == "eager" else None)
        runs = self._runs(measure, loops, primary="gpu", unroll=unroll)
        result = self._result(runs, clock="gpu", mode=mode, first_call=first_call)
        self._extra_passes(result, measure, loops, unroll)
        return result

    def _calibrate(self) -> None:
        """The idle devices' sync latency and the event floor, from empty runs."""
        runs = [self._block(0) for _ in range(5)]
        self.baseline_tail = quantile([r.tail for r in runs], 0.5)
        self.floor = quantile([r.gpu for r in runs], 0.5) + 0.5e-6  # event quantum

    def _block(self, n: int, spin: bool = True) -> _Run:
        run = self.runner
        devices = self.devices
        cuda.synchronize(devices)
        if spin:
            for d in devices:
                cuda.spin(d, SPIN_US)
        starts = [cuda.record_event(d) for d in devices]
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            t0 = self.clock()
            run(n)
            t_enqueued = self.clock()
            ends, t_end, t1 = self._finish()
        finally:
            if gc_was_enabled:
                gc.enable()
        spans = [cuda.elapsed_ms(s, e) / 1e3 for s, e in zip(starts, ends, strict=True)]
        return _Run(n, max(spans), t1 - t0, t_enqueued - t0, t1 - t_end)

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

    def _side_work(self, runs: Sequence[_Run]) -> list[float] | None:
        """Per-run GPU time through the devices' idle, if most runs left work on other
        streams that the timed streams did not wait for; else ``None``.

        Once the timed streams have passed their end events, a device sync returns
        after its usual latency unless other streams still run. Work the timed
        streams waited for (a joined side stream, cuBLAS's memset and GEMM) ends
        before the end events and adds nothing; a few tens of microseconds of host
        noise are not side work, hence the margin.
        """
        flagged = 0
        extra = []
        for r in runs:
            late = r.tail - self.baseline_tail
            if late > max(SIDE_WORK_MIN, SIDE_WORK_SHARE * r.gpu):
                flagged += 1
            extra.append(max(0.0, late))
        if flagged * 2 <= len(runs):
            return None
        return [r.gpu + e for r, e in zip(runs, extra, strict=True)]

    # -- warm-up and run sizing -------------------------------------------------------
    def _warm_up(self, measure: Callable[[int], _Run]) -> float:
        """Warm up; returns the estimated wall time per loop."""
        options = self.options
        if options.warmup is not None:
            if options.warmup:
                self.call(options.warmup)
            r = measure(1)
            return max(r.host, _nan_to(r.gpu, 0.0))
        target = _block_target(options.budget)
        n, previous, settled = 1, None, False
        start = self.clock()
        while True:
            r = measure(n)
            per = max(r.host, _nan_to(r.gpu, 0.0)) / n
            settled = previous is not None and abs(per - previous) <= STEADY * previous
            spent = self.clock() - start
            if settled or spent >= WARMUP_SHARE * options.budget:
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
        return per

    def _loops(self, measure: Callable[[int], _Run], unroll: int, per_loop: float | None) -> int:
        if per_loop is None:  # graph replays: time one replay for the estimate
            measure(unroll)
            r = measure(unroll)
            per_loop = max(r.host, r.gpu) / unroll
        if self.options.loops is not None:
            loops = self.options.loops
        else:
            target = _block_target(self.options.budget)
            loops = max(1, round(target / per_loop)) if per_loop > 0 else 1000
        if loops % unroll:
            loops += unroll - loops % unroll
            if self.options.loops is not None:
                self.report.notes.append(
                    f"-n rounded up to {loops}, a multiple of the {unroll} loops in the graph"
                )
        return loops

    def _runs(
        self,
        measure: Callable[[int], _Run],
        loops: int,
        primary: str,
        unroll: int = 1,
        fixed: bool = False,
    ) -> list[_Run]:
        """Runs of ``loops`` loops until the noise criterion, the budget or ``-r``.

        While ``-n`` is not given, a run far from the target length (the warm-up estimate
        was off: the body was still getting faster, say) resizes the runs and starts over.
        """
        options = self.options
        runs: list[_Run] = []
        deadline = self.began + options.budget
        target = _block_target(options.budget)
        noise = COLD_NOISE_TARGET if options.cold else NOISE_TARGET
        resizes = MAX_RESIZES if fixed or options.loops is not None else 0
        try:
            while True:
                run = measure(loops)
                per = max(run.host, _nan_to(run.gpu, 0.0)) / max(run.loops, 1)
                off = run.host < target / 4 or (run.host > 4 * target and loops > unroll)
                if resizes < MAX_RESIZES and off and per > 0:
                    resizes += 1
                    loops = max(unroll, round(target / per / unroll) * unroll)
                    runs.clear()
                    continue
                runs.append(run)
                if options.repeat is not None:
                    if len(runs) >= options.repeat:
                        break
                    continue
                values = [r.gpu if primary == "gpu" else r.host for r in runs]
                fewest = MIN_COLD_RUNS if options.cold else MIN_RUNS
                if len(runs) >= fewest and _rel_iqr(values) <= noise:
                    break
                if len(runs) >= FEWEST_RUNS and self.clock() + run.host > deadline:
                    break
        except KeyboardInterrupt:
            if not runs:
                raise
            self.report.interrupt(f"after {len(runs)} run{'s' if len(runs) > 1 else ''}")
        if options.repeat is None and len(runs) < MIN_RUNS and not self.report.interrupted:
            self.report.notes.append(
                f"Only {len(runs)} runs fit in the budget of {options.budget:g} s (--budget): "
                f"a run takes {format_time(quantile([r.host for r in runs], 0.5))}."
            )
        return runs

    # -- CUDA graphs --------------------------------------------------------------------
    def _capture(self, per_loop: float) -> tuple[Body, int] | None:
        unroll = 1 if self.options.cold else _unroll(per_loop)
        try:
            replay = cuda.capture_graph(self.call, unroll, self.device)
        except cuda.GraphCaptureError as exc:
            self.report.warnings.append(f"--graph: capture failed, timed eagerly instead: {exc}")
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

    def _cold_run(self, buffer: Any) -> _Run:
        runner = self.runner
        devices = self.devices
        # GPU time: flush, then the start event queued behind it, so neither the flush nor
        # the launch latency of the body is inside the interval.
        cuda.synchronize(devices)
        cuda.flush_l2(buffer)
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
        return _Run(1, max(spans), host, t_enqueued - t0, t_idle - t_end)

    def _cold(self, buffer: Any, first_call: float, mode: str) -> CudaTimeResult:
        def measure(n: int) -> _Run:
            return self._cold_run(buffer)

        mode = "cold graph" if mode == "graph" else "cold"
        runs = self._runs(measure, 1, primary="gpu", fixed=True)
        result = self._result(runs, clock="gpu", mode=mode, first_call=first_call)
        self.report.notes.append(
            f"--cold: {buffer.numel() * buffer.element_size() >> 20} MiB overwritten before "
            "each call, outside the timed interval; each run is a single call."
        )

        def profiled_measure(n: int) -> _Run:
            total = _Run(0, 0.0, 0.0, 0.0)
            for _ in range(n):
                r = self._cold_profiled_call(buffer)
                total = _Run(total.loops + 1, total.gpu + r.gpu, 0.0, 0.0)
            return total

        self._extra_passes(result, profiled_measure, COLD_PASS_LOOPS, 1, flushes=True)
        return result

    def _cold_profiled_call(self, buffer: Any) -> _Run:
        cuda.flush_l2(buffer)
        start = cuda.record_event(self.device)
        self.runner(1)
        end = cuda.record_event(self.device)
        cuda.synchronize(self.devices)
        return _Run(1, cuda.elapsed_ms(start, end) / 1e3, 0.0, 0.0)

    # -- optional passes ------------------------------------------------------------------
    def _extra_passes(
        self,
        result: CudaTimeResult,
        measure: Callable[[int], _Run],
        loops: int,
        unroll: int,
        flushes: bool = False,
    ) -> None:
        options = self.options
        try:
            if options.kernels or options.validate:
                self._kernel_pass(result, measure, loops, unroll, flushes)
            if options.sync_check:
                self._sync_pass(result, loops)
        except KeyboardInterrupt:
            self.report.interrupt("during the optional passes")
        result.interrupted = self.report.interrupted
        self._verdict(result)

    def _kernel_pass(
        self,
        result: CudaTimeResult,
        measure: Callable[[int], _Run],
        loops: int,
        unroll: int,
        flushes: bool,
    ) -> None:
        per_loop = max(result.host_time, result.median)
        count = int(min(loops, PROFILE_MAX_LOOPS, max(1, PROFILE_TARGET / max(per_loop, 1e-9))))
        count = max(unroll, count - count % unroll)
        box: dict[str, _Run] = {}

        def work() -> None:
            if flushes:
                box["run"] = measure(count)
            else:
                box["run"] = self._block(count, spin=False)

        try:
            profile = cuda.profile_kernels(
                lambda: measure(unroll), work, self.devices, flushes=count if flushes else 0
            )
        except Exception as exc:
            if exc is self.body_error:
                raise
            self.report.warnings.append(f"--kernels: torch.profiler failed ({exc!r})")
            return
        if flushes and profile.flushes_removed != count:
            self.report.warnings.append(
                f"--cold: {profile.flushes_removed} of {count} L2 flushes could be told apart "
                "in the CUPTI record; the kernel figures may include the rest"
            )
        if profile.busy_us == 0 and result.mode != "eager":
            # The graph was not empty when captured: CUPTI missed its kernels.
            self.report.warnings.append(
                "--kernels: CUPTI recorded no kernels for the CUDA graph replays; "
                "run without --graph for kernel figures"
            )
            return
        result.kernel_loops = count
        result.kernel_time = profile.busy_us * 1e-6 / count
        result.kernel_span = profile.span_us * 1e-6 / count if profile.span_us else None
        result.kernels = [
            KernelStat(name, calls / count, us * 1e-6 / count)
            for name, calls, us in profile.kernels
        ]
        # Busy against the wall time of the same loops: both in the same clock state.
        wall = box["run"].host / count if box["run"].host > 0 else result.host_time
        if wall > 0:
            result.busy_fraction = min(1.0, result.kernel_time / wall)
        events = box["run"].gpu / count
        if self.options.validate:
            result.cupti_events_time = events
            if result.kernel_time > 0:
                result.cupti_ratio = events / result.kernel_time

    def _sync_pass(self, result: CudaTimeResult, loops: int) -> None:
        per_loop = max(result.host_time, 1e-9)
        count = max(1, min(loops, SYNC_CHECK_LOOPS, int(SYNC_CHECK_TARGET / per_loop)))
        try:
            events = cuda.catch_syncs(lambda: self.call(count), self.code_files)
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
        if filename in self.code_files:
            return f"line {lineno}"
        return f"{os.path.basename(filename)}:{lineno}"

    # -- the result ---------------------------------------------------------------------
    def _result(
        self, runs: Sequence[_Run], *, clock: str, mode: str, first_call: float | None
    ) -> CudaTimeResult:
        loops = runs[0].loops
        status = cuda.status()
        primary = [r.host for r in runs]
        side = False
        if clock == "gpu":
            wide = self._side_work(runs)
            side = wide is not None
            primary = wide if wide is not None else [r.gpu for r in runs]
        result = CudaTimeResult(
            loops=loops,
            repeat=len(runs),
            all_runs=primary,
            host_runs=[r.host for r in runs],
            clock=clock,
            mode=mode,
            compile_time=self.compile_time,
            first_call=first_call,
            label=self.label,
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
            result.peak_flops = peaks.tensor_flops
            result.peak_flops_basis = peaks.flops_basis
            result.peak_bytes_per_s = peaks.dram_bytes_per_s
        self._warn(result, runs)
        result.warnings = self.report.warnings
        result.notes = self.report.notes
        result.interrupted = self.report.interrupted
        if clock == "host" or not (self.options.kernels or self.options.validate):
            self._verdict(result, runs)
        return result

    def _warn(self, result: CudaTimeResult, runs: Sequence[_Run]) -> None:
        warn = self.report.warnings
        if result.repeat >= 3 and result.rel_iqr > NOISY:
            warn.append(
                f"the spread is large: IQR is {result.rel_iqr * 100:.0f} % of the median (other "
                "work on the GPU or host, clock changes, or work that varies between calls)"
            )
        steady = result.host_time
        first = result.first_call
        if first is not None and first > 1e-3 and first > FIRST_CALL_FACTOR * steady:
            warn.append(
                f"the first call took {format_time(first)}, {first / steady:,.0f}{TIMES} the "
                "steady state (compilation, autotuning, cuBLAS heuristics or lazy loading); it is "
                "not in the numbers"
            )
        values = result.timings
        if len(values) >= 5:
            later = quantile(values[len(values) // 2 :], 0.5)
            if later > 0 and (later - values[0]) / later > DRIFT:
                warn.append(
                    f"the first run was {(later - values[0]) / later * 100:.0f} % faster than the "
                    "later ones: clocks drop under sustained load (power or thermal limits) and "
                    "recover after idling; the median describes the sustained state"
                )
        if result.floor and result.median < FLOOR_FACTOR * result.floor:
            warn.append(
                f"the time per loop is within {FLOOR_FACTOR}{TIMES} of the timing floor "
                f"({format_time(result.floor)} per loop here): use more loops (-n)"
                + (" or --graph" if result.clock == "gpu" and result.mode == "eager" else "")
            )

    def _verdict(self, result: CudaTimeResult, runs: Sequence[_Run] = ()) -> None:
        if result.verdict:
            return
        if result.kernel_time is not None:
            busy = result.busy_fraction or 0.0
            if result.kernel_time == 0:
                result.verdict = "no GPU work was launched (CPU tensors?)"
            elif busy >= 0.8:
                result.verdict = f"GPU-bound: GPU busy {busy * 100:.0f} % of wall time"
            elif busy < 0.5:
                result.verdict = f"launch/CPU-bound: GPU busy {busy * 100:.0f} % of wall time"
            else:
                result.verdict = (
                    f"partly launch/CPU-bound: GPU busy {busy * 100:.0f} % of wall time"
                )
            return
        if result.clock != "gpu" or result.mode != "eager" or not runs:
            return
        launching = quantile([r.enqueue / r.host for r in runs if r.host > 0], 0.5)
        if launching >= 0.9:
            result.notes.append(
                f"The host spent {launching * 100:.0f} % of the wall time launching: likely "
                "launch/CPU-bound (the GPU waits for the host); --kernels measures how busy "
                "the GPU was."
            )


def _block_target(budget: float) -> float:
    return min(max(budget / 25, 2e-3), 0.25)


def _unroll(per_loop: float) -> int:
    if per_loop <= 0:
        return GRAPH_MAX_UNROLL
    return max(1, min(GRAPH_MAX_UNROLL, math.ceil(GRAPH_REPLAY_TARGET / per_loop)))


def _rel_iqr(values: Sequence[float]) -> float:
    median = quantile(values, 0.5)
    if not median > 0:
        return math.inf
    return (quantile(values, 0.75) - quantile(values, 0.25)) / median


def _nan_to(value: float, default: float) -> float:
    return default if math.isnan(value) else value


def _source(filename: str, lineno: int) -> str:
    return linecache.getline(filename, lineno).strip()


_OPERATORS: dict[type, Callable[[float, float], float]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def parse_amount(text: str, *, sizes: bool = False) -> float:
    """A positive count from ``"1.2e12"``, ``"2*4096**3"`` or, with ``sizes``, ``"3GiB"``.

    Only numbers and ``+ - * / **`` are evaluated; :class:`ValueError` says what is accepted.
    """
    accepted = "a number or arithmetic of numbers such as 2*4096**3"
    if sizes:
        accepted += ", or a size such as 512MiB"
        with contextlib.suppress(ValueError):
            if text.strip() and not text.strip()[-1].isdigit():
                return float(parse_size(text))

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow):
                if abs(right) > 64:
                    raise ValueError("exponent too large")
                return float(left**right)
            operator = _OPERATORS.get(type(node.op))
            if operator is not None:
                return operator(left, right)
        raise ValueError(type(node).__name__)

    try:
        result = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        raise ValueError(f"{text!r} is not a count: use {accepted}") from exc
    if not (result > 0 and math.isfinite(result)):
        raise ValueError(f"{text!r} is not a positive count: use {accepted}")
    return result
