"""Which leaked blocks a check's code allocated, the lines that did, and who holds them.

Read from the allocation stacks that :class:`~pytest_cuda.leaks.recording.StackRecording`
records whenever a leak check is on. :func:`attribute` reads one snapshot (or the one it
is given), groups the new blocks by allocating stack and walks the heap for their
holders (:func:`holders_of`), within a time budget where the caller gives one. Imported
only for a check that found a leak (its walk is most of this module's imports).
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

from gpumagic import cuda
from gpumagic.stacks import (
    Block,
    FrameFilter,
    StackGroup,
    blocks_allocated_since,
    group_by_stack,
)
from pytest_cuda.leaks.blocks import find_block_holders

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence

    from pytest_cuda.leaks.walk.holders import LeakHolderScan

__all__ = [
    "attribute",
    "bytes_allocated_since",
    "holders_of",
]


def attribute(
    start_us: int,
    devices: Iterable[int],
    outermost: tuple[str, str] | None = None,
    snapshot: Mapping[str, Any] | None = None,
    *,
    objects: Sequence[object] | None = None,
    budget_s: float | None = None,
    frozen_before: int | None = None,
    thaw: Callable[[], None] | None = None,
) -> tuple[tuple[StackGroup, ...], LeakHolderScan]:
    """The blocks alive on ``devices`` in ``snapshot`` (default: one taken now) that were
    allocated since ``start_us`` (see :func:`blocks_allocated_since`): their stacks,
    grouped (:func:`group_by_stack`), and who holds them (:func:`holders_of`, over
    ``objects`` and within ``budget_s``; ``frozen_before``, ``thaw``: see
    :func:`~pytest_cuda.leaks.walk.holders.find_leak_holders`)."""
    blocks = _new_blocks(start_us, devices, outermost, snapshot)
    is_user = FrameFilter.default().is_user
    stacks = group_by_stack(blocks, is_user, outermost=outermost)
    holders = holders_of(
        blocks,
        is_user,
        objects=objects,
        budget_s=budget_s,
        frozen_before=frozen_before,
        thaw=thaw,
    )
    return stacks, holders


def bytes_allocated_since(
    start_us: int,
    devices: Iterable[int],
    outermost: tuple[str, str] | None = None,
    snapshot: Mapping[str, Any] | None = None,
) -> dict[int, int]:
    """Bytes per device of the blocks alive on ``devices`` in ``snapshot`` (default: one
    taken now) that were allocated since ``start_us`` (see
    :func:`blocks_allocated_since`): no walk."""
    found: dict[int, int] = {}
    for block in _new_blocks(start_us, devices, outermost, snapshot):
        found[block.device] = found.get(block.device, 0) + block.size
    return found


def _new_blocks(
    start_us: int,
    devices: Iterable[int],
    outermost: tuple[str, str] | None,
    snapshot: Mapping[str, Any] | None,
) -> list[Block]:
    """The blocks alive on ``devices`` allocated since ``start_us``, from one snapshot."""
    wanted = set(devices)
    if snapshot is None:
        snapshot = cuda.memory_snapshot()
    found = blocks_allocated_since(snapshot, start_us, outermost)
    return [b for b in found if b.device in wanted]


def holders_of(
    blocks: Sequence[Block],
    is_user: Callable[[str], bool] = lambda filename: True,
    *,
    objects: Sequence[object] | None = None,
    budget_s: float | None = None,
    frozen_before: int | None = None,
    thaw: Callable[[], None] | None = None,
    frames: bool = False,
) -> LeakHolderScan:
    """Who holds the live tensors whose storage lies in ``blocks``: the tensors are
    looked for among ``objects`` (the checker's: the tensors among what the test made;
    default: the whole heap's, :func:`gpumagic.cuda.tensors_among`), the walk up goes
    through the whole heap (for tests already judged leaking only); see
    :func:`find_block_holders`. The walk never goes up through the list it is given: a
    copy of it, held by the caller, would be a holder of every tensor."""

    def facts(obj: object) -> tuple[tuple[str, int], int, str] | None:
        found = cuda.tensor_facts(obj)
        return None if found is None else (found.storage, found.nbytes, found.device)

    # A type check per class, then facts per tensor: reading every object of a large
    # heap (torch, a suite, compiled code) took about 0.5 s a leaking test.
    heap = cuda.tensors_among(gc.get_objects()) if objects is None else objects
    try:
        return find_block_holders(
            heap,
            blocks,
            facts,
            is_user,
            budget_s=budget_s,
            frozen_before=frozen_before,
            thaw=thaw,
            frames=frames,
        )
    finally:
        del heap
