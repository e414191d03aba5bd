"""``%lprun --gpu`` for one session: torch.profiler records the GPU work, the boundary
hook records which lines ran when, and after the run each kernel is charged to its line
(:mod:`gpumagic.lineprof_attribution`). No CUDA event and no wait at any line boundary.

The hook calls :meth:`KernelLines.thread_events` at every boundary (one dict look-up;
a thread seen for the first time gets a mark in the profiler's record, which ties its
torch thread id to it), and :meth:`KernelLines.finish` after the run. All CUDA and torch
calls go through :mod:`gpumagic.cuda`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING

from gpumagic import cuda
from gpumagic.lineprof_attribution import GpuAttribution, attribute
from gpumagic.lineprof_timeline import ClockFit, LineStacks

if TYPE_CHECKING:
    from collections.abc import Iterable

    from gpumagic.lineprof_timeline import LineEvent, Where

__all__ = ["MARK_PREFIX", "KernelLines", "TraceCost"]

#: The name of gpumagic's marks in the profiler's record.
MARK_PREFIX = "gpumagic.lprun."
_MARKS = 8  # at the start and at the end of the run, for the clock fit


class TraceCost:
    """What recording the GPU work cost, outside the profiled lines (seconds)."""

    __slots__ = ("match_s", "start_s", "stop_s")

    def __init__(self) -> None:
        self.start_s = 0.0
        self.stop_s = 0.0
        self.match_s = 0.0

    @property
    def total_s(self) -> float:
        return self.start_s + self.stop_s + self.match_s


class KernelLines:
    """The profiler and the line timeline of one session."""

    def __init__(
        self, devices: tuple[int, ...], open_lines: Iterable[tuple[int, int, Where]] = ()
    ) -> None:
        """Start the profiler; ``open_lines``: ``(thread, frame key, where)`` of the lines
        already running (the hook started within the run), outermost first."""
        started = time.perf_counter()
        self.cost = TraceCost()
        self.devices = devices
        self.events: dict[int, list[LineEvent]] = {}
        self.marks: list[tuple[str, int, int]] = []
        self.os_threads: dict[int, int] = {}
        self.session_thread = threading.get_ident()
        self.recorder = cuda.start_kernel_trace()
        try:
            for _ in range(_MARKS):
                self._mark(self.session_thread)
        except BaseException:
            self.recorder.stop()
            raise
        now = time.perf_counter_ns()
        for thread, key, where in open_lines:
            self.thread_events(thread).append((now, key, where))
        self.cost.start_s = time.perf_counter() - started

    def _mark(self, thread: int) -> None:
        label = f"{MARK_PREFIX}{thread}.{len(self.marks)}"
        before, after = self.recorder.mark(label)
        self.marks.append((label, before, after))

    def thread_events(self, thread: int) -> list[LineEvent]:
        """The timeline of ``thread`` (the calling thread when it is new)."""
        events = self.events.get(thread)
        if events is None:
            events = self.events[thread] = []
            # CUPTI's thread id of a runtime call: the OS's, or pthread's (maybe cut to
            # 32 bits, signed or not), depending on the versions.
            low = thread & 0xFFFFFFFF
            for alias in (threading.get_native_id(), thread, low, low - (low >> 31 << 32)):
                self.os_threads[alias] = thread
            with contextlib.suppress(Exception):  # unmarked, its work counts apart
                self._mark(thread)
        return events

    def finish(self, *, wait: bool = True) -> GpuAttribution:
        """Stop the profiler (``wait``: once the devices' work is done, so that the record
        holds all of it) and charge its record to the lines."""
        started = time.perf_counter()
        try:
            for _ in range(_MARKS):
                self._mark(self.session_thread)
            if wait:
                cuda.synchronize(self.devices)
        finally:
            trace = self.recorder.stop()
        stopped = time.perf_counter()
        self.cost.stop_s = stopped - started
        at = {op.name: op for op in trace.ops if op.name.startswith(MARK_PREFIX)}
        found = [(b, a, at[label].start_ns) for label, b, a in self.marks if label in at]
        if not found:
            raise RuntimeError("the profiler's record holds none of gpumagic's marks")
        threads = {
            at[label].thread: int(label[len(MARK_PREFIX) :].split(".")[0])
            for label, _, _ in self.marks
            if label in at
        }
        result = attribute(
            trace,
            LineStacks(self.events),
            ClockFit.from_marks(found),
            threads=threads,
            os_threads=self.os_threads,
            session_thread=self.session_thread,
        )
        self.cost.match_s = time.perf_counter() - stopped
        return result
