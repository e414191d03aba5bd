"""The CUDA runtime as the magics use it: synchronizing, events, streams, the spin
kernel, the L2 flush, CUDA graphs and device properties. These may create a context:
they run only once the user asked for CUDA work."""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from gpumagic.cuda import discovery
from gpumagic.cuda.discovery import CudaUnavailable, devices, is_initialized, torch_module
from gpumagic.gc_pause import paused_gc

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    import torch

__all__ = [
    "FLUSH_LABEL",
    "DevicePeaks",
    "GraphCaptureError",
    "capture_graph",
    "current_device",
    "current_streams",
    "device_peaks",
    "devices_with_context",
    "elapsed_ms",
    "event_completed",
    "flush_l2",
    "l2_flush_buffer",
    "record_event",
    "restore_streams",
    "spin",
    "stream_is_capturing",
    "synchronize",
    "use_device",
    "visible_device_total",
]


def _index(device: int | str | torch.device | None) -> int:
    torch = torch_module()
    if device is None:
        return int(torch.cuda.current_device())
    if isinstance(device, int):
        return device
    parsed = torch.device(device)
    if parsed.type != "cuda":
        raise ValueError(f"not a CUDA device: {device!r}")
    return int(parsed.index) if parsed.index is not None else int(torch.cuda.current_device())


def synchronize(devices: Iterable[int | str | torch.device] | int | None = None) -> None:
    """Wait for all work queued on ``devices`` (default: the current device): a
    device-wide sync per device, all streams included (``torch.cuda.synchronize()``
    covers the current device only). Creates a context on a device without one."""
    torch = sys.modules.get("torch") or torch_module()
    if devices is None or isinstance(devices, int):
        torch.cuda.synchronize(devices)
        return
    native = torch._C
    indices: Sequence[int]
    if type(devices) is tuple and len(devices) == 1 and type(devices[0]) is int:
        indices = cast("tuple[int]", devices)  # %lprun's line boundaries: no parsing
    else:
        indices = [_index(d) for d in devices]
    if len(indices) == 1 and indices[0] == native._cuda_getDevice():
        native._cuda_synchronize()  # the common case, without switching devices
        return
    for index in indices:
        with torch.cuda.device(index):
            native._cuda_synchronize()


def record_event(device: int | None = None) -> torch.cuda.Event:
    """A timing event recorded now on the current stream of ``device`` (default: the
    current device)."""
    tm = torch_module()
    event: torch.cuda.Event = tm.cuda.Event(enable_timing=True)
    if device is None:
        event.record()
    else:
        event.record(tm.cuda.current_stream(device))
    return event


def event_completed(event: Any) -> bool:
    """Whether the GPU has passed ``event`` (never blocks)."""
    return bool(event.query())


def elapsed_ms(start: torch.cuda.Event, end: torch.cuda.Event, *, wait: bool = True) -> float:
    """Milliseconds between two recorded events of one device; ``wait``: first wait
    for ``end`` (without it, both must have completed: :func:`event_completed`)."""
    if wait:
        end.synchronize()
    return float(start.elapsed_time(end))


def devices_with_context() -> tuple[int, ...]:
    """Indices of the devices on which this process has a CUDA context; ``()`` before
    torch has initialised CUDA. Never creates a context, and costs a driver query per
    device: a device without one cannot hold an allocation of torch's."""
    if not is_initialized():
        return ()
    torch = torch_module()
    has_context = torch._C._cuda_hasPrimaryContext
    return tuple([i for i in range(torch.cuda.device_count()) if has_context(i)])


def visible_device_total() -> int:
    """How many devices torch has (``0`` before torch has initialised CUDA): the count
    that bounds device indices once CUDA is in use. Before that, ``len(devices())``
    (discovery) says how many this process may use."""
    if not is_initialized():
        return 0
    return int(torch_module().cuda.device_count())


def stream_is_capturing() -> bool:
    """Whether the current stream is capturing a CUDA graph (a synchronize would break
    the capture). ``False`` without a context (torch's call creates none)."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch._C._cuda_isCurrentStreamCapturing())


#: ``record_function`` label around the L2 flush, so CUPTI figures can leave it out.
FLUSH_LABEL = "gpumagic.l2_flush"


@dataclass(frozen=True)
class DevicePeaks:
    """What the hardware says about one device: its name, DRAM bandwidth peak and L2
    cache size."""

    name: str
    dram_bytes_per_s: float | None
    l2_bytes: int | None = None


def current_device() -> int:
    """The index of torch's current CUDA device."""
    return int(torch_module().cuda.current_device())


def use_device(index: int) -> contextlib.AbstractContextManager[Any]:
    """Make ``index`` the current device for a block, then put the old one back."""
    return cast("contextlib.AbstractContextManager[Any]", torch_module().cuda.device(index))


def current_streams(devices: Iterable[int]) -> list[Any]:
    """The current stream of each device (to put back with :func:`restore_streams`)."""
    torch = torch_module()
    return [torch.cuda.current_stream(d) for d in devices]


def restore_streams(streams: Iterable[Any]) -> None:
    """Make each stream current again on its device."""
    torch = torch_module()
    for stream in streams:
        if torch.cuda.current_stream(stream.device) != stream:
            torch.cuda.set_stream(stream)


@functools.cache
def _cycles_per_us(device: int) -> float:
    rate = getattr(torch_module().cuda.get_device_properties(device), "clock_rate", 0)
    return rate / 1e3 if rate else 2000.0  # clock_rate is in kHz


