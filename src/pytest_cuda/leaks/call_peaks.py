"""One peak reset per test call, shared: the memory limit
(:mod:`~pytest_cuda.leaks.limiter`) and ``--cuda-memory-report``
(:mod:`~pytest_cuda.leaks.checker`) both read peaks since the start of a test's call.
Whichever of their ``pytest_runtest_call`` wrappers runs first resets the counters
(:func:`~pytest_cuda.leaks.peaks.reset_peaks`) and keeps what it read in the test's stash
until the call is over; the other takes it from there instead of resetting again. The
limit alone, where the allocator records its events, reads nothing at the start (see
:mod:`~pytest_cuda.leaks.peaks`); the report needs the start's marks, read then if the
limit's reset came without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from pytest_cuda.leaks.peaks import PeakStart, reset_peaks, with_marks

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["CallPeaks"]

_START = pytest.StashKey[PeakStart]()


class CallPeaks:
    """``with CallPeaks(item, marks=...) as start:`` around the yield of a call wrapper:
    the peaks reset for ``item``'s call, by the outermost such block, which forgets them
    when it ends (a rerun of the test resets again). ``marks``: this caller needs the
    allocator read at the start too."""

    __slots__ = ("item", "marks", "owner")

    def __init__(self, item: pytest.Item, *, marks: bool = True) -> None:
        self.item = item
        self.marks = marks
        self.owner = False

    def __enter__(self) -> PeakStart:
        start = self.item.stash.get(_START, None)
        if start is None:
            start = self.item.stash[_START] = reset_peaks(marks=self.marks)
            self.owner = True
        elif self.marks and start.marks is None:
            start = self.item.stash[_START] = with_marks(start)
        return start

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.owner:
            del self.item.stash[_START]
