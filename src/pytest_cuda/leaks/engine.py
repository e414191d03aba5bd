"""The one leak check: :class:`LeakCheck`, with :meth:`~LeakCheck.begin` and
:meth:`~LeakCheck.finish`.

Used the same way by the pytest checker (one check per test,
:mod:`pytest_cuda.leaks.checker`), by ``no_cuda_leak`` (a block of code,
:mod:`pytest_cuda.leaks.block`) and inside every rank process of a ``cuda_distributed``
test (:mod:`pytest_cuda.distributed.rank_main`). It never imports pytest and touches
CUDA only through :mod:`gpumagic.cuda`.

* **begin**: allocation-stack recording on (or queued for CUDA's initialisation), the
  first reading (settled first where asked: a block's or a rank's check releases what
  libraries held from before, so that it cannot be released during the check and hide
  a leak), and the heap's boundary (:class:`~pytest_cuda.leaks.heap.TestHeap` freezes
  the older heap, so a collection at the end walks only what the code made).
* **finish**: a reading that did not grow is clean (a few µs). Otherwise what the
  caller can drop is dropped (a test's frames and fixture values), then
  :func:`~pytest_cuda.leaks.settle.settle` decides; what is still there is attributed
  from the run itself: the live blocks allocated since begin, the lines that allocated
  them, and the holders of their tensors (the walk goes up among the code's own objects
  first, and stops after ``search_s`` seconds where a limit is given). When the walk
  proves every holder alive the leak is certain; otherwise one collection of the whole
  heap decides, so garbage that older objects take part in is never called a leak.
  Memory only the failed code's traceback holds, and growth only libraries' caches
  hold, is kept, not leaked.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from gpumagic import cuda
from pytest_cuda.leaks.heap import TestHeap
from pytest_cuda.leaks.recording import StackRecording
from pytest_cuda.leaks.result import LeakResult, Mode
from pytest_cuda.leaks.settle import (
    FULL_COLLECTION,
    CudaMemory,
    MemorySource,
    Readings,
    SettleStep,
    Steps,
    growth,
    kept_by_library,
    settle,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    #: Takes the allocator's snapshot once, however often it is asked for.
    Snapshot = Callable[[], dict[str, Any]]

__all__ = ["TRACEBACK_STEP", "WHOLE_HEAP", "LeakCheck", "LeakSettings"]

#: The settle step that collects the whole heap, older objects included.
WHOLE_HEAP = "garbage collection (the whole heap)"
#: The release step of growth that only the failed code's traceback held.
TRACEBACK_STEP = "held only by the failed test's traceback"


@dataclass(frozen=True)
class LeakSettings:
    """How one test is checked: planned by the pytest process, sent as is to its ranks.

    ``search_s``: the holder search's time limit (``None``: none); ``root``: the folder
    lines are shown relative to."""

    tolerance: int
    mode: Mode = "fail"
    search_s: float | None = None
    reset_caches: bool = False
    root: str | None = None


@dataclass
class LeakCheck:
    """One check of one stretch of code: :meth:`begin` before it, :meth:`finish` after
    (or :meth:`close`, when it is not judged). ``recording``: allocation stacks (``None``:
    no stacks; the report then says ``untraced_note``); ``own_recording``: the check
    switches it off when done. ``settle_start``: the first reading is settled first.
    ``outermost``: the ``(file, function)`` of the checked code's own frame, where its
    stacks are cut."""

    tolerance: int
    source: MemorySource = field(default_factory=CudaMemory)
    recording: StackRecording | None = None
    search_s: float | None = None
    settle_start: bool = False
    outermost: tuple[str, str] | None = None
    untraced_note: str = ""
    own_recording: bool = False
    #: The first reading, per device.
    before: dict[int, int] = field(default_factory=dict, init=False)
    heap: TestHeap = field(default_factory=TestHeap, init=False, repr=False)
    _start_us: int = field(default=0, init=False, repr=False)

    @classmethod
    def alone(
        cls,
        settings: LeakSettings,
        *,
        trace: bool = True,
        outermost: tuple[str, str] | None = None,
        untraced_note: str = "",
    ) -> LeakCheck:
        """A check of its own (a block, a rank's test): its start settled, its own
        stack recording (with ``trace``), switched off when it is done."""
        return cls(
            settings.tolerance,
            CudaMemory(reset_caches=settings.reset_caches),
            StackRecording() if trace else None,
            search_s=settings.search_s,
            settle_start=True,
            outermost=outermost,
            untraced_note=untraced_note,
            own_recording=True,
        )

    def begin(self) -> None:
        """Recording on, the first reading, the heap's boundary."""
        if self.recording is not None:
            self.recording.arm()
        self.before = self._settled_start() if self.settle_start else self.source.read()
        self.heap.begin()
        self._start_us = time.time_ns() // 1000

    def _settled_start(self) -> dict[int, int]:
        reading = self.source.read()
        if reading:
            devices = tuple(sorted(reading))
            for step in self.source.settle_steps():
                if step.at_start:
                    step.run(devices)
            reading = self.source.read()
        return reading

    def within(self, reading: Readings, held: Readings | None = None) -> bool:
        """No device grew past the tolerance between the first reading and ``reading``."""
        return all(g <= self.tolerance for g in growth(self.before, reading, held).values())

    def finish(
        self,
        *,
        held: Readings | None = None,
        release: Callable[[], None] | None = None,
        drop_failure: Callable[[], bool] | None = None,
    ) -> LeakResult:
        """The verdict. ``held``: memory that is not the code's own (see
        :func:`~pytest_cuda.leaks.settle.growth`). ``release``: drops what the caller
        still holds of the code (called only when memory grew). ``drop_failure``: drops
        the runner's references to the failed code's traceback, ``True`` when there
        were any; memory freed by it alone is kept (:data:`TRACEBACK_STEP`), not leaked."""
        try:
            return self._judge(held, release, drop_failure)
        finally:
            self.close()

    def close(self) -> None:
        """The heap thawed, and the check's own recording switched off (always safe)."""
        self.heap.thaw()
        if self.own_recording and self.recording is not None:
            self.recording.close()

    def _judge(
        self,
        held: Readings | None,
        release: Callable[[], None] | None,
        drop_failure: Callable[[], bool] | None,
    ) -> LeakResult:
        end = self.source.read()
        if self.within(end, held):
            return LeakResult({}, growth(self.before, end, held), self.tolerance)
        if release is not None:
            # Usually a test's fixture values: freed at once by refcount, and the code
            # is as clean as code that never grew.
            release()
            end = self.source.read()
            if self.within(end, held):
                return LeakResult({}, growth(self.before, end, held), self.tolerance)
        # The collection walks only what the code made where the older heap is frozen;
        # else (the collector is off, or the user froze objects first) it would walk
        # the whole heap, so it waits until the walk has not proven the leak alive.
        frozen = self.heap.frozen
        source = self.source if frozen else Steps.without(self.source, FULL_COLLECTION)
        result = settle(self.before, source, self.tolerance, held=held, after=end)
        if result.clean:
            return result
        # Where the code's own tensors are: among the objects it made. Only the tensors
        # are kept: the list of every young object would be one more referrer of each.
        young = self.heap.young_objects()
        tensors = None if young is None else cuda.tensors_among(young)
        del young
        result = self._stacks(result, tensors)
        self.heap.thaw()
        del tensors
        if not self._proven_alive(result):
            whole = SettleStep(WHOLE_HEAP, self.heap.collect_everything)
            result = self._settle_more(result, (whole,), held)
        if drop_failure is not None and not result.clean and not self._proven_alive(result):
            result = self._traceback_only(result, drop_failure, held)
        return kept_by_library(result) if not result.clean else result

    @staticmethod
    def _proven_alive(result: LeakResult) -> bool:
        """Every holder is proven alive, or those that are keep blocks that make up each
        device's growth: a collection could not lower the verdict (what it frees of
        older garbage, :meth:`_at_least_what_is_new` would not count)."""
        scan = result.holders
        if scan is None or not scan.complete:
            return False
        proven = dict(scan.proven)
        return scan.alive or all(
            proven.get(f"cuda:{device}", 0) >= grew for device, grew in result.leaked.items()
        )

    def _traceback_only(
        self, result: LeakResult, drop_failure: Callable[[], bool], held: Readings | None
    ) -> LeakResult:
        """Drop the failed code's traceback (and collect: its frames and exceptions refer
        to each other); what that frees was held by it alone (a closure its frames keep,
        an exception's arguments): kept, not a leak."""
        holders = result.holders.holders if result.holders is not None else ()

        def drop(devices: tuple[int, ...]) -> bool:
            return drop_failure() and self.heap.collect_everything()

        name = f"{TRACEBACK_STEP}: {holders[0].path}" if holders else TRACEBACK_STEP
        return self._settle_more(result, (SettleStep(name, drop),), held)

    def _settle_more(
        self, result: LeakResult, steps: Sequence[SettleStep], held: Readings | None
    ) -> LeakResult:
        """``result`` settled further by ``steps``; what is left attributed again."""
        again = settle(self.before, Steps(self.source, tuple(steps)), self.tolerance, held=held)
        # Nothing runs between the two readers of the allocator's state: one snapshot.
        snapshot = functools.cache(cuda.memory_snapshot)
        again = self._at_least_what_is_new(result, again, snapshot)
        released = (*result.released, *again.released)
        if again.clean:
            return replace(again, released=released)
        if again.leaked == result.leaked:
            return replace(result, released=released)
        # Part of it was garbage: attribute what is left.
        return replace(self._stacks(again, None, snapshot), released=released)

    def _at_least_what_is_new(
        self, before: LeakResult, after: LeakResult, snapshot: Snapshot
    ) -> LeakResult:
        """A collection of the whole heap also frees garbage older than the check (an
        earlier failed test's traceback, a cycle an earlier test dropped), which lowers
        the reading under what the code still holds and could hide its leak: on each
        device whose growth fell, what is still alive of the blocks allocated since
        :meth:`begin` (up to the growth before) is leaked whatever the reading says."""
        fell = {d for d, grew in before.leaked.items() if after.leaked.get(d, 0) < grew}
        if not fell or self.recording is None or not cuda.memory_history_enabled():
            return after
        from pytest_cuda.leaks.stacks import bytes_allocated_since

        alive = bytes_allocated_since(self._start_us, fell, self.outermost, snapshot())
        leaked = dict(after.leaked)
        for device in fell:
            floor = min(before.leaked[device], alive.get(device, 0))
            if floor > self.tolerance and floor > leaked.get(device, 0):
                leaked[device] = floor
        if leaked == after.leaked:
            return after
        return replace(after, leaked=leaked, growth={**after.growth, **leaked})

    def _stacks(
        self,
        result: LeakResult,
        objects: Sequence[object] | None,
        snapshot: Snapshot | None = None,
    ) -> LeakResult:
        if self.recording is None:
            return replace(result, stack_note=self.untraced_note)
        if not cuda.memory_history_enabled():
            return replace(result, stack_note=self.recording.why_off())
        # Only a leak needs the attribution and its walk: imported then.
        from pytest_cuda.leaks.stacks import attribute

        stacks, holders = attribute(
            self._start_us,
            result.leaked,
            self.outermost,
            None if snapshot is None else snapshot(),
            objects=objects,
            budget_s=self.search_s,
            frozen_before=self.heap.frozen_before,
            # Still frozen: the walk goes up among the code's objects first.
            thaw=self.heap.thaw if self.heap.frozen else None,
        )
        return replace(result, stacks=stacks, holders=holders)
