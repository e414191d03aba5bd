"""Peaks since a moment: what a memory limit judges and ``--cuda-memory-report`` lists,
each test's largest allocation per device, read from this process's caching allocator
through :mod:`gpumagic.cuda`.

Only devices with a CUDA context are touched: one without has never held an allocation
of torch's, so its counters are zero until the test makes one. On each of the others
:func:`reset_peaks` costs a peak reset (a C call) and, with ``marks``, one allocator read;
:func:`peaks_since` one read (:func:`gpumagic.cuda.allocation_marks`: the bytes allocated
now, the peak, and the bytes allocated ever, which moved if the test allocated there).
An allocator read builds torch's whole statistics dict (about 19 µs on an H200), so a
memory limit whose allocator records its events reads only at the end: whether the test
allocated on a device over the limit, and what was allocated at its start, come from the
ring then (:func:`pytest_cuda.leaks.limit.blocks_at_peak`). Never imports pytest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumagic import cuda

if TYPE_CHECKING:
    from collections.abc import Collection

__all__ = ["PeakStart", "peaks_since", "reset_peaks", "with_marks"]


@dataclass(frozen=True)
class PeakStart:
    """The peak counters just reset: ``marks``, per device with a context, ``(bytes
    allocated, bytes allocated ever)`` then (``None``: not read, see :func:`with_marks`);
    ``at_us``: when (epoch microseconds, as the allocator's events are timed)."""

    marks: dict[int, tuple[int, int]] | None
    at_us: int


def reset_peaks(*, marks: bool = True) -> PeakStart:
    """The peak counter of every device with a CUDA context reset to what is allocated
    now (none before torch initialised CUDA); ``marks``: each one's allocator read too."""
    devices = cuda.devices_with_context()
    for device in devices:
        cuda.reset_peak_memory_stats(device)
    return PeakStart(_marks(devices) if marks else None, time.time_ns() // 1000)


def with_marks(start: PeakStart) -> PeakStart:
    """``start`` with its marks, read now if it has none: right after its reset, before
    the test runs, nothing was allocated in between."""
    if start.marks is not None:
        return start
    return PeakStart(_marks(cuda.devices_with_context()), start.at_us)


def _marks(devices: Collection[int]) -> dict[int, tuple[int, int]]:
    found = {}
    for device in devices:
        allocated, _, ever, _ = cuda.allocation_marks(device)
        found[device] = (allocated, ever)
    return found


def peaks_since(
    start: PeakStart | None, devices: Collection[int] | None = None
) -> list[tuple[int, int, int | None]]:
    """``(device, peak bytes, bytes at the start)`` for the devices the test allocated
    on since :func:`reset_peaks` gave ``start`` (their bytes allocated ever moved; a
    device without a context then started at zero); ``devices``: only these (``None``:
    every device). A ``start`` without marks cannot tell: every device with a context,
    its bytes at the start ``None``."""
    marks = start.marks if start is not None else {}
    found: list[tuple[int, int, int | None]] = []
    for device in cuda.devices_with_context():
        if devices is not None and device not in devices:
            continue
        _, peak, ever, _ = cuda.allocation_marks(device)
        if marks is None:
            found.append((device, peak, None))
            continue
        allocated_before, ever_before = marks.get(device, (0, 0))
        if ever != ever_before:
            found.append((device, peak, allocated_before))
    return found
