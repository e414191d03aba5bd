"""torch's caching allocator: counters, peaks, allocation history and snapshots, and
releasing what libraries keep by design (cuBLAS
workspaces, cuFFT plans, torch.compile caches, blocks freed on other streams)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpumagic.cuda.discovery import is_initialized, torch_module
from gpumagic.cuda.runtime import visible_device_total

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

__all__ = [
    "AllocatorStats",
    "allocated_bytes",
    "allocation_marks",
    "allocator_backend",
    "allocator_stats",
    "clear_fft_plan_caches",
    "device_total_memory",
    "empty_cache",
    "memory_history_enabled",
    "memory_snapshot",
    "on_cuda_init",
    "release_blas_workspaces",
    "release_cached_blocks",
    "reset_compile_caches",
    "reset_peak_memory_stats",
    "start_memory_history",
    "stop_memory_history",
]


@dataclass(frozen=True)
class AllocatorStats:
    """The caching allocator's counters for one device at one moment, in bytes.

    ``requested``: what the tensors asked for, before rounding to blocks;
    ``allocations``: how many allocations were ever made (a count, not bytes).
    """

    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    requested: int = 0
    allocations: int = 0


def allocator_stats(device: int = 0) -> AllocatorStats:
    """Allocator counters through the nested C call (~8 µs, not the 45 µs dict flatten).

    Returns zeros without touching CUDA when torch has not initialised it.
    """
    if not is_initialized():
        return AllocatorStats()
    stats = torch_module()._C._cuda_memoryStats(device)
    return AllocatorStats(
        allocated=_counter(stats, "allocated_bytes"),
        reserved=_counter(stats, "reserved_bytes"),
        peak_allocated=_counter(stats, "allocated_bytes", "peak"),
        peak_reserved=_counter(stats, "reserved_bytes", "peak"),
        requested=_counter(stats, "requested_bytes"),
        allocations=_counter(stats, "allocation", "allocated"),
    )


def _counter(stats: dict[str, Any], name: str, which: str = "current") -> int:
    """One counter of ``torch._C._cuda_memoryStats``'s nested dict, all pools together."""
    entry = stats.get(name)
    return int(entry["all"][which]) if entry else 0


def allocated_bytes() -> dict[int, int]:
    """Bytes allocated now on each device torch has, ``{}`` before torch initialised
    CUDA: the one number a leak check reads per test, through the same nested C call
    as :func:`allocator_stats`, once per device, with nothing else built."""
    total = visible_device_total()
    if not total:
        return {}
    memory_stats = torch_module()._C._cuda_memoryStats
    return {device: _counter(memory_stats(device), "allocated_bytes") for device in range(total)}


def reset_peak_memory_stats(device: int) -> None:
    """Reset every peak counter of ``device`` (torch's API is all-or-nothing per device).

    Callers must say so to the user: it changes what ``torch.cuda.max_memory_allocated``
    reports afterwards. Does nothing when CUDA is not initialised. The C call itself:
    ``torch.cuda.reset_peak_memory_stats`` adds only its checks of a device argument,
    which an index does not need (a memory limit resets every test).
    """
    if is_initialized():
        torch_module()._C._cuda_resetPeakMemoryStats(device)


def empty_cache() -> None:
    """Return torch's cached, unused blocks to the driver (only when CUDA is initialised)."""
    if is_initialized():
        torch_module().cuda.empty_cache()


