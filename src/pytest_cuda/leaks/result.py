"""The verdict of one leak check, and the words of its report.

:class:`LeakResult` is what :class:`~pytest_cuda.leaks.engine.LeakCheck` finds: what
grew, what settling released, the allocating stacks and the holders of what is left.
It renders itself: :meth:`LeakResult.summary` (the one line a failure or a ``LEAKED``
line shows) and :meth:`LeakResult.details` (the report section). Pure: no pytest, no
CUDA call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from gpumagic.units import format_bytes, parse_size

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gpumagic.stacks import StackGroup
    from pytest_cuda.leaks.walk.holders import LeakHolderScan

__all__ = [
    "MAX_STACKS",
    "MODES",
    "CudaLeakError",
    "CudaLeakWarning",
    "LeakResult",
    "Mode",
    "Release",
    "Rerun",
    "parse_leak_settings",
    "stack_lines",
    "top_frame",
]

Mode = Literal["fail", "warn", "off"]
#: ``fail``: a leak fails; ``warn``: it is reported without failing; ``off``: no check.
MODES: tuple[Mode, ...] = ("fail", "warn", "off")

#: At most this many stacks in a report (frames per stack: :data:`gpumagic.stacks.MAX_FRAMES`).
MAX_STACKS = 8


def top_frame(stacks: Sequence[StackGroup] | None, root: str | None = None) -> str | None:
    """The innermost user line of the largest of ``stacks`` that has frames."""
    for group in stacks or ():
        if group.frames:
            return group.frames[0].describe(root)
    return None


def stack_lines(stacks: Sequence[StackGroup], root: str | None = None) -> list[str]:
    """Each of the largest :data:`MAX_STACKS` stacks with its frames, then what the rest
    hold: the lines under a report's "by allocating stack" heading."""
    lines = []
    for group in stacks[:MAX_STACKS]:
        lines.append(f"  {group.describe()}")
        if group.frames:
            lines.extend(f"    {frame.describe(root)}" for frame in group.frames)
        else:
            lines.append("    (no stack: allocated while recording was off)")
    rest = stacks[MAX_STACKS:]
    if rest:
        size = sum(g.size for g in rest)
        lines.append(f"  ... and {len(rest)} more stacks holding {format_bytes(size)}")
    return lines


class CudaLeakError(AssertionError):
    """Code left CUDA memory allocated; the message says how much, on which device, and
    (with stack recording) which lines allocated it."""

    __module__ = "pytest_cuda"  # its public name, as tracebacks show it


class CudaLeakWarning(UserWarning):
    """A leak found by a check in ``mode="warn"``; the message is the full report."""

    __module__ = "pytest_cuda"


def parse_leak_settings(
    tolerance: object = 0, mode: object = "fail", *, where: str = "cuda_leak_check"
) -> tuple[int, Mode]:
    """``(tolerance in bytes, mode)`` from a marker's or a call's arguments.

    ``tolerance`` is bytes per device (an int, or a size such as ``"4KiB"``); ``mode``
    is one of :data:`MODES`. Raises :class:`ValueError` naming ``where`` otherwise.
    """
    try:
        if isinstance(tolerance, bool) or not isinstance(tolerance, int | float | str):
            raise ValueError(f"not a memory size: {tolerance!r}")
        size = parse_size(tolerance)
    except ValueError as exc:
        raise ValueError(
            f"{where}: tolerance must be a size in bytes >= 0 (an int or a string such "
            f'as "4KiB"), got {tolerance!r} ({exc})'
        ) from None
    if mode not in MODES:
        raise ValueError(
            f"{where}: mode must be one of {', '.join(repr(m) for m in MODES)}, got {mode!r}"
        )
    return size, mode


@dataclass(frozen=True)
class Release:
    """What one settle step gave back, in bytes per device."""

    step: str
    freed: dict[int, int]


@dataclass(frozen=True)
class Rerun:
    """What a leaking test showed when re-run alone in a fresh process
    (``--cuda-leak-reruns``): its allocating line and holder, the report, or why there
    is none (it leaks only after the tests before it)."""

    top: str | None = None
    holder: str | None = None
    details: str = ""
    note: str = ""
    library: str | None = None  # alone, only a library cache held it: which

    def lines(self) -> list[str]:
        if self.note:
            return [f"Re-run alone in a fresh process: {self.note}"]
        lines = ["Re-run alone in a fresh process:"]
        return lines + [f"  {line}" for line in self.details.splitlines()]


