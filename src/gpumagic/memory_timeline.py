"""``%%gpumem --timeline``: the allocator's event history → memory over the cell.

torch's allocator, while recording history (``_record_memory_history("all")``), keeps a
ring of events per device: ``alloc`` and ``free_requested`` (a tensor's memory given
and taken back, in the bytes the tensor asked for), ``segment_alloc`` and
``segment_free`` (cudaMalloc / cudaFree of the cache). :func:`build_timeline` replays
one device's events from the cell's starting figures into a series of allocated and
reserved bytes, finds the peak, and charges what was live at the peak to the lines that
allocated it (through :func:`gpumagic.stacks.group_by_line`, as ``--trace`` does).
:func:`sparkline` and :func:`timeline_lines` are the terminal's view; the SVG is in
:mod:`gpumagic.memory_svg`.

Pure: no torch, no IPython; the events are passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpumagic.stacks import Block, TraceLine, frames_from_snapshot, group_by_line
from gpumagic.units import format_bytes

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence

__all__ = [
    "BEFORE_CELL",
    "TIMELINE_MAX_ENTRIES",
    "Band",
    "Timeline",
    "bands",
    "build_timeline",
    "envelope",
    "peak_rows",
    "sparkline",
    "timeline_lines",
]

#: The allocator's event ring while ``--timeline`` records: two events per tensor
#: (``alloc``, ``free_requested``), so the last 50,000 allocations of a cell.
TIMELINE_MAX_ENTRIES = 100_000
#: Lines shown as their own band at the peak; the rest are folded into "other lines".
TOP_LINES = 5
BEFORE_CELL = "allocated before the cell"
OTHER_LINES = "other lines"
_BLOCKS = "▁▂▃▄▅▆▇█"
_RESERVED = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


@dataclass(frozen=True)
class Timeline:
    """One device's memory over a cell, one point per allocator event.

    ``allocated[i]`` and ``reserved[i]`` are the bytes after event ``i`` (point 0: the
    start of the cell). ``allocated`` counts what the tensors asked for (torch's
    *requested* bytes: the allocator rounds blocks up by a little, so its own peak
    counter can be a few KiB higher). ``at_peak``: what was live at the peak and
    allocated during the cell, by the line that allocated it, largest first;
    ``before_cell``: the rest of the peak, allocated before the cell started.
    ``complete`` is ``False`` when the event ring lost the cell's first events (it
    wrapped, or a recording of your own keeps too few): the series is then anchored
    at the end of the cell and its start is missing.
    """

    #: The device's index.
    device: int
    #: Bytes the live tensors asked for after each event (point 0: the cell's start).
    allocated: tuple[int, ...]
    #: Bytes torch's allocator held after each event.
    reserved: tuple[int, ...]
    #: When each event happened, in µs since the epoch (point 0: the cell's start).
    times_us: tuple[int, ...]
    #: The point of the peak in ``allocated``.
    peak_index: int
    #: What was live at the peak and allocated during the cell, by line, largest first.
    at_peak: tuple[TraceLine, ...]
    #: Bytes live at the peak that were allocated before the cell.
    before_cell: int
    #: ``False`` when the event ring lost the cell's first events: the series starts late.
    complete: bool = True

    @property
    def peak(self) -> int:
        """The highest allocated bytes during the cell."""
        return self.allocated[self.peak_index]

    @property
    def events(self) -> int:
        """Allocator events replayed (points after the first)."""
        return len(self.allocated) - 1

    def to_dict(self) -> dict[str, Any]:
        """Plain data: the series (one point per event, ``x``: the event index), the
        peak and the lines live at the peak."""
        return {
            "device": self.device,
            "events": self.events,
            "complete": self.complete,
            "allocated": list(self.allocated),
            "reserved": list(self.reserved),
            "time_us": list(self.times_us),
            "peak": self.peak,
            "peak_index": self.peak_index,
            "peak_time_us": self.times_us[self.peak_index],
            "before_cell": self.before_cell,
            "at_peak": [t.to_dict() for t in self.at_peak],
        }


@dataclass(frozen=True)
class _Live:
    size: int
    frames: Sequence[Mapping[str, Any]]


def build_timeline(
    events: Iterable[Mapping[str, Any]],
    *,
    device: int,
    start_allocated: int,
    start_reserved: int,
    end_allocated: int,
    start_us: int | None = None,
    cell_files: frozenset[str] = frozenset(),
    only_cell: bool = False,
    is_user: Callable[[str], bool] = lambda filename: True,
    where: Callable[[str, int], str] = lambda filename, line: f"{filename}:{line}",
    source: Callable[[str, int], str] = lambda filename, line: "",
) -> Timeline:
    """Replay one device's allocator events (``snapshot["device_traces"][device]``).

    ``start_allocated`` / ``end_allocated``: the allocator's *requested* bytes before
    and after the cell; ``start_reserved``: its reserved bytes before. ``start_us``
    (microseconds since the epoch, the events' clock): events before it are left out
    (a recording that was on before the cell). When the replay does not end at
    ``end_allocated`` the ring lost the cell's first events; the series is shifted to
    end there. The other arguments go to :func:`~gpumagic.stacks.group_by_line`.
    """
    kept = list(events)
    if start_us is not None:
        kept = [e for e in kept if e["time_us"] >= start_us]
    # One point per event, in a lean loop (a busy cell has 100,000s of events). Every
    # event of torch's ring has "action", "size" and "time_us"; all but "oom" an "addr".
    allocated = [start_allocated]
    reserved = [start_reserved]
    times = [start_us if start_us is not None else kept[0]["time_us"] if kept else 0]
    add_allocated, add_reserved, add_time = allocated.append, reserved.append, times.append
    now, cache, top = start_allocated, start_reserved, start_allocated
    peak_index = 0
    for index, event in enumerate(kept, 1):
        action = event["action"]
        if action == "alloc":
            now += event["size"]
            if now > top:
                top, peak_index = now, index
        elif action == "free_requested":
            now -= event["size"]
        elif action in _RESERVED:
            cache += _RESERVED[action] * event["size"]
        add_allocated(now)
        add_reserved(cache)
        add_time(event["time_us"])
    complete = now == end_allocated
    if not complete:
        shift = end_allocated - now
        allocated = [max(0, a + shift) for a in allocated]
        peak_index = max(range(len(allocated)), key=allocated.__getitem__)
    # Replay again up to the peak: what was live there, and what allocated it.
    live: dict[int, _Live] = {}
    for event in kept[:peak_index]:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = _Live(event["size"], event.get("frames") or ())
        elif action == "free_requested":
            live.pop(event["addr"], None)
    blocks = [
        Block(device, address, block.size, block.size, frames_from_snapshot(block.frames))
        for address, block in live.items()
    ]
    lines = group_by_line(
        blocks,
        cell_files=cell_files,
        only_cell=only_cell,
        is_user=is_user,
        where=where,
        source=source,
    )
    return Timeline(
        device=device,
        allocated=tuple(allocated),
        reserved=tuple(reserved),
        times_us=tuple(times),
        peak_index=peak_index,
        at_peak=lines,
        before_cell=max(0, allocated[peak_index] - sum(t.nbytes for t in lines)),
        complete=complete,
    )


@dataclass(frozen=True)
class Band:
    """One part of the memory live at the peak: a line, the other lines folded, or what
    was allocated before the cell."""

    #: The line (``file:line``), the folded lines, or what was allocated before the cell.
    label: str
    #: Its bytes at the peak.
    nbytes: int
    #: The line's details (function, source), for a line's band.
    line: TraceLine | None = None

    @property
    def title(self) -> str:
        """The hover text: the line with its source, and the size."""
        text = self.label
        if self.line is not None:
            if self.line.function and self.line.function != "<module>":
                text += f" ({self.line.function})"
            if self.line.source:
                text += f": {self.line.source}"
        return f"{text} · {format_bytes(self.nbytes)}"


def bands(timeline: Timeline, top: int = TOP_LINES) -> list[Band]:
    """The peak split into the ``top`` largest lines, the other lines folded into one
    band, and the memory allocated before the cell; empty parts are left out."""
    found = [Band(t.where, t.nbytes, t) for t in timeline.at_peak[:top] if t.nbytes]
    rest = timeline.at_peak[top:]
    if rest and sum(t.nbytes for t in rest):
        found.append(Band(f"{OTHER_LINES} ({len(rest)})", sum(t.nbytes for t in rest)))
    if timeline.before_cell:
        found.append(Band(BEFORE_CELL, timeline.before_cell))
    return found


def envelope(values: Sequence[int], width: int) -> list[int]:
    """``values`` in at most ``width`` buckets, each the largest value in it (a spike
    one event long still shows)."""
    if len(values) <= width:
        return list(values)
    return [
        max(values[i * len(values) // width : max((i + 1) * len(values) // width, i + 1)])
        for i in range(width)
    ]


def sparkline(values: Sequence[int], width: int = 48) -> str:
    """One line of Unicode blocks, from 0 to the largest value."""
    top = max(values, default=0)
    if top <= 0:
        return _BLOCKS[0] * min(width, max(1, len(values)))
    return "".join(
        _BLOCKS[min(len(_BLOCKS) - 1, max(0, -(-v * len(_BLOCKS) // top) - 1))]
        for v in envelope(values, width)
    )


def timeline_lines(timeline: Timeline, label: str) -> list[str]:
    """The terminal's view: the sparkline with the peak, then the table "at the peak:
    by line"."""
    start, end = timeline.allocated[0], timeline.allocated[-1]
    lines = [
        f"Timeline {label} ({timeline.events} allocator events): "
        f"{sparkline(timeline.allocated)}  "
        f"{format_bytes(start)} → peak {format_bytes(timeline.peak)} → {format_bytes(end)}",
        f"At the peak (event {timeline.peak_index} of {timeline.events}; reserved "
        f"{format_bytes(timeline.reserved[timeline.peak_index])}): by line",
    ]
    rows = peak_rows(timeline)
    if not rows:
        lines.append("  (nothing was allocated)")
        return lines
    lines.append(f"  {'size':>10}  {'blocks':>6}  line")
    lines.extend(f"  {size:>10}  {blocks:>6}  {text}" for size, blocks, text in rows)
    return lines


def peak_rows(timeline: Timeline, top: int = TOP_LINES) -> list[tuple[str, str, str]]:
    """``(size, blocks, where and source)`` of each band at the peak."""
    rows = []
    for band in bands(timeline, top):
        line = band.line
        if line is None:
            rows.append((format_bytes(band.nbytes), "", band.label))
            continue
        text = band.title.rsplit(" · ", 1)[0]
        if line.via:
            text += f"  [via {line.via}]"
        rows.append((format_bytes(band.nbytes), str(line.blocks), text))
    return rows
