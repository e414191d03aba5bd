"""Which profiled lines were running on each thread, and when (``%lprun --gpu``'s
timeline): pure Python, no torch, no IPython.

The boundary hook appends one event per line boundary of the profiled code, on the
thread it ran on: ``(perf_counter_ns, frame key, (label, statement line), sequence
number)`` when a frame starts a line, ``(perf_counter_ns, frame key, None, sequence
number)`` when it returns, yields or raises; the sequence number is the thread's next
autograd sequence number at that moment (the number the next graph node built on the
thread gets). :class:`LineStacks` replays them into the stack of profiled lines running
from each event on (outermost first), found by time (the line that launched a kernel is
the innermost one, and every line on the stack encloses it) or by sequence number (the
lines running when a graph node was built). :class:`ClockFit` maps the profiler's clock
onto ``perf_counter_ns`` from marks made on both.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

__all__ = ["ClockFit", "Label", "LineEvent", "LineStacks", "Stack", "Where"]

_DRIFT_SPAN = 500_000  # ns: marks closer than twice this show no drift worth fitting
_WIDE_MARK = 20_000  # ns: a mark's bracket this wide, and 4x the usual, is left out

#: line_profiler's name of a function: (filename, first line, qualified name).
Label = tuple[str, int, str]
#: A line of a profiled function: its label and the first line of the statement.
Where = tuple[Label, int]
#: The profiled lines running on a thread at one time, outermost first.
Stack = tuple[Where, ...]
#: One line boundary, as the hook records it: (ns, frame key, where, sequence number);
#: ``where`` None: the frame left its line.
LineEvent = tuple[int, int, "Where | None", int]


class LineStacks:
    """Per thread, the stack of profiled lines running from each boundary on."""

    def __init__(self, events: Mapping[int, Iterable[LineEvent]]) -> None:
        self._times: dict[int, list[int]] = {}
        self._seqs: dict[int, list[int]] = {}
        self._stacks: dict[int, list[Stack]] = {}
        for thread, stream in events.items():
            self._times[thread], self._seqs[thread], self._stacks[thread] = _replay(stream)

    @property
    def threads(self) -> tuple[int, ...]:
        """The threads that ran profiled lines."""
        return tuple(self._times)

    def at(self, thread: int, ns: float) -> Stack:
        """The lines running on ``thread`` at ``ns`` (``perf_counter_ns``); empty when
        none was (before the first line, between calls, on another thread)."""
        times = self._times.get(thread)
        if not times:
            return ()
        index = bisect_right(times, ns) - 1
        return self._stacks[thread][index] if index >= 0 else ()

    def built(self, thread: int, seq: int) -> Stack:
        """The lines running on ``thread`` when it built the graph node numbered ``seq``:
        those of the last boundary whose recorded number is at most ``seq`` (a thread's
        numbers only grow); empty when the node was built before the first line."""
        seqs = self._seqs.get(thread)
        if not seqs:
            return ()
        index = bisect_right(seqs, seq) - 1
        return self._stacks[thread][index] if index >= 0 else ()


def _replay(events: Iterable[LineEvent]) -> tuple[list[int], list[int], list[Stack]]:
    order: list[int] = []  # frame keys, outermost first
    lines: dict[int, Where] = {}
    times: list[int] = []
    seqs: list[int] = []
    stacks: list[Stack] = []
    for ns, key, where, seq in events:
        if key in lines:
            # Frames above this one left without an event we saw: they are gone.
            while order[-1] != key:
                del lines[order.pop()]
            if where is None:
                order.pop()
                del lines[key]
            else:
                lines[key] = where
        elif where is not None:
            order.append(key)
            lines[key] = where
        else:
            continue  # a frame we never saw open (it started before the record)
        times.append(ns)
        seqs.append(seq)
        stacks.append(tuple(lines[k] for k in order))
    return times, seqs, stacks


@dataclass(frozen=True)
class ClockFit:
    """``profiler ns = host ns + offset``, the offset drifting linearly with host time
    (``slope`` per host ns) from ``host_ns`` on; ``error_ns``: how far a mapped time may
    be off, from the marks' brackets."""

    offset: float
    host_ns: float = 0.0
    slope: float = 0.0
    error_ns: float = 0.0

    @classmethod
    def from_marks(cls, marks: Sequence[tuple[int, int, int]]) -> ClockFit:
        """Fit from marks ``(host ns before, host ns after, profiler ns)``: each mark's
        profiler time was taken between the two host readings, so each bounds the offset
        to an interval; the marks of the first half of the run and of the second half
        each narrow theirs to the intersection, and a line through the two gives the
        drift."""
        if not marks:
            raise ValueError("no marks to match the profiler's clock with")
        # A mark whose host readings are far apart (the thread was descheduled, or the
        # first record_function paid a lazy start-up) says little: leave it out.
        widths = sorted(after - before for before, after, _ in marks)
        limit = max(4 * widths[len(widths) // 2], _WIDE_MARK)
        ordered = sorted(m for m in marks if m[1] - m[0] <= limit)
        middle = ordered[0][0] + (ordered[-1][1] - ordered[0][0]) / 2
        late = [m for m in ordered if m[0] > middle]
        if middle - ordered[0][0] < _DRIFT_SPAN or not late:  # too close to see drift
            offset, host, error = _bounded_offset(ordered)
            return cls(offset=offset, host_ns=host, error_ns=error)
        o1, h1, e1 = _bounded_offset([m for m in ordered if m[0] <= middle])
        o2, h2, e2 = _bounded_offset(late)
        return cls(offset=o1, host_ns=h1, slope=(o2 - o1) / (h2 - h1), error_ns=max(e1, e2))

    def to_host(self, profiler_ns: float) -> float:
        """A time of the profiler's clock on ``perf_counter_ns``."""
        # profiler = h + offset + slope * (h - host_ns), solved for h.
        return (profiler_ns - self.offset + self.slope * self.host_ns) / (1.0 + self.slope)


def _bounded_offset(marks: Sequence[tuple[int, int, int]]) -> tuple[float, float, float]:
    """The offset the marks agree on, the host time it holds at, and its half-width."""
    low = max(at - after for _, after, at in marks)
    high = min(at - before for before, _, at in marks)
    if low > high:  # brackets that do not overlap (a descheduled mark): the tightest
        before, after, at = min(marks, key=lambda m: m[1] - m[0])
        low, high = at - after, at - before
    host = sum(before + after for before, after, _ in marks) / (2 * len(marks))
    return (low + high) / 2, host, (high - low) / 2
