"""A test's CUDA memory limit: the marker's size, the blocks alive at the peak, and the
words of the failure.

The peak itself is the allocator's own counter (reset when the test starts, as
``--cuda-memory-report``'s peaks are). What was alive at that moment comes from the
allocator's ring of events (:func:`blocks_at_peak`): the live blocks of the snapshot
taken at the end, walked back to the test's start and replayed forward to the highest
point; each block keeps the stack it was allocated with (the event's, else the live
block's), grouped by :func:`gpumagic.stacks.group_by_stack` as a leak's are.
:class:`OverLimit` renders itself. Pure: no pytest, no CUDA call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpumagic.stacks import Block, StackGroup, blocks_from_segments, frames_from_snapshot
from gpumagic.units import format_bytes, parse_size
from pytest_cuda.leaks.report import LIMIT_MARKER
from pytest_cuda.leaks.result import stack_lines, top_frame

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = ["MARKER", "OverLimit", "PeakBlocks", "blocks_at_peak", "parse_limit"]

#: The marker that sets one test's limit.
MARKER = LIMIT_MARKER

#: The allocator's events that change what is allocated.
_ALLOC, _FREE = "alloc", "free_requested"


def parse_limit(args: Sequence[object], kwargs: Mapping[str, object]) -> int:
    """The bytes of ``cuda_limit_memory(size)`` (``size``: an int or a string such as
    ``"512MiB"``, as the ``cuda`` marker's ``min_memory`` takes it); :class:`ValueError`
    says what is wrong."""
    unknown = [k for k in kwargs if k != "size"]
    if unknown or len(args) + len(kwargs) != 1:
        given = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
        raise ValueError(
            f"takes one size (cuda_limit_memory('512MiB') or size=...), got "
            f"{', '.join(given) or 'none'}"
        )
    size = args[0] if args else kwargs["size"]
    try:
        if isinstance(size, bool) or not isinstance(size, int | float | str):
            raise ValueError(f"not a memory size: {size!r}")
        limit = parse_size(size)
    except ValueError as exc:
        raise ValueError(f"size: {exc}") from None
    if limit < 1:
        raise ValueError(f"size must be above 0 bytes, got {size!r}")
    return limit


@dataclass(frozen=True)
class PeakBlocks:
    """The blocks alive at the highest point of a device's events since a moment.

    ``blocks``: those allocated since then (with their stacks); ``before``: the bytes of
    those allocated earlier and still alive there. ``complete``: the ring reached back
    to the moment (else the highest point of the part it kept). ``at_start``: the bytes
    alive at the moment (blocks' sizes, as the allocator counts them; meaningful when
    ``complete``); ``allocated``: an allocation since the moment.
    """

    blocks: tuple[Block, ...]
    before: int
    complete: bool
    at_start: int = 0
    allocated: bool = False


@dataclass(frozen=True)
class _Live:
    size: int
    frames: tuple[Any, ...]
    new: bool


def blocks_at_peak(
    snapshot: Mapping[str, Any], device: int, start_us: int, ring_size: int | None = None
) -> PeakBlocks:
    """What was alive on ``device`` at the highest point since ``start_us`` (epoch
    microseconds, the clock of the snapshot's events), from one
    ``torch.cuda.memory._snapshot()`` taken after it. ``ring_size``: how many events the
    ring keeps (a ring holding fewer never lost one)."""
    traces = snapshot.get("device_traces") or ()
    events: list[Mapping[str, Any]] = list(traces[device]) if device < len(traces) else []
    complete = bool(events) and (
        int(events[0].get("time_us", 0)) < start_us
        or (ring_size is not None and len(events) < ring_size)
    )
    window = [e for e in events if int(e.get("time_us", 0)) >= start_us]
    end = {b.address: b for b in blocks_from_segments(snapshot.get("segments") or (), {device})}
    # Back from the end to the start: what was alive then.
    live: dict[int, _Live] = {a: _Live(b.requested, b.frames, False) for a, b in end.items()}
    sizes = {a: b.size for a, b in end.items()}  # the allocator's own count of them
    last_alloc: dict[int, int] = {}
    for index in range(len(window) - 1, -1, -1):
        event = window[index]
        address, action = int(event.get("addr", -1)), event.get("action")
        if action == _ALLOC:
            live.pop(address, None)
            sizes.pop(address, None)
            last_alloc.setdefault(address, index)
        elif action == _FREE:
            live[address] = _Live(int(event.get("size", 0)), (), False)
            sizes[address] = int(event.get("size", 0))
    # Forward to the highest point.
    now = top = sum(b.size for b in live.values())
    peak_index = 0
    for index, event in enumerate(window, 1):
        action = event.get("action")
        if action == _ALLOC:
            now += int(event.get("size", 0))
            if now > top:
                top, peak_index = now, index
        elif action == _FREE:
            now -= int(event.get("size", 0))
    for index, event in enumerate(window[:peak_index]):
        address, action = int(event.get("addr", -1)), event.get("action")
        if action == _ALLOC:
            frames = tuple(frames_from_snapshot(event.get("frames") or ()))
            kept = end.get(address)
            if not frames and kept is not None and last_alloc.get(address) == index:
                frames = kept.frames  # still alive: its block has the stack
            live[address] = _Live(int(event.get("size", 0)), frames, True)
        elif action == _FREE:
            live.pop(address, None)
    blocks = tuple(
        Block(device, address, block.size, block.size, block.frames)
        for address, block in live.items()
        if block.new
    )
    before = sum(block.size for block in live.values() if not block.new)
    return PeakBlocks(blocks, before, complete, sum(sizes.values()), bool(last_alloc))


@dataclass(frozen=True)
class OverLimit:
    """One device's peak over a test's limit, with what was alive at the peak.

    ``source``: where the limit came from (the marker, the option, the ini value);
    ``start``: bytes allocated when the test started (``None``: not known); ``stacks``:
    the blocks allocated by the test and alive at the peak, by allocating stack, largest
    first (``None``: no event ring to replay, ``note`` says why); ``before``: bytes
    alive at the peak that were allocated before the test."""

    device: int
    peak: int
    limit: int
    source: str
    start: int | None = 0
    stacks: tuple[StackGroup, ...] | None = None
    before: int = 0
    note: str = ""

    def top_frame(self, root: str | None = None) -> str | None:
        """The innermost user line of the largest stack alive at the peak."""
        return top_frame(self.stacks, root)

    def summary(self, subject: str, root: str | None = None) -> str:
        """One line: the peak, the device, the limit, and the top allocating line."""
        text = (
            f"CUDA memory limit: {subject} peaked at {format_bytes(self.peak)} on "
            f"cuda:{self.device}, over its limit of {format_bytes(self.limit)} ({self.source})"
        )
        top = self.top_frame(root)
        return f"{text}, allocated at {top}" if top else text

    def details(self, root: str | None = None) -> str:
        """The peak in bytes and the blocks alive at it, largest first."""
        started = (
            "what was allocated when the test started is not known"
            if self.start is None
            else f"{format_bytes(self.start)} was allocated when the test started"
        )
        lines = [
            f"Peak {format_bytes(self.peak)} ({self.peak:,} B) on cuda:{self.device}; {started}."
        ]
        if self.stacks is not None:
            lines.append("Blocks alive at the peak, by allocating stack (largest first):")
            lines += stack_lines(self.stacks, root)
            if self.before:
                lines.append(f"  {format_bytes(self.before)} allocated before the test")
            if not self.stacks and not self.before:
                lines.append("  (no allocation event before the peak was kept)")
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)
