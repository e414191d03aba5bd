"""``%lprun --gpu`` alone, once armed: each line boundary recorded raw (see
:mod:`gpumagic.lineprof_hook`, whose ``replay`` runs the record through the live
boundary's bookkeeping after the run). The callbacks here only append one
:data:`RawEvent` each: two clock reads, the thread, the frame, the autograd sequence
number. Nothing here calls CUDA.
"""

from __future__ import annotations

import sys
import time
from threading import get_ident
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import CodeType

__all__ = ["Callbacks", "RawEvent", "Recorder", "measure_raw_residual", "raw_callbacks"]

#: One boundary: ``(ns at entry, thread, frame key, code, line, autograd sequence
#: number, ns at exit)``; ``line`` 0: the frame left (return, yield, raise); ``code``
#: None: a synchronizing-call warning arrived (the rest unused but the time and thread).
RawEvent = tuple[int, int, int, "CodeType | None", int, int, int]

#: sys.monitoring's line, exit (return, yield) and raise callbacks.
Callbacks = tuple[
    "Callable[[CodeType, int], None]",
    "Callable[[CodeType, int, Any], None]",
    "Callable[[CodeType, int, BaseException], None]",
]


class Recorder(Protocol):
    """What the raw callbacks use of the boundary hook
    (:class:`gpumagic.lineprof_hook.BoundaryHook`)."""

    natives: dict[int, int]
    interrupted: bool

    def raw_seq(self) -> int: ...

    def note_thread(self, tid: int) -> None: ...


def raw_callbacks(hook: Recorder, raw: list[RawEvent], codes: frozenset[CodeType]) -> Callbacks:
    """sys.monitoring's line, exit and raise callbacks appending to ``raw`` only."""
    append = raw.append
    seq = hook.raw_seq
    natives = hook.natives
    note = hook.note_thread
    getframe = sys._getframe
    clock = time.perf_counter_ns

    def on_line(code: CodeType, line: int) -> None:
        t0 = clock()
        tid = get_ident()
        if tid not in natives:
            note(tid)
        append((t0, tid, id(getframe(1)), code, line, seq(), clock()))

    def on_exit(code: CodeType, offset: int, value: object) -> None:
        t0 = clock()
        tid = get_ident()
        if tid not in natives:
            note(tid)
        append((t0, tid, id(getframe(1)), code, 0, seq(), clock()))

    def on_raise(code: CodeType, offset: int, exc: BaseException) -> None:
        if code in codes:
            if isinstance(exc, KeyboardInterrupt):
                hook.interrupted = True
            t0 = clock()
            tid = get_ident()
            if tid not in natives:
                note(tid)
            append((t0, tid, id(getframe(1)), code, 0, seq(), clock()))

    return on_line, on_exit, on_raise


def measure_raw_residual(call: Callable[[bool], None], scratch: list[RawEvent]) -> int:
    """What a raw callback costs beyond the span its event records (entering it, the
    append, leaving it, handing over to line_profiler), measured around ``call`` (a raw
    boundary appended to ``scratch``, emptied after): the median, in ns."""
    clock = time.perf_counter_ns
    samples = []
    for index in range(400):
        t = clock()
        call(index % 2 == 0)
        event = scratch[-1]
        samples.append(clock() - t - (event[6] - event[0]))
    scratch.clear()
    samples.sort()
    return max(0, samples[len(samples) // 2])
