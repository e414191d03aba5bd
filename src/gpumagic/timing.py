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
4. **Stop** once at least 7 runs have a relative IQR under 1 %, or at the time budget:
   a run starts only before it is spent, so the measurement ends within the budget plus
   one run (3 runs while they fit; one always). The budget's parts are
   :mod:`gpumagic.timing_budget`'s. Ctrl-C returns the runs measured so far (in the
   first run, the loops it finished, or the warm-up's last batch).
5. Optional passes: ``--kernels``/``--validate`` (one run under torch.profiler: CUPTI
   kernel time, the busy fraction and the events/CUPTI ratio of the same loops) and
   ``--sync-check`` (a few calls under ``set_sync_debug_mode("warn")``); then the
   counting call, its time reserved in the budget before the runs.

``--graph`` captures the body (unrolled) in a CUDA graph and times replays; ``--cold``
times single calls, each after an L2 flush that runs before the start event.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, cast

from gpumagic import cuda
from gpumagic.cuda_errors import error_hint
from gpumagic.devices import DeviceSpec, pick_devices
from gpumagic.timing_passes import Setup
from gpumagic.timing_plan import Body, Loops, TimingOptions, verdict
from gpumagic.timing_runs import Timer

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

    from gpumagic.timing_result import CudaTimeResult

__all__ = [
    "Body",
    "TimingOptions",
    "check_device",
    "device_scope",
    "loop",
    "time_cuda",
    "wait_for_setup",
]


def loop(fn: Callable[[], object]) -> Body:
    """Turn a zero-argument callable into a :class:`Body`."""

    def each(items: Iterator[None]) -> None:
        for _ in items:
            fn()

    return Loops(each)


def check_device(options: TimingOptions) -> None:
    """``ValueError`` (:class:`~gpumagic.devices.DeviceSpecError`) when ``--device N``
    names a GPU this process cannot see."""
    status = cuda.status()
    if options.device is None or options.host_only or not status.available:
        return
    spec = DeviceSpec((options.device,))
    pick_devices(status.devices, spec, where=f"--device {options.device_spec or options.device}")


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


def wait_for_setup() -> None:
    """Wait for the GPU work queued so far (after the setup), creating no context."""
    if cuda.is_initialized():
        cuda.synchronize(cuda.devices_with_context())


def time_cuda(
    body: Body | Callable[[], object],
    options: TimingOptions | None = None,
    *,
    label: str = "",
    code_files: Iterable[str] = (),
    compile_time: float = 0.0,
    takes_count: bool | None = None,
    say: Callable[[str], None] | None = None,
) -> CudaTimeResult:
    """Time ``body`` on the GPU (or on the host when there is none) and return the result.

    ``body`` is either a :class:`Body` (``body(n)`` runs ``n`` calls; ``%cudatime``
    compiles the cell into one) or, with ``takes_count=False``, a zero-argument callable.
    ``code_files`` are the file names the body's code was compiled under, so
    ``--sync-check`` can name its lines; ``compile_time`` is reported as it is; ``say``
    is given one line before runs expected to last long past the budget (a huge ``-n``).
    Exceptions raised by the body propagate (CUDA errors with a note on what to do);
    global state is restored on every path.
    """
    run = loop(cast("Callable[[], object]", body)) if takes_count is False else cast("Body", body)
    setup = Setup(
        body=run,
        options=options or TimingOptions(),
        label=label,
        code_files=tuple(code_files),
        compile_time=compile_time,
        clock=time.perf_counter,
        say=say,
    )
    timer = Timer(setup)
    status = cuda.status()
    if setup.options.host_only or not status.available:
        why = "--device cpu" if setup.options.host_only else f"no GPU here: {status.reason}"
        measured = timer.host_only(why)
    else:
        try:
            with device_scope(setup.options):
                measured = timer.gpu()
        except Exception as exc:
            # CUDA reports a kernel's fault at a later call, often one of ours.
            hint = error_hint(exc)
            if hint and (exc is timer.body_error or timer.body_error is None):
                exc.add_note(hint)
            raise
    result = measured.result
    # The one place the verdict is decided, once every pass has run.
    decided, note = verdict(result, measured.runs, gpu_work=measured.gpu_work)
    if decided:
        result.verdict = decided
    if note:
        result.notes.append(note)
    return result