def allocator_backend() -> str | None:
    """``"native"`` or ``"cudaMallocAsync"``; ``None`` when torch is not imported."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "cuda"):
        return None
    try:
        return str(torch.cuda.get_allocator_backend())
    except (AttributeError, RuntimeError):
        return None


def device_total_memory(device: int) -> int | None:
    """Total memory of ``device`` from torch's properties, only once CUDA is initialised
    (reading properties earlier would initialise it)."""
    if not is_initialized():
        return None
    return int(torch_module().cuda.get_device_properties(device).total_memory)


def memory_history_enabled() -> bool:
    """Whether torch's allocator is recording allocation stacks (the user's or ours)."""
    if not is_initialized():
        return False
    probe = getattr(torch_module()._C, "_cuda_isHistoryEnabled", None)
    return bool(probe()) if probe is not None else False


def start_memory_history(
    max_entries: int,
    *,
    events: bool = False,
    event_stacks: bool = True,
    skip_actions: tuple[str, ...] = (),
) -> bool:
    """Record the Python stack of every allocation from now on, unless recording is on.

    One stack capture per allocation, none per free (``stacks="python"``), in a ring
    of at most ``max_entries`` entries. ``events=False``: the stacks of live blocks
    only (``"state"``: what ``%%gpumem --trace`` reads); ``events=True``: also the ring
    of allocator events with their times (``"all"``, ``context="alloc"``), which tells a
    leak check which live blocks are new. ``event_stacks=False`` (with ``events``): the
    events keep no stack of their own (``context="state"``), only the live blocks do;
    the cheapest recording that still says which live blocks are new and who allocated
    them.

    ``skip_actions``: events the ring need not keep (``"free_completed"``: a free is
    already in the ring as ``"free_requested"``, when the allocated bytes drop); a torch
    without that option keeps them all.

    ``True`` when this call turned recording on (turn it off with
    :func:`stop_memory_history`); ``False`` when it was on already: the user's own
    ``_record_memory_history`` settings are kept. Initialises CUDA when it is not yet
    (recording needs the allocator); safe inside :func:`on_cuda_init`'s callback.
    """
    torch = torch_module()
    torch.cuda.init()  # nothing when initialised or initialising
    if torch._C._cuda_isHistoryEnabled():
        return False
    enabled = "all" if events else "state"
    context = "alloc" if events and event_stacks else "state"
    record = torch.cuda.memory._record_memory_history
    if skip_actions:
        try:
            record(
                enabled,
                context=context,
                stacks="python",
                max_entries=max_entries,
                skip_actions=list(skip_actions),
            )
        except TypeError:  # torch without skip_actions: the ring keeps every event
            pass
        else:
            return True
    record(enabled, context=context, stacks="python", max_entries=max_entries)
    return True


def stop_memory_history() -> None:
    """Switch allocation-stack recording off (only after :func:`start_memory_history`
    returned ``True``)."""
    torch_module().cuda.memory._record_memory_history(None)


def memory_snapshot() -> dict[str, Any]:
    """``torch.cuda.memory._snapshot()``: segments with their blocks (and allocation
    stacks when recording), and each device's ring of allocator events."""
    return dict(torch_module().cuda.memory._snapshot())


def allocation_marks(device: int) -> tuple[int, int, int, int]:
    """``(allocated, peak allocated, bytes allocated ever, bytes freed ever)`` of the
    caching allocator on ``device``: one nested C call, no dict flattening (about 8 µs).
    Only for a device with a context (:func:`~gpumagic.cuda.devices_with_context`)."""
    stat = torch_module()._C._cuda_memoryStats(device)["allocated_bytes"]["all"]
    return int(stat["current"]), int(stat["peak"]), int(stat["allocated"]), int(stat["freed"])


def release_blas_workspaces() -> bool:
    """Free torch's cuBLAS and cuBLASLt workspaces (32 MiB per handle and stream on
    Hopper); the next matmul takes new ones from the caching allocator.

    ``False`` when there is nothing to call (CUDA not initialised, or a torch without
    ``torch._C._cuda_clearCublasWorkspaces``).
    """
    if not is_initialized():
        return False
    clear = getattr(torch_module()._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return False
    clear()
    return True


def clear_fft_plan_caches(devices: Iterable[int]) -> bool:
    """Empty the cuFFT plan cache of each of ``devices`` that holds plans; ``True`` if
    one did."""
    if not is_initialized():
        return False
    torch = torch_module()
    size = getattr(torch, "_cufft_get_plan_cache_size", None)
    clear = getattr(torch, "_cufft_clear_plan_cache", None)
    if size is None or clear is None:
        return False
    cleared = False
    for device in devices:
        if size(device):
            clear(device)
            cleared = True
    return cleared


def release_cached_blocks(devices: Iterable[int]) -> None:
    """Wait for all work on ``devices``, then return cached blocks to the driver.

    ``empty_cache`` also completes the frees that waited for other streams
    (``Tensor.record_stream``), which the allocated-bytes counter still holds. Only pass
    devices that hold allocations: synchronising a device creates its context.
    """
    if not is_initialized():
        return
    torch = torch_module()
    for device in devices:
        torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def reset_compile_caches() -> bool:
    """``torch._dynamo.reset()`` when torch.compile has been used in this process: it
    drops compiled graphs and the constants they hold (later calls compile again).
    ``False`` when torch._dynamo was never imported."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return False
    dynamo.reset()
    return True


def on_cuda_init(callback: Callable[[], object]) -> bool:
    """Run ``callback`` as soon as torch initialises CUDA (at once if it has).

    ``callback`` runs inside torch's lazy initialisation, where an exception would fail
    the user's first CUDA call: it must not raise. ``False`` when torch is not imported
    (nothing can be queued; this never imports it).
    """
    torch = sys.modules.get("torch")
    lazy_call = getattr(getattr(torch, "cuda", None), "_lazy_call", None)
    if lazy_call is None:
        return False
    lazy_call(callback)
    return True
