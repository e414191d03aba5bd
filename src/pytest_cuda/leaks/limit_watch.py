"""One test's memory limit, measured: :class:`LimitWatch`, with :meth:`~LimitWatch.begin`
and :meth:`~LimitWatch.over`.

Used the same way by the pytest process (:mod:`pytest_cuda.leaks.limiter`) and inside
every rank of a ``cuda_distributed`` test (:mod:`pytest_cuda.distributed.rank_main`).
``begin`` resets the peak counter of each device with a context
(:func:`~pytest_cuda.leaks.peaks.reset_peaks`, as ``--cuda-memory-report`` does: one reset
serves both), and reads the allocator only where its events are not recorded; ``over``
reads the peaks (one allocator read per device with a context: with the reset, the
whole cost of a test under its limit) and, for a device past the limit, replays the
allocator's events to the peak (:func:`~pytest_cuda.leaks.limit.blocks_at_peak`), which
also says whether the test allocated there and what was allocated at its start, and
groups what was alive at the peak by allocating stack. Never imports pytest; CUDA only
through :mod:`gpumagic.cuda`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpumagic import cuda
from gpumagic.stacks import FrameFilter, group_by_stack
from pytest_cuda.leaks.limit import OverLimit, blocks_at_peak
from pytest_cuda.leaks.peaks import PeakStart, peaks_since, reset_peaks
from pytest_cuda.leaks.recording import HISTORY_MAX_ENTRIES, StackRecording

__all__ = ["UNRECORDED", "LimitWatch", "start_marks_needed"]

UNRECORDED = (
    "Allocation stacks were not recorded (recording was switched off, or CUDA was "
    "first used before torch was imported): the blocks at the peak are not known."
)


def start_marks_needed() -> bool:
    """Whether a limit must read the allocator when a test starts: only where its events
    are not recorded (else the ring says at the end what that read would have)."""
    return not cuda.memory_history_enabled()


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
    _start: PeakStart | None = field(default=None, init=False)
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

    def begin(self, start: PeakStart | None = None) -> None:
        """The test starts: peaks reset now, or ``start``, a reset made for it already
        (``--cuda-memory-report``'s)."""
        if start is None:
            start = reset_peaks(marks=start_marks_needed())
        self._start = start

    def over(self) -> list[OverLimit]:
        """The devices whose peak since :meth:`begin` went over the limit, with what was
        alive at the peak (empty: within the limit everywhere)."""
        rows = peaks_since(self._start, self.devices)
        found = [(device, peak, start) for device, peak, start in rows if peak > self.limit]
        if not found:
            return []
        recorded = cuda.memory_history_enabled()
        if self.recording is not None:  # its own: on since CUDA's initialisation, maybe
            self.ring_size = HISTORY_MAX_ENTRIES if self.recording.owned else None
        self.snapshot = cuda.memory_snapshot()
        is_user = FrameFilter.default().is_user
        start_us = self._start.at_us if self._start is not None else 0
        verdicts = []
        for device, peak, read_start in found:
            start = read_start
            if recorded:
                at_peak = blocks_at_peak(self.snapshot, device, start_us, self.ring_size)
                if start is None:  # no read at the start: the ring says
                    if at_peak.complete and not at_peak.allocated:
                        continue  # nothing allocated there: what it started with
                    start = at_peak.at_start if at_peak.complete else None
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
