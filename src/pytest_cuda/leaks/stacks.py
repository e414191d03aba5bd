"""Which leaked blocks a check's code allocated, the lines that did, and who holds them.

Allocation stacks come from torch's allocator, recorded in its cheapest useful setting
whenever a leak check is on (:class:`StackRecording`): the Python stack of each live
block and a ring of events without stacks (``enabled="all"``, ``context="state"``),
which says which live blocks are new since the check began. :func:`attribute` reads one
snapshot, groups the new blocks by allocating stack and walks the heap for their
holders (:func:`holders_of`), within a time budget where the caller gives one.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

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
    from collections.abc import Callable, Iterable, Sequence

    from pytest_cuda.leaks.walk.holders import LeakHolderScan

__all__ = [
    "HISTORY_MAX_ENTRIES",
    "StackRecording",
    "attribute",
    "bytes_allocated_since",
    "holders_of",
]

#: The bound on the allocator's event ring when recording is ours. It keeps allocations
#: alone, without their stacks (a few dozen bytes each): when each live block was
#: allocated. A check whose code allocates more often than this falls back to the
#: blocks' stacks (a block is new when its stack passes through the test function).
HISTORY_MAX_ENTRIES = 50_000


class StackRecording:
    """Allocation-stack recording for leak checks: switched on only where it was off,
    switched back off by :meth:`close`; the user's own recording is never touched.

    Switching it on never raises (it may run inside torch's lazy initialisation, the
    user's first CUDA call): a failure is kept in :attr:`error`, and :meth:`why_off`
    says it in the report of a check that found no stacks."""

    def __init__(self, *, event_stacks: bool = False) -> None:
        #: The ring's events keep their stacks too (``context="alloc"``): what a memory
        #: limit needs to name the lines of blocks freed before the test ended.
        self.event_stacks = event_stacks
        self.owned = False
        #: Why switching recording on failed (``"RuntimeError: ..."``), if it did.
        self.error: str | None = None
        #: Switched on, or queued for CUDA's initialisation, at least once.
        self.armed = False
        self._queued = False
        self._closed = False

    def arm(self) -> None:
        """Recording on now if CUDA is initialised, else queued (once) for the moment
        torch initialises it."""
        if cuda.is_initialized():
            self.ensure()
        elif not self._queued:
            self._queued = self.ensure_at_init()
            self.armed = self.armed or self._queued

    def ensure(self) -> None:
        """Recording on now, if CUDA is initialised (it creates no context)."""
        if not self._closed and cuda.is_initialized():
            self.armed = True
            self._switch_on()

    def ensure_at_init(self) -> bool:
        """Recording on now, or as soon as torch initialises CUDA; ``False`` when torch
        is not imported, so nothing could be queued."""
        return cuda.on_cuda_init(self._at_init)

    def _start(self) -> bool:
        return cuda.start_memory_history(
            HISTORY_MAX_ENTRIES,
            events=True,
            event_stacks=self.event_stacks,
            # A limit replays the frees; a leak check needs only the allocations.
            skip_actions=("free_completed",)
            if self.event_stacks
            else ("free_requested", "free_completed"),
        )

    def with_event_stacks(self) -> None:
        """From now on the ring's events keep their stacks and frees (a memory limit
        was found after recording began): a recording of ours is started again so."""
        if self.event_stacks:
            return
        self.event_stacks = True
        if self.owned and cuda.is_initialized():
            cuda.stop_memory_history()
            self.owned = False
            self._switch_on()

    def _switch_on(self) -> None:
        try:
            self.owned = self._start() or self.owned
        except Exception as exc:  # kept for the report: see why_off
            self.error = f"{type(exc).__name__}: {exc}"

    def _at_init(self) -> None:
        # Runs inside torch's lazy initialisation: an exception here would break the
        # user's first CUDA call.
        if not self._closed:
            self._switch_on()

    def why_off(self) -> str:
        """Why a check found recording off at its end, for its report."""
        if self.error is not None:
            return (
                f"Stacks not recorded: switching on allocation-stack recording failed: {self.error}"
            )
        if not self.armed:
            return (
                "Stacks not recorded: CUDA was first used before torch was imported, too "
                "late to switch recording on; import torch before the check begins."
            )
        return (
            "Stacks not recorded: allocation-stack recording was off at the end of the "
            "check (switched off by the code under check?)."
        )

    def close(self) -> None:
        self._closed = True
        if self.owned and cuda.is_initialized():
            cuda.stop_memory_history()
        self.owned = False


def attribute(
    start_us: int,
    devices: Iterable[int],
    outermost: tuple[str, str] | None = None,
    *,
    objects: Sequence[object] | None = None,
    budget_s: float | None = None,
    frozen_before: int | None = None,
    thaw: Callable[[], None] | None = None,
) -> tuple[tuple[StackGroup, ...], LeakHolderScan]:
    """The blocks alive now on ``devices`` that were allocated since ``start_us`` (see
    :func:`blocks_allocated_since`): their stacks, grouped (:func:`group_by_stack`), and
    who holds them (:func:`holders_of`, over ``objects`` and within ``budget_s``;
    ``frozen_before``, ``thaw``: see :func:`~pytest_cuda.leaks.walk.holders.find_leak_holders`)."""
    blocks = _new_blocks(start_us, devices, outermost)
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
    start_us: int, devices: Iterable[int], outermost: tuple[str, str] | None = None
) -> dict[int, int]:
    """Bytes per device of the blocks alive now on ``devices`` that were allocated since
    ``start_us`` (see :func:`blocks_allocated_since`): one snapshot, no walk."""
    found: dict[int, int] = {}
    for block in _new_blocks(start_us, devices, outermost):
        found[block.device] = found.get(block.device, 0) + block.size
    return found


def _new_blocks(
    start_us: int, devices: Iterable[int], outermost: tuple[str, str] | None
) -> list[Block]:
    """The blocks alive now on ``devices`` allocated since ``start_us``, from one snapshot."""
    wanted = set(devices)
    found = blocks_allocated_since(cuda.memory_snapshot(), start_us, outermost)
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
