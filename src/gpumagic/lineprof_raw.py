"""``%lprun --gpu`` without ``--memory``, once armed: each line boundary recorded raw (see
:mod:`gpumagic.lineprof_hook`, whose ``replay`` runs the record through the live
boundary's bookkeeping after the run). The recorder here (:func:`raw_recorder`, both
installers' once the hook is armed) calls the hook's ``raw_wait`` (the synchronize;
none with ``--no-sync``) and appends one :data:`RawEvent` a boundary: a clock read, the
thread, the frame, the autograd sequence number. What one costs on an idle GPU is
measured once (:func:`measure_raw_cost`) and charged to every boundary, as the live hook
charges what it measured: a wait for the GPU's work beyond that stays with the line that
launched it. Nothing here calls CUDA but through ``raw_wait``.
"""

from __future__ import annotations

import time
from threading import get_ident
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import CodeType

    #: Records one boundary: ``(code, line, frame key)``, ``line`` 0: the frame left
    #: (return, yield, raise).
    BoundaryRecord = Callable[[CodeType, int, int], None]

__all__ = ["RawEvent", "Recorder", "measure_raw_cost", "raw_recorder"]

#: One boundary: ``(ns at entry, thread, frame key, code, line, autograd sequence
#: number)``; ``line`` 0: the frame left (return, yield, raise); ``code`` None: a
#: synchronizing-call warning arrived (the rest unused but the time and thread).
RawEvent = tuple[int, int, int, "CodeType | None", int, int]


class Recorder(Protocol):
    """What :func:`raw_recorder` uses of the boundary hook
    (:class:`gpumagic.lineprof_hook.BoundaryHook`)."""

    natives: dict[int, int]
    raw_wait: Callable[[], object] | None

    def raw_seq(self) -> int: ...

    def note_thread(self, tid: int) -> None: ...


def raw_recorder(hook: Recorder, raw: list[RawEvent]) -> BoundaryRecord:
    """A ``BoundaryRecord`` appending to ``raw`` (both installers call it)."""
    append = raw.append
    seq = hook.raw_seq
    natives = hook.natives
    note = hook.note_thread
    clock = time.perf_counter_ns

    def record(code: CodeType, line: int, key: int) -> None:
        t0 = clock()
        tid = get_ident()
        if tid not in natives:
            note(tid)
        wait = hook.raw_wait
        if wait is not None:
            wait()
        append((t0, tid, key, code, line, seq()))

    return record


def measure_raw_cost(call: Callable[[bool], None], scratch: list[RawEvent]) -> int:
    """What one raw callback costs, all of it (entering it, the append, leaving it),
    measured around ``call`` (a raw boundary appended to ``scratch``, emptied after):
    the median, in ns. A pause within one (another thread holding the interpreter)
    stays billed to the line, as it would be without the hook."""
    clock = time.perf_counter_ns
    samples = []
    for index in range(400):
        t = clock()
        call(index % 2 == 0)
        samples.append(clock() - t)
    scratch.clear()
    samples.sort()
    return max(0, samples[len(samples) // 2])