def spin(device: int, microseconds: float) -> None:
    """Queue a kernel that spins for about ``microseconds`` on ``device``'s current stream.

    Queued ahead of a start event it keeps the GPU busy while the host enqueues the event
    and the first launches, so the interval starts when the GPU reaches the work, not
    when the host did (the idle-queue pitfall); NVBench's blocking kernel does the same.
    """
    torch = torch_module()
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return
    with torch.cuda.device(device):
        sleep(int(microseconds * _cycles_per_us(device)))


def device_peaks(device: int) -> DevicePeaks:
    """Name and DRAM bandwidth peak (memory clock times bus width) of ``device``, where known
    (compute peaks come from data sheets: :mod:`gpumagic.peaks`)."""
    props = torch_module().cuda.get_device_properties(device)
    name = str(props.name)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    dram = clock_khz * 1e3 * bus_bits * 2 / 8 if clock_khz and bus_bits else None
    if dram is None:
        dram = _nvml_dram_peak(device)
    l2 = int(getattr(props, "L2_cache_size", 0)) or None
    return DevicePeaks(name=name, dram_bytes_per_s=dram, l2_bytes=l2)


def _nvml_dram_peak(device: int) -> float | None:
    nvml = discovery._nvml()
    visible = devices()
    if nvml is None or device >= len(visible):
        return None
    try:
        handle = discovery._nvml_handle(visible[device])
        clock_mhz = nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_MEM)
        bus_bits = nvml.nvmlDeviceGetMemoryBusWidth(handle)
    except (nvml.NVMLError, CudaUnavailable, AttributeError):
        return None
    return float(clock_mhz) * 1e6 * float(bus_bits) * 2 / 8


def l2_flush_buffer(device: int) -> torch.Tensor:
    """A buffer twice the size of ``device``'s L2 cache (at least 64 MiB) to flush it."""
    tm = torch_module()
    l2 = int(getattr(tm.cuda.get_device_properties(device), "L2_cache_size", 0))
    size = max(2 * l2, 64 << 20)
    buffer: torch.Tensor = tm.empty(size // 4, dtype=tm.int32, device=device)
    return buffer


def flush_l2(buffer: torch.Tensor) -> None:
    """Overwrite the flush buffer on the current stream (labelled for CUPTI)."""
    torch = torch_module()
    with torch.profiler.record_function(FLUSH_LABEL):
        buffer.zero_()


class GraphCaptureError(RuntimeError):
    """The body could not be captured in a CUDA graph; the message says why."""


def capture_graph(run: Callable[[int], object], iterations: int, device: int) -> Callable[[], None]:
    """Capture ``run(iterations)`` in a CUDA graph on ``device``; returns its replay.

    Warms up on a side stream first, as torch asks; the garbage collector is off during
    capture (a finalizer must not free memory the graph is using). An exception raised
    by ``run`` during the warm-up is the body's own and propagates unchanged; a failure
    during capture becomes :class:`GraphCaptureError` with the reason.
    """
    import warnings

    torch = torch_module()
    with torch.cuda.device(device):
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            run(2)
        current.wait_stream(side)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        # A pool of our own: a capture that fails never tells the allocator it ended.
        pool = torch.cuda.graph_pool_handle()
        try:
            # torch.cuda.graph leaves its capture stream current when ending the capture
            # fails; the outer stream context puts the caller's stream back.
            with (
                torch.cuda.stream(current),
                paused_gc(),
                warnings.catch_warnings(record=True) as caught,
            ):
                warnings.simplefilter("always")
                with torch.cuda.graph(graph, pool=pool):
                    run(iterations)
        except Exception as exc:
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(device)
            _reset_capture_state(device, pool)
            raise GraphCaptureError(_capture_reason(exc)) from exc
        if any("empty" in str(w.message).lower() for w in caught):
            raise GraphCaptureError(
                "the body launched no GPU work while it was captured (CPU tensors?), "
                "so replaying the graph would time nothing"
            )
        graph.replay()
        torch.cuda.synchronize(device)
    replay: Callable[[], None] = graph.replay
    return replay


def _reset_capture_state(device: int, pool: object) -> None:
    """Undo what a failed capture leaves behind.

    When ending a capture fails (``cudaStreamEndCapture`` reports the error that broke
    it), torch's ``CUDAGraph::capture_end`` throws before it tells the caching allocator
    that the capture into ``pool`` ended and before its generators' capture epilogue
    runs. Left so, the allocator believes a capture is still under way, and
    ``torch.cuda.empty_cache()`` releases nothing for the rest of the process; the CUDA
    RNG stays in capture mode, and every later random op fails ("Offset increment
    outside graph capture encountered unexpectedly"). The allocator is told the capture
    ended and the pool is given up (its blocks become releasable); a trivial capture
    that succeeds runs the epilogue and puts the RNG back.
    """
    torch = torch_module()
    with contextlib.suppress(Exception):  # the capture may have failed before it began
        torch._C._cuda_endAllocateToPool(device, pool)
    with contextlib.suppress(Exception):
        torch._C._cuda_releasePool(device, pool)
    scratch = torch.cuda.CUDAGraph()
    with contextlib.suppress(Exception), torch.cuda.graph(scratch):
        torch.ones(1, device=device)
    del scratch


def _capture_reason(exc: BaseException) -> str:
    chain = [exc]
    while chain[-1].__context__ is not None and len(chain) < 10:
        chain.append(chain[-1].__context__)
    texts = " ".join(str(e) for e in chain)
    root = chain[-1]
    first = (str(root).strip().splitlines() or [""])[0]
    if "capturing" in texts or "StreamCapture" in texts or "capture" in first.lower():
        return (
            f"the body synchronizes with the host or leaves the GPU during capture ({first}); "
            "CUDA graphs cannot hold that: look for .item(), .cpu(), printing a CUDA "
            "tensor, nonzero() or data-dependent shapes (--sync-check names them)"
        )
    return f"{type(root).__name__}: {first}"
