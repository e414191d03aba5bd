"""One cell's effect on GPU memory: the core of ``%%gpumem`` and ``%gpumem watch``.

Allocated delta, the exact peak from the allocator's own counter (reset only when the
user's earlier peak would hide the cell's, and then said so), reserved growth, and with
``--trace`` the lines that allocated what is still alive after the cell (from the
allocator's recorded allocation stacks, read through :mod:`gpumagic.stacks`), and with
``--timeline`` the memory over the cell from the allocator's event history (read
through :mod:`gpumagic.memory_timeline`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpumagic import cuda
from gpumagic.gc_pause import paused_gc
from gpumagic.memory import PeakReset
from gpumagic.memory_timeline import TIMELINE_MAX_ENTRIES, Timeline, build_timeline
from gpumagic.stacks import TraceLine, blocks_from_segments, group_by_line

if TYPE_CHECKING:
    from collections.abc import Callable

    from gpumagic.cuda import AllocatorStats
    from gpumagic.devices import DeviceInfo

__all__ = ["CellDeviceChange", "CellMemoryReport", "CellMeter", "cell_peak"]

# Every allocation stack recorded by ``%%gpumem --trace`` costs host memory; the
# allocator's event ring buffer is kept this small.
TRACE_MAX_ENTRIES = 10_000


def cell_peak(
    start: AllocatorStats, end: AllocatorStats, *, reset: bool
) -> tuple[int | None, int | None]:
    """``(peak, upper_bound)`` of allocated memory during a cell.

    The allocator's peak counter is monotone since its last reset. It gives the cell's
    exact peak when it was reset at the cell's start, when it was not above the
    allocated memory then, or when the cell set a new high. Otherwise only an upper
    bound (the user's earlier peak) is known, and ``peak`` is ``None``.
    """
    if reset or start.peak_allocated <= start.allocated:
        return end.peak_allocated, None
    if end.peak_allocated > start.peak_allocated:
        return end.peak_allocated, None
    return None, start.peak_allocated


@dataclass(frozen=True)
class CellDeviceChange:
    """What one cell did to one device's memory."""

    #: The device's index.
    index: int
    #: The device's name.
    name: str
    #: The allocator's counters when the cell started.
    start: AllocatorStats
    #: The allocator's counters when it ended.
    end: AllocatorStats
    #: The cell's exact peak of allocated bytes, where the counter could be read for the
    #: cell alone; else ``None``.
    peak: int | None
    #: With ``--keep-peak``: an upper bound of the cell's peak (the counter kept the peak
    #: from before the cell).
    peak_upper: int | None = None
    #: The reset of the device's peak counter this cell needed, if any.
    reset: PeakReset | None = None
    #: This process's memory on the device per NVML when the cell started.
    process_start: int | None = None
    #: The same when it ended.
    process_end: int | None = None

    @property
    def label(self) -> str:
        """``"cuda:0"``."""
        return f"cuda:{self.index}"

    @property
    def allocated_delta(self) -> int:
        """Change in memory allocated by tensors."""
        return self.end.allocated - self.start.allocated

    @property
    def reserved_delta(self) -> int:
        """Growth of torch's cache (cudaMalloc'd segments)."""
        return self.end.reserved - self.start.reserved

    @property
    def peak_above_start(self) -> int | None:
        """How far the peak rose above the allocated memory at the start."""
        return None if self.peak is None else max(0, self.peak - self.start.allocated)

    @property
    def process_delta(self) -> int | None:
        """Change of this process's memory on the device per NVML."""
        if self.process_end is None:
            return None
        return self.process_end - (self.process_start or 0)

    @property
    def changed(self) -> bool:
        """Whether the cell did anything on this device."""
        return bool(
            self.allocated_delta
            or self.reserved_delta
            or (self.peak_above_start or 0)
            or (self.process_delta or 0)
        )


@dataclass(frozen=True)
class CellMemoryReport:
    """``%%gpumem`` and ``%gpumem watch``: one cell's effect on GPU memory."""

    #: The cell as the output names it.
    label: str
    #: One entry per device the cell could change.
    changes: tuple[CellDeviceChange, ...] = ()
    #: With ``--trace``: the lines that allocated what the cell left allocated, largest
    #: first.
    trace: tuple[TraceLine, ...] | None = None
    #: With ``--timeline``: the memory over the cell, one per device.
    timelines: tuple[Timeline, ...] | None = None
    #: Whether the cell was the first CUDA work of the process (its context is in the
    #: figures).
    initialized_by_cell: bool = False
    #: What is approximate or missing, and why (one sentence each).
    notes: tuple[str, ...] = ()
    #: Why nothing could be measured (no CUDA), else ``None``.
    unavailable: str | None = None

    @property
    def shown(self) -> tuple[CellDeviceChange, ...]:
        """The devices the cell changed (the first device when it changed none)."""
        changed = tuple(c for c in self.changes if c.changed)
        return changed or self.changes[:1]


@dataclass
class CellMeter:
    """Measures one cell: call :meth:`start` before it runs and :meth:`finish` after.

    Peaks come from the allocator's counter. If the user's earlier peak is above the
    memory allocated at the cell's start it would hide the cell's peak, so the counter
    is reset then (the report says so and keeps the peak from before) unless
    ``keep_peak``, which reports an upper bound instead. With ``trace``, allocation
    stacks are recorded during the cell and switched off again afterwards (when the
    user was already recording, their settings are left alone). ``timeline`` records
    the allocator's events as well (``enabled="all"``, stacks at allocation only), the
    same way; a recording of the user's is read as it is, and kept.
    """

    devices: tuple[DeviceInfo, ...]
    label: str
    keep_peak: bool = False
    trace: bool = False
    timeline: bool = False
    #: ``--snapshot``: record as ``timeline`` does, and keep the allocator's snapshot
    #: taken after the cell in :attr:`snapshot`.
    keep_snapshot: bool = False
    snapshot: dict[str, Any] | None = None
    pid: int = field(default_factory=os.getpid)
    _start: dict[int, AllocatorStats] = field(default_factory=dict)
    _process: dict[int, int | None] = field(default_factory=dict)
    _resets: dict[int, int] = field(default_factory=dict)  # device: peak before the reset
    _initialized: bool = False
    _recording: bool = False
    _user_recording: bool = False
    _start_us: int = 0
    _notes: list[str] = field(default_factory=list)

    def start(self) -> None:
        """Read the counters (and reset peaks where needed) just before the cell."""
        self._initialized = cuda.is_initialized()
        if self.trace or self.timeline or self.keep_snapshot:
            self._start_history()
        for device in self.devices:
            counters = cuda.allocator_stats(device.index)
            self._process[device.index] = self._own_process(device)
            if not self.keep_peak and counters.peak_allocated > counters.allocated:
                cuda.reset_peak_memory_stats(device.index)
                self._resets[device.index] = counters.peak_allocated
            self._start[device.index] = counters

    def _options(self) -> str:
        asked = (("--trace", self.trace), ("--timeline", self.timeline))
        return " and ".join(n for n, on in (*asked, ("--snapshot", self.keep_snapshot)) if on)

    def _start_history(self) -> None:
        options = self._options()
        self._start_us = time.time_ns() // 1000
        try:
            if self.timeline or self.keep_snapshot:
                # One stack per allocation, none per free; a free is kept once (when
                # the allocated bytes drop), not again when its block is reusable.
                self._recording = cuda.start_memory_history(
                    TIMELINE_MAX_ENTRIES, events=True, skip_actions=("free_completed",)
                )
            else:
                self._recording = cuda.start_memory_history(TRACE_MAX_ENTRIES)
        except (RuntimeError, cuda.CudaUnavailable) as exc:
            self.trace = self.timeline = False
            self._notes.append(
                f"{options} {'is' if ' ' not in options else 'are'} unavailable here: {exc}"
            )
            return
        self._user_recording = not self._recording
        if self._user_recording:
            self._notes.append(
                "allocation stacks were already being recorded; your "
                "_record_memory_history settings were kept"
            )
        if not self._initialized and cuda.is_initialized():
            self._initialized = True
            self._notes.append(
                f"{options} initialised CUDA before the cell ran (recording needs torch's "
                "allocator)"
            )

    def _own_process(self, device: DeviceInfo) -> int | None:
        try:
            listed = cuda.nvml_processes(device)
        except cuda.CudaUnavailable:
            return None
        return next((used for pid, used in listed if pid == self.pid), None)

    def finish(
        self,
        *,
        cell_files: frozenset[str] = frozenset(),
        is_user: Callable[[str], bool] = lambda filename: True,
        where: Callable[[str, int], str] = lambda filename, line: f"{filename}:{line}",
        source: Callable[[str, int], str] = lambda filename, line: "",
    ) -> CellMemoryReport:
        """Read the counters after the cell; with ``trace`` group what is still
        allocated by line (``cell_files``: the cell's own source files)."""
        # With --trace or --timeline the snapshot builds a dict per allocator event (and
        # per block): a collection started among them would walk the whole process, often
        # more than once. They are all gone again when _finish returns.
        with paused_gc():
            return self._finish(cell_files=cell_files, is_user=is_user, where=where, source=source)

    def _finish(
        self,
        *,
        cell_files: frozenset[str],
        is_user: Callable[[str], bool],
        where: Callable[[str, int], str],
        source: Callable[[str, int], str],
    ) -> CellMemoryReport:
        trace: tuple[TraceLine, ...] | None = None
        notes = list(self._notes)
        snapshot: dict[str, Any] = {}
        try:
            if self.trace or self.timeline or self.keep_snapshot:
                snapshot = cuda.memory_snapshot()
            if self.keep_snapshot:
                self.snapshot = snapshot
            if self.trace:
                blocks = blocks_from_segments(
                    snapshot.get("segments") or (), {d.index for d in self.devices}
                )
                # Only what this cell's code allocated: a block keeps the stack it was
                # allocated with for as long as it lives, so blocks from an earlier
                # recorded cell (or the user's recording) carry stacks of their own.
                trace = group_by_line(
                    blocks,
                    cell_files=cell_files,
                    only_cell=True,
                    is_user=is_user,
                    where=where,
                    source=source,
                )
        finally:
            if self._recording:
                cuda.stop_memory_history()
        changes = []
        for device in self.devices:
            start = self._start[device.index]
            end = cuda.allocator_stats(device.index)
            before = self._resets.get(device.index)
            reset = None if before is None else PeakReset(device.index, self.label, before)
            peak, upper = cell_peak(start, end, reset=reset is not None)
            if peak is not None and peak < start.allocated:
                notes.append(
                    f"cuda:{device.index}: the peak counter was reset during the cell; "
                    "the peak covers the time since"
                )
            changes.append(
                CellDeviceChange(
                    index=device.index,
                    name=device.name,
                    start=start,
                    end=end,
                    peak=peak,
                    peak_upper=upper,
                    reset=reset,
                    process_start=self._process[device.index],
                    process_end=self._own_process(device),
                )
            )
        timelines = None
        if self.timeline:
            timelines = self._timelines(
                snapshot,
                changes,
                cell_files=cell_files,
                is_user=is_user,
                where=where,
                source=source,
            )
            notes.extend(self._timeline_notes(timelines))
        initialized_by_cell = not self._initialized and cuda.is_initialized()
        return CellMemoryReport(
            label=self.label,
            changes=tuple(changes),
            trace=trace,
            timelines=timelines,
            initialized_by_cell=initialized_by_cell,
            notes=tuple(notes),
        )

    def _timelines(
        self,
        snapshot: dict[str, Any],
        changes: list[CellDeviceChange],
        **attribution: Any,
    ) -> tuple[Timeline, ...]:
        traces = snapshot.get("device_traces") or ()
        found: list[Timeline] = []
        for change in changes:
            events = traces[change.index] if change.index < len(traces) else ()
            if not events and found:
                continue
            found.append(
                build_timeline(
                    events,
                    device=change.index,
                    start_allocated=change.start.requested,
                    start_reserved=change.start.reserved,
                    end_allocated=change.end.requested,
                    # Our own recording started with an empty ring: all of it is the
                    # cell's. A recording of the user's holds events from before.
                    start_us=self._start_us if self._user_recording else None,
                    only_cell=self._user_recording,
                    **attribution,
                )
            )
        # The devices the cell used; the first one when it used none.
        return tuple(t for t in found if t.events) or tuple(found[:1])

    def _timeline_notes(self, timelines: tuple[Timeline, ...]) -> list[str]:
        notes = []
        for timeline in timelines:
            if timeline.complete:
                continue
            if self._user_recording:
                why = (
                    "your own _record_memory_history settings (kept) record too few "
                    "events for it; record with enabled='all' and a larger max_entries"
                )
            else:
                why = f"the allocator keeps its last {TIMELINE_MAX_ENTRIES:,} events"
            notes.append(
                f"cuda:{timeline.device}: the timeline misses the start of the cell ({why}); "
                "it shows the last "
                f"{timeline.events:,} events, and memory allocated before them counts as "
                "allocated before the cell"
            )
        return notes

    @property
    def resets(self) -> tuple[PeakReset, ...]:
        """The peak resets :meth:`start` made."""
        return tuple(PeakReset(d, self.label, before) for d, before in self._resets.items())
