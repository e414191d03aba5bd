"""One test's memory limit, measured: :class:`LimitWatch`, with :meth:`~LimitWatch.begin`
and :meth:`~LimitWatch.over`.

Used the same way by the pytest process (:mod:`pytest_cuda.leaks.limiter`) and inside
every rank of a ``cuda_distributed`` test (:mod:`pytest_cuda.distributed.rank_main`).
``begin`` resets each device's peak counter (:func:`~pytest_cuda.leaks.peaks.reset_peaks`,
as ``--cuda-memory-report`` does); ``over`` reads the peaks (one allocator read per
device: the whole cost of a test under its limit) and, for a device past the limit,
replays the allocator's events to the peak (:func:`~pytest_cuda.leaks.limit.blocks_at_peak`)
and groups what was alive there by allocating stack. Never imports pytest; CUDA only
through :mod:`gpumagic.cuda`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpumagic import cuda
from gpumagic.stacks import FrameFilter, group_by_stack
from pytest_cuda.leaks.limit import OverLimit, blocks_at_peak
from pytest_cuda.leaks.peaks import peaks_since, reset_peaks
from pytest_cuda.leaks.stacks import HISTORY_MAX_ENTRIES, StackRecording

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["UNRECORDED", "LimitWatch"]

UNRECORDED = (
    "Allocation stacks were not recorded (recording was switched off, or CUDA was "
    "first used before torch was imported): the blocks at the peak are not known."
)


@dataclass
class LimitWatch:
    """One test's peak against ``limit`` bytes per device (``source``: where the limit
    comes from, for the message). ``devices``: only these are judged (a rank's own;
    ``None``: every device the test allocated on). ``outermost``: the test function's
    ``(file, name)``, where stacks are cut; ``ring_size``: how many events the
    allocator's ring keeps when the recording is ours (``None``: unknown)."""

    limit: int
    source: str
    outermost: tuple[str, str] | None = None
    devices: tuple[int, ...] | None = None
    ring_size: int | None = None
    _start: dict[int, cuda.AllocatorStats] = field(default_factory=dict, init=False)
    _start_us: int = field(default=0, init=False)
    #: The snapshot read for the last over-limit verdict (for ``--cuda-memory-snapshot``).
    snapshot: dict[str, Any] | None = field(default=None, init=False, repr=False)
    #: A recording of its own (:meth:`recorded`), switched off by :meth:`close`.
    recording: StackRecording | None = field(default=None, init=False, repr=False)

    @classmethod
    def recorded(
        cls,
        limit: int,
        source: str,
        *,
        outermost: tuple[str, str] | None = None,
        devices: tuple[int, ...] | None = None,
    ) -> LimitWatch:
        """A watch with a recording of its own (a rank's test): the allocator's events
        recorded with their stacks until :meth:`close`."""
        recording = StackRecording(event_stacks=True)
        recording.arm()
        watch = cls(limit, source, outermost=outermost, devices=devices)
        watch.recording = recording
        return watch

    def close(self) -> None:
        """Its own recording switched off (always safe)."""
        if self.recording is not None:
            self.recording.close()

    def failure(self, subject: str, root: str | None = None) -> tuple[str, str] | None:
        """``(summary, details)`` when the peak went over the limit (:meth:`over`),
        ``subject`` naming the test; ``None`` within it."""
        over = self.over()
        if not over:
            return None
        return over[0].summary(subject, root), "\n".join(o.details(root) for o in over)

    def begin(self) -> None:
        """Peaks reset; the moment the test starts."""
        self._start = reset_peaks()
        self._start_us = time.time_ns() // 1000

    def over(self) -> list[OverLimit]:
        """The devices whose peak since :meth:`begin` went over the limit, with what was
        alive at the peak (empty: within the limit everywhere)."""
        if not cuda.is_initialized():
            return []
        total = cuda.visible_device_total()
        wanted: Iterable[int] = range(total) if self.devices is None else self.devices
        rows = peaks_since(self._start, dict.fromkeys((d for d in wanted if d < total), 0))
        found = [(device, peak, start) for device, peak, start in rows if peak > self.limit]
        if not found:
            return []
        recorded = cuda.memory_history_enabled()
        if self.recording is not None:  # its own: on since CUDA's initialisation, maybe
            self.ring_size = HISTORY_MAX_ENTRIES if self.recording.owned else None
        self.snapshot = cuda.memory_snapshot()
        is_user = FrameFilter.default().is_user
        verdicts = []
        for device, peak, start in found:
            verdict = OverLimit(device, peak, self.limit, self.source, start)
            if recorded:
                at_peak = blocks_at_peak(self.snapshot, device, self._start_us, self.ring_size)
                stacks = group_by_stack(at_peak.blocks, is_user, outermost=self.outermost)
                note = "" if at_peak.complete else self._lost_note()
                verdict = OverLimit(
                    device, peak, self.limit, self.source, start, stacks, at_peak.before, note
                )
            else:
                verdict = OverLimit(device, peak, self.limit, self.source, start, note=UNRECORDED)
            verdicts.append(verdict)
        return verdicts

    def _lost_note(self) -> str:
        kept = f"its last {self.ring_size:,} events" if self.ring_size else "too few events"
        return (
            f"The allocator's event ring keeps {kept} and lost the test's first ones: the "
            "blocks shown are those alive at the highest point of what it kept."
        )