@dataclass(frozen=True)
class LeakResult:
    """The verdict of one check.

    ``leaked``: bytes per device over the baseline for the devices over the tolerance
    (empty: no leak). ``growth``: the final figure for every device read. ``released``:
    the settle steps that ran and what each gave back. ``stacks``: the blocks still
    alive grouped by allocating stack, ``None`` when stacks were not recorded, with
    ``stack_note`` saying why or how to get them.
    """

    leaked: dict[int, int]
    growth: dict[int, int]
    tolerance: int
    released: tuple[Release, ...] = ()
    stacks: tuple[StackGroup, ...] | None = None
    stack_note: str = ""
    holders: LeakHolderScan | None = None
    rerun: Rerun | None = None

    @property
    def clean(self) -> bool:
        return not self.leaked

    def kept_by_libraries(self) -> list[tuple[str, dict[int, int]]]:
        """The settle steps that gave memory back, with what they freed (non-zero only)."""
        return [(r.step, r.freed) for r in self.released if any(v > 0 for v in r.freed.values())]

    def amounts(self) -> str:
        """``"8.0 MiB on cuda:0, 512 B on cuda:1"``."""
        return ", ".join(f"{format_bytes(b)} on cuda:{d}" for d, b in sorted(self.leaked.items()))

    def top_frame(self, root: str | None = None) -> str | None:
        """The innermost user line of the largest stack, when stacks were recorded."""
        return top_frame(self.stacks, root)

    def summary(self, subject: str, root: str | None = None) -> str:
        """One line: who leaked how much where, and the top allocating line if known."""
        text = (
            f"CUDA memory leak: {subject} left {self.amounts()} allocated "
            f"(tolerance {format_bytes(self.tolerance)})"
        )
        top, holder = self.top_frame(root), self.holder()
        if top is None and holder is None and self.rerun is not None:
            top, holder = self.rerun.top, self.rerun.holder
            if top or holder:
                text += " (re-run alone)"
        text = f"{text}, allocated at {top}" if top else text
        return f"{text}, held by {holder}" if holder else text

    def holder(self) -> str | None:
        """The largest holder that Python objects reach, when the walk ran, or why
        there is none: what holds the blocks on the C++ side, or that the walk ran out
        of time. ``None`` when no walk ran."""
        scan = self.holders
        if scan is None:
            return None
        found = scan.first()
        # A holder the walk reached; a block's allocating library call is only a guess
        # when the walk stopped before reading everything.
        if found is not None and (scan.complete or scan.holders[0].tensors):
            return found
        if not scan.complete:
            return (
                "an unknown holder (the search stopped at its time limit; "
                "--cuda-leak-trace searches to the end)"
            )
        if scan.hidden:
            return (
                f"an unknown holder ({scan.hidden} objects frozen by gc.freeze() are "
                "invisible to the search)"
            )
        if scan.holders:
            top = scan.holders[0]
            if top.path.startswith("no Python object"):
                return f"{top.path} ({top.kind})"
            return f"no Python object: {top.path} ({top.kind})"
        return (
            "no Python object ("
            + ("; ".join(scan.notes) or "no live tensor shows the blocks")
            + ")"
        )

    def details(self, subject: str, root: str | None = None) -> str:
        """The report section: amounts, how they were measured, the allocating stacks."""
        lines = []
        for device, amount in sorted(self.leaked.items()):
            lines.append(
                f"{subject} left {format_bytes(amount)} ({amount:,} B) allocated on "
                f"cuda:{device}; tolerance {format_bytes(self.tolerance)}."
            )
        steps = ", ".join(r.step for r in self.released) or "no settling needed"
        lines.append(f"Measured in this process's caching allocator after: {steps}.")
        if self.stacks is None:
            if self.stack_note:
                lines.append(self.stack_note)
            if self.rerun is not None:
                lines += self.rerun.lines()
            return "\n".join(lines)
        if not self.stacks:
            lines.append(
                "No block allocated during the check is still alive: the growth is in "
                "blocks allocated earlier or by allocations recorded without a stack."
            )
            return "\n".join(lines)
        lines.append("Blocks still alive, by allocating stack (largest first):")
        lines += stack_lines(self.stacks, root)
        if self.stack_note:
            lines.append(self.stack_note)
        lines += self._holder_lines()
        if self.rerun is not None:
            lines += self.rerun.lines()
        return "\n".join(lines)

    def _holder_lines(self) -> list[str]:
        if self.holders is None:
            return []
        lines = ["Who holds them (the reference path from a root, largest first):"]
        lines += [f"  {holder.describe()}" for holder in self.holders.holders[:MAX_STACKS]]
        if not self.holders.holders:
            lines.append("  no live tensor shows these blocks")
        lines += [f"  ({note})" for note in self.holders.notes]
        return lines
