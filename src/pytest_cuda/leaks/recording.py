"""Allocation-stack recording for leak checks and memory limits, in torch's cheapest
useful setting (:class:`StackRecording`): the Python stack of each live block and a
ring of events without stacks (``enabled="all"``, ``context="state"``), which says which
live blocks are new since a check began. What a leak's report reads of it is in
:mod:`pytest_cuda.leaks.stacks`, imported only for a leak.
"""

from __future__ import annotations

from gpumagic import cuda

__all__ = ["HISTORY_MAX_ENTRIES", "StackRecording"]

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
