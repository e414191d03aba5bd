"""``%lprun --gpu`` for one session: torch.profiler records the GPU work, the boundary
hook records which lines ran when, and after the run each kernel is charged to its line
(:mod:`gpumagic.lineprof_attribution`). No CUDA event and no wait at any line boundary.

The profiler records the CUDA activity only (kernels and the runtime calls that launched
them), and torch ops only while autograd's backward runs on the session's thread. The
hook calls :meth:`KernelLines.thread_events` when a thread runs its first profiled line
(one dict look-up after that), appends each boundary with the thread's next autograd
sequence number (:attr:`KernelLines.sequence_nr`), and calls :meth:`KernelLines.finish`
after the run. All CUDA and torch calls go through :mod:`gpumagic.cuda`.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from gpumagic import cuda
from gpumagic.lineprof_attribution import GpuAttribution, attribute
from gpumagic.lineprof_timeline import ClockFit, LineStacks

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterable

    from gpumagic.cuda.kernel_trace import KernelTrace
    from gpumagic.lineprof_timeline import LineEvent, Where

__all__ = ["MARK_PREFIX", "KernelLines", "TraceCost", "without_own_work"]

#: The name of gpumagic's marks in the profiler's record.
MARK_PREFIX = "gpumagic.lprun."
_MARKS = 8  # at the start and at the end of the run, for the clock fit


class TraceCost:
    """What recording the GPU work cost, outside the profiled lines (seconds)."""

    __slots__ = ("match_s", "replay_s", "start_s", "stop_s")

    def __init__(self) -> None:
        self.start_s = 0.0
        self.stop_s = 0.0
        self.match_s = 0.0
        #: replaying the raw line boundaries into the line timeline and the line figures
        self.replay_s = 0.0

    @property
    def total_s(self) -> float:
        return self.start_s + self.stop_s + self.match_s + self.replay_s


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
        self.native_thread = threading.get_native_id()
        #: host ns windows of our own launches on the session thread (not the user's)
        self.own: list[tuple[int, int]] = []
        #: the calling thread's next autograd sequence number (bound once)
        self.sequence_nr: Callable[[], int] = cuda.sequence_counter()
        self.recorder = cuda.start_kernel_trace()
        try:
            for _ in range(_MARKS):
                self._mark()
            self.recorder.collect_ops(False)
            self._warm_up()
            self.recorder.watch_backward(self._mark)
        except BaseException:
            self.recorder.stop()
            raise
        now = time.perf_counter_ns()
        seq = self.sequence_nr()
        for thread, key, where in open_lines:
            self.thread_events(thread).append((now, key, where, seq))
        self.cost.start_s = time.perf_counter() - started

    def _mark(self) -> None:
        """A mark on the session thread (only while torch ops are collected): for the
        clock fit, and to learn torch's id of the thread."""
        label = f"{MARK_PREFIX}{self.session_thread}.{len(self.marks)}"
        before, after = self.recorder.mark(label)
        self.marks.append((label, before, after))

    def _warm_up(self) -> None:
        """One empty kernel per device, now: the first launch under a fresh CUPTI
        session is slow (milliseconds), and the line that made it would pay. Its work
        is left out of the figures (:func:`without_own_work`)."""
        before = time.perf_counter_ns()
        for device in self.devices:
            cuda.spin(device, 0)
        self.own.append((before, time.perf_counter_ns()))

    def thread_events(self, thread: int, native: int | None = None) -> list[LineEvent]:
        """The timeline of ``thread``; ``native``: its OS id (None: ``thread`` is the
        calling thread)."""
        events = self.events.get(thread)
        if events is None:
            events = self.events[thread] = []
            if native is None:
                native = threading.get_native_id()
            for alias in _aliases(native, thread):
                self.os_threads[alias] = thread
        return events

    def finish(self, *, wait: bool = True) -> GpuAttribution:
        """Stop the profiler (``wait``: once the devices' work is done, so that the record
        holds all of it) and charge its record to the lines."""
        started = time.perf_counter()
        try:
            self.recorder.unwatch_backward()
            self.recorder.collect_ops(True)
            for _ in range(_MARKS):
                self._mark()
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
        clock = ClockFit.from_marks(found)
        threads = {
            at[label].thread: self.session_thread for label, _, _ in self.marks if label in at
        }
        result = attribute(
            without_own_work(
                trace, self.own, clock, _aliases(self.native_thread, self.session_thread)
            ),
            LineStacks(self.events),
            clock,
            threads=threads,
            os_threads=self.os_threads,
            session_thread=self.session_thread,
        )
        self.cost.match_s = time.perf_counter() - stopped
        return result


def _aliases(native: int, thread: int | None = None) -> set[int]:
    """The ids CUPTI may give a thread's runtime calls: the OS's, or pthread's (maybe cut
    to 32 bits, signed or not), depending on the versions."""
    found = {native}
    if thread is not None:
        low = thread & 0xFFFFFFFF
        found |= {thread, low, low - (low >> 31 << 32)}
    return found


def without_own_work(
    trace: KernelTrace,
    windows: Iterable[tuple[int, int]],
    clock: ClockFit,
    threads: Collection[int],
) -> KernelTrace:
    """``trace`` less the work launched by runtime calls on ``threads`` (OS ids) within
    ``windows`` (host ns): what gpumagic launched itself."""
    spans = list(windows)
    if not spans:
        return trace
    to_host = clock.to_host
    own = {
        call.correlation
        for call in trace.calls
        if call.thread in threads and any(lo <= to_host(call.start_ns) <= hi for lo, hi in spans)
    }
    if not own:
        return trace
    work = tuple(w for w in trace.work if w.correlation not in own)
    calls = tuple(c for c in trace.calls if c.correlation not in own)
    return cuda.KernelTrace(trace.ops, work, calls)
