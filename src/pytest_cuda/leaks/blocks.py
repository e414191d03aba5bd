"""Who holds leaked allocator blocks: the holder walk (:mod:`pytest_cuda.leaks.walk.holders`)
from the tensors that lie in them, and what the blocks themselves tell when no Python
object reaches them (a CUDA graph's pool, the library call that allocated them).

Pure Python over the blocks and objects it is given: no torch import, no CUDA call.
"""

from __future__ import annotations

import bisect
from dataclasses import replace
from typing import TYPE_CHECKING

from gpumagic.stacks import is_python_file
from pytest_cuda.leaks.walk.holders import (
    LIBRARY,
    NO_TENSOR,
    LeakHolder,
    LeakHolderScan,
    find_leak_holders,
    holder_order,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from gpumagic.stacks import Block
    from pytest_cuda.leaks.walk.graphs import Facts

__all__ = ["GRAPH_POOL", "UNSHOWN", "find_block_holders"]

#: The kind of the blocks that no live tensor lies in.
UNSHOWN = "C++ side: no Python tensor; a library workspace (cuBLAS, cuDNN, NCCL) or a C++ cache"


def find_block_holders(
    objects: Sequence[object],
    blocks: Sequence[Block],
    facts: Facts,
    is_user: Callable[[str], bool] = lambda filename: True,
    *,
    budget_s: float | None = None,
    frozen_before: int | None = None,
    thaw: Callable[[], None] | None = None,
    frames: bool = False,
) -> LeakHolderScan:
    """:func:`find_leak_holders` for the tensors whose storage lies in one of ``blocks``
    (``facts`` answers for every tensor); ``found`` counts the bytes of the blocks a
    holder accounts for.

    What no Python object reaches (a tensor only C++ holds, a block no tensor shows) is
    a library's by-design cache when its block lies in a CUDA graph's private memory
    pool, or was allocated inside a library call (its innermost recorded frame is not
    the user's, by ``is_user(filename)``): torch.compile's CUDA graphs, cuDNN's dropout
    state. The rest comes last, as held on the C++ side (:data:`UNSHOWN`).
    ``budget_s``, ``frozen_before``, ``thaw``, ``frames``: see :func:`find_leak_holders`.
    """
    # Per device, the blocks by address (the allocator's blocks never overlap): a
    # tensor's block is found by bisection, not by a pass over every block.
    spans: dict[str, list[Block]] = {}
    for block in sorted(blocks, key=lambda b: b.address):
        spans.setdefault(f"cuda:{block.device}", []).append(block)
    starts = {device: [b.address for b in found] for device, found in spans.items()}
    block_of: dict[tuple[str, int], Block] = {}

    def in_blocks(obj: object) -> tuple[tuple[str, int], int, str] | None:
        fact = facts(obj)
        if fact is None or fact[2] not in spans:
            return None
        address = fact[0][1]
        index = bisect.bisect_right(starts[fact[2]], address) - 1
        block = spans[fact[2]][index] if index >= 0 else None
        if block is None or address >= block.address + block.size:
            return None
        block_of[fact[0]] = block
        return fact

    def explain(key: tuple[str, int], searched: bool) -> tuple[str, str] | None:
        # A CUDA graph's pool says so itself; a library call allocated what its tensor,
        # unreached, keeps only if the walk looked everywhere (else: a holder it
        # missed, such as a module global keeping a Module's output).
        block = block_of.get(key)
        if block is None or not (searched or block.private_pool):
            return None
        return _kept_by_library(block, is_user)

    def covered() -> bool:
        shown = {(b.device, b.address) for b in block_of.values()}
        return all((b.device, b.address) in shown for b in blocks)

    scan = find_leak_holders(
        objects,
        in_blocks,
        explain,
        budget_s=budget_s,
        covered=covered,
        frozen_before=frozen_before,
        thaw=thaw,
        frames=frames,
    )
    shown = {(b.device, b.address) for b in block_of.values()}
    hidden: dict[tuple[str, str], list[Block]] = {}
    for block in blocks:
        if (block.device, block.address) not in shown:
            why = _kept_by_library(block, is_user) or ("", UNSHOWN)
            hidden.setdefault(why, []).append(block)
    extra = [
        LeakHolder(
            path or _unshown(*group),
            kind,
            sum(b.size for b in group),
            tuple(sorted({f"cuda:{b.device}" for b in group})),
            tensors=0,
            storages=tuple((f"cuda:{b.device}", b.address) for b in group),
        )
        for (path, kind), group in hidden.items()
    ]
    if extra:  # the holder lines say it
        scan = replace(scan, notes=tuple(n for n in scan.notes if n != NO_TENSOR))
    holders = sorted((*scan.holders, *extra), key=holder_order)
    found = sum(b.size for b in blocks) - sum(h.nbytes for h in extra if h.kind == UNSHOWN)
    return replace(scan, holders=tuple(holders), found=found, proven=_proven(scan, block_of))


def _proven(
    scan: LeakHolderScan, block_of: dict[tuple[str, int], Block]
) -> tuple[tuple[str, int], ...]:
    """Per device, the bytes of the blocks that holders proven alive keep, libraries'
    caches aside (what a collection could not free, nor pass for a library's)."""
    kept = {
        (block.device, block.address): block
        for holder in scan.holders
        if holder.alive and holder.kind != LIBRARY
        for block in (block_of.get(key) for key in holder.storages)
        if block is not None
    }
    per_device: dict[str, int] = {}
    for block in kept.values():
        device = f"cuda:{block.device}"
        per_device[device] = per_device.get(device, 0) + block.size
    return tuple(sorted(per_device.items()))


#: Where torch keeps the memory of CUDA graphs (``torch.compile(mode="reduce-overhead")``,
#: ``torch.cuda.graph``): alive as long as the graphs that use it.
GRAPH_POOL = (
    "a CUDA graph's private memory pool (torch.compile mode='reduce-overhead', torch.cuda.graph)"
)


def _kept_by_library(block: Block, is_user: Callable[[str], bool]) -> tuple[str, str] | None:
    if block.private_pool:
        return GRAPH_POOL, LIBRARY
    # The innermost Python frame: a recording with C++ frames (stacks="all", the
    # user's) puts torch's C++ frames first, which say nothing about whose call it was.
    frame = next((f for f in block.frames if is_python_file(f.filename)), None)
    if frame is not None and not is_user(frame.filename):
        where = frame.filename.rpartition("site-packages/")[2]
        return f"the C++ side of the library call at {where}:{frame.line} in {frame.name}", LIBRARY
    return None


def _unshown(*blocks: Block) -> str:
    return (
        f"{len(blocks)} block" + ("s" if len(blocks) != 1 else "") + " that no Python tensor shows"
    )
