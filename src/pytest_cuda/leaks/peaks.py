"""Peaks since a moment: what a memory limit judges and ``--cuda-memory-report`` lists,
each test's largest allocation per device, read from this process's caching allocator
through :mod:`gpumagic.cuda`.

Only devices with a CUDA context are touched: one without has never held an allocation
of torch's, so its counters are zero until the test makes one. On each of the others
:func:`reset_peaks` costs a peak reset and one allocator read, :func:`peaks_since` one
read (:func:`gpumagic.cuda.allocation_marks`: the bytes allocated now, the peak, and the
bytes allocated ever, which moved if the test allocated there). Never imports pytest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumagic import cuda

if TYPE_CHECKING:
    from collections.abc import Collection

__all__ = ["PeakStart", "peaks_since", "reset_peaks"]


@dataclass(frozen=True)
class PeakStart:
    """The peak counters just reset: ``marks``, per device with a context, ``(bytes
    allocated, bytes allocated ever)`` then; ``at_us``: when (epoch microseconds, as the
    allocator's events are timed)."""

    marks: dict[int, tuple[int, int]]
    at_us: int


def reset_peaks() -> PeakStart:
    """The peak counter of every device with a CUDA context reset to what is allocated
    now (none before torch initialised CUDA)."""
    marks = {}
    for device in cuda.devices_with_context():
        cuda.reset_peak_memory_stats(device)
        allocated, _, ever, _ = cuda.allocation_marks(device)
        marks[device] = (allocated, ever)
    return PeakStart(marks, time.time_ns() // 1000)


def peaks_since(start: PeakStart | None, devices: Collection[int] | None = None) -> list[list[int]]:
    """``[[device, peak bytes, bytes at the start]]`` for the devices the test allocated
    on since :func:`reset_peaks` gave ``start`` (their bytes allocated ever moved; a
    device without a context then started at zero); ``devices``: only these (``None``:
    every device)."""
    marks = start.marks if start is not None else {}
    found = []
    for device in cuda.devices_with_context():
        if devices is not None and device not in devices:
            continue
        _, peak, ever, _ = cuda.allocation_marks(device)
        allocated_before, ever_before = marks.get(device, (0, 0))
        if ever != ever_before:
            found.append([device, peak, allocated_before])
    return found
