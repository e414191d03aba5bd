"""A test that ran out of CUDA memory, explained: what was alive at that moment.

:func:`explain` runs when a test raised ``torch.OutOfMemoryError`` (or a CUDA
allocation error, :func:`gpumagic.cuda_errors.out_of_memory`), while the failure's
frames still hold what the test allocated: every device's allocated and reserved
memory (reserved but free: what torch's allocator cached, or could not use because it
lies in pieces), what other processes held (NVML), and the largest live blocks by
allocating stack with who holds them (the leak engine's holder walk, the failed test's
variables included). :class:`OomReport` renders itself; :func:`drop_frames` clears the
failure's frames once the report is made, so the next test starts with the memory
back. Touches CUDA only through :mod:`gpumagic.cuda`; never imports pytest.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpumagic import cuda
from gpumagic.stacks import FrameFilter, StackGroup, blocks_from_segments, group_by_stack
from gpumagic.units import format_bytes
from pytest_cuda.leaks.remains import clear_frames
from pytest_cuda.leaks.result import MAX_STACKS
from pytest_cuda.leaks.stacks import holders_of

if TYPE_CHECKING:
    from pytest_cuda.leaks.walk.holders import LeakHolderScan

__all__ = ["SECTION", "OomReport", "drop_frames", "explain", "first_line"]

#: The report section's title.
SECTION = "CUDA out of memory"


@dataclass(frozen=True)
class DeviceState:
    """One device when the allocation failed: torch's counters and NVML's figures
    (``None``: not known here)."""

    index: int
    allocated: int
    reserved: int
    total: int | None = None
    free: int | None = None
    #: ``(pid, bytes)`` of the other processes NVML lists on it (bytes ``None``: MIG).
    others: tuple[tuple[int, int | None], ...] = ()
    nvml_note: str = ""

    def lines(self) -> list[str]:
        cached = max(0, self.reserved - self.allocated)
        lines = [
            f"cuda:{self.index}: {format_bytes(self.allocated)} allocated by tensors, "
            f"{format_bytes(self.reserved)} reserved by torch's caching allocator, "
            f"{format_bytes(cached)} of it reserved but free (cached blocks, or pieces too "
            "small for the allocation: fragmentation)"
        ]
        if self.nvml_note:
            lines.append(f"cuda:{self.index}: {self.nvml_note}")
            return lines
        held = sum(used or 0 for _, used in self.others)
        if self.others:
            each = ", ".join(
                f"pid {pid}: {'?' if used is None else format_bytes(used)}"
                for pid, used in self.others
            )
            lines.append(f"cuda:{self.index}: other processes hold {format_bytes(held)} ({each})")
        else:
            lines.append(f"cuda:{self.index}: no other process holds memory on it")
        if self.free is not None and self.total is not None:
            lines.append(
                f"cuda:{self.index}: {format_bytes(self.free)} free of {format_bytes(self.total)}"
            )
        return lines


@dataclass(frozen=True)
class OomReport:
    """What was alive when a test ran out of CUDA memory; renders itself."""

    message: str
    devices: tuple[DeviceState, ...]
    stacks: tuple[StackGroup, ...] | None
    holders: LeakHolderScan | None
    note: str = ""

    def reason(self, subject: str) -> str:
        """One line: torch's first line, for a skip's reason."""
        return f"{subject} ran out of CUDA memory: {self.message}"

    def text(self, subject: str, root: str | None = None) -> str:
        """The report section."""
        lines = [self.reason(subject)]
        for device in self.devices:
            lines += device.lines()
        if self.stacks is not None:
            lines.append("Largest blocks alive, by allocating stack (largest first):")
            for group in self.stacks[:MAX_STACKS]:
                lines.append(f"  {group.describe()}")
                if group.frames:
                    lines.extend(f"    {frame.describe(root)}" for frame in group.frames)
                else:
                    lines.append("    (no stack: allocated while recording was off)")
            rest = self.stacks[MAX_STACKS:]
            if rest:
                size = sum(g.size for g in rest)
                lines.append(f"  ... and {len(rest)} more stacks holding {format_bytes(size)}")
        if self.holders is not None:
            lines.append("Who holds them (largest first):")
            lines += [f"  {h.describe()}" for h in self.holders.holders[:MAX_STACKS]]
            if not self.holders.holders:
                lines.append("  no live tensor shows these blocks")
            lines += [f"  ({note})" for note in self.holders.notes]
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)


def explain(
    exc: BaseException,
    *,
    outermost: tuple[str, str] | None = None,
    search_s: float | None = None,
) -> tuple[OomReport, dict[str, Any] | None]:
    """What was alive when ``exc`` (an out-of-memory error) was raised, and the
    allocator's snapshot it was read from (``None`` without CUDA).
    ``outermost``: the test function's ``(file, name)``, where stacks are cut;
    ``search_s``: the holder walk's time limit."""
    message = first_line(exc)
    if not cuda.is_initialized():
        return OomReport(message, (), None, None, "CUDA was not initialised here."), None
    devices = tuple(_device_state(d, s) for d, s in sorted(_stats().items()))
    snapshot = cuda.memory_snapshot()
    blocks = blocks_from_segments(snapshot.get("segments") or ())
    is_user = FrameFilter.default().is_user
    stacks = group_by_stack(blocks, is_user, outermost=outermost)
    note = ""
    if not cuda.memory_history_enabled():
        note = (
            "Allocating lines not recorded: --cuda-leak-check, --cuda-limit-memory or a "
            "cuda_limit_memory marker records them."
        )
    holders = holders_of(blocks, is_user, budget_s=search_s, frames=True)
    return OomReport(message, devices, stacks, holders, note), snapshot


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (torch's: "CUDA out of memory. Tried to
    allocate 20.00 GiB. GPU 0 has a total capacity of ..."), else its class's name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _stats() -> dict[int, cuda.AllocatorStats]:
    return {d: cuda.allocator_stats(d) for d in range(cuda.visible_device_total())}


def _device_state(index: int, stats: cuda.AllocatorStats) -> DeviceState:
    known = {d.index: d for d in cuda.devices()}
    info = known.get(index)
    if info is None:
        return DeviceState(index, stats.allocated, stats.reserved, nvml_note="not known to NVML")
    try:
        memory = cuda.nvml_memory_info(info)
        listed = cuda.nvml_processes(info)
    except cuda.CudaUnavailable as exc:
        return DeviceState(index, stats.allocated, stats.reserved, nvml_note=str(exc))
    others = tuple((pid, used) for pid, used in listed if pid != os.getpid())
    return DeviceState(
        index, stats.allocated, stats.reserved, memory.total, memory.free, others=others
    )


def drop_frames(exc: BaseException) -> None:
    """Clear the frames of ``exc``'s traceback (its causes' and contexts' too), collect
    what they held, and give the cached blocks back to the driver: the next test starts
    with the memory back (pytest keeps a failure until the next test's call)."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        found = pending.pop()
        if found is None or id(found) in seen:
            continue
        seen.add(id(found))
        clear_frames(found.__traceback__)
        pending += [found.__cause__, found.__context__]
    gc.collect()
    cuda.empty_cache()
