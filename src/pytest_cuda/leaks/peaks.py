"""The peaks ``--cuda-memory-report`` lists: each measured test's largest allocation
per device, read from this process's caching allocator through :mod:`gpumagic.cuda`."""

from __future__ import annotations

from gpumagic import cuda

__all__ = ["peaks_since", "reset_peaks"]


def reset_peaks() -> dict[int, cuda.AllocatorStats]:
    """Every device's peak counter reset to what is allocated now; the stats then."""
    if not cuda.is_initialized():
        return {}
    stats = {}
    for device in range(cuda.visible_device_total()):
        cuda.reset_peak_memory_stats(device)
        stats[device] = cuda.allocator_stats(device)
    return stats


def peaks_since(start: dict[int, cuda.AllocatorStats], end: dict[int, int]) -> list[list[int]]:
    """``[[device, peak bytes, bytes at the start of the call]]`` for the devices the test
    allocated on (its allocation count moved since :func:`reset_peaks` gave ``start``);
    ``end``: a reading of every device."""
    found = []
    for device in end:
        stats = cuda.allocator_stats(device)
        before = start.get(device)
        if before is not None and stats.allocations == before.allocations:
            continue
        found.append([device, stats.peak_allocated, before.allocated if before else 0])
    return found
