"""A block of code checked for leaks: ``with no_cuda_leak(): ...``.

:class:`NoCudaLeak` runs the one :class:`~pytest_cuda.leaks.engine.LeakCheck` around the
block and raises :class:`~pytest_cuda.leaks.result.CudaLeakError` (or warns) with its
report. Never imports pytest.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from gpumagic.stacks import short_path
from pytest_cuda.leaks.engine import LeakCheck, LeakSettings
from pytest_cuda.leaks.result import (
    CudaLeakError,
    CudaLeakWarning,
    LeakResult,
    Mode,
    parse_leak_settings,
)

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["CudaLeakError", "CudaLeakWarning", "NoCudaLeak", "no_cuda_leak"]

UNTRACED = (
    "Stacks not recorded: no_cuda_leak(trace=True) names the lines that allocated these blocks."
)


@dataclass
class NoCudaLeak:
    """The context manager behind :func:`no_cuda_leak`; after the block, ``result`` holds
    the :class:`~pytest_cuda.leaks.result.LeakResult` (``None`` when the block raised)."""

    #: Bytes per device the block may leave allocated.
    tolerance: int = 0
    #: ``"fail"`` (raise :class:`~pytest_cuda.leaks.result.CudaLeakError`), ``"warn"`` (warn
    #: :class:`~pytest_cuda.leaks.result.CudaLeakWarning`) or ``"off"``.
    mode: Mode = "fail"
    #: Record allocation stacks during the block, so a leak names the line that allocated
    #: it.
    trace: bool = True
    #: How reports name what was checked; default "the block at <file>:<line>".
    subject: str | None = None
    #: After the block: the check's result; ``None`` when the block raised or
    #: ``mode="off"``.
    result: LeakResult | None = field(default=None, init=False)
    _check: LeakCheck | None = field(default=None, init=False, repr=False)
    _where: str = field(default="the block", init=False, repr=False)

    def __enter__(self) -> NoCudaLeak:
        caller = sys._getframe(1)
        self._where = self.subject or (
            f"the block at {short_path(caller.f_code.co_filename, os.getcwd())}:{caller.f_lineno}"
        )
        self.result = None
        if self.mode == "off":
            return self
        self._check = LeakCheck.alone(
            LeakSettings(self.tolerance, self.mode),
            trace=self.trace,
            outermost=(caller.f_code.co_filename, caller.f_code.co_name),
            untraced_note=UNTRACED,
        )
        self._check.begin()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        __tracebackhide__ = True  # pytest shows the ``with`` line, not this method
        check, self._check = self._check, None
        if check is None:
            return False
        if exc is not None:
            # Its frames still hold the block's locals: any figure would be wrong.
            check.close()
            exc.add_note(f"no_cuda_leak: {self._where} raised, so it was not checked")
            return False
        result = self.result = check.finish()
        if result.clean:
            return False
        root = os.getcwd()
        text = f"{result.summary(self._where, root)}\n{result.details(self._where, root)}"
        if self.mode == "fail":
            raise CudaLeakError(text)
        warnings.warn(CudaLeakWarning(text), stacklevel=2)
        return False


def no_cuda_leak(
    tolerance: int | str = 0, *, mode: Mode = "fail", trace: bool = True
) -> NoCudaLeak:
    """Check that a block of code leaves no CUDA memory allocated.

    ``with no_cuda_leak(): ...`` measures this process's caching allocator on every
    device before and after the block (after garbage collection and after releasing
    what libraries keep by design: cuBLAS/cuBLASLt workspaces, cuFFT plans, blocks
    waiting on other streams, torch.compile caches). Growth above ``tolerance`` bytes
    per device (an int or a size like ``"4KiB"``) raises :class:`CudaLeakError`
    (``mode="warn"``: a :class:`CudaLeakWarning`) naming the amounts and, with
    ``trace`` (recording allocation stacks for the block: about 2 µs per CUDA
    allocation), the lines that allocated the blocks still alive and who holds them.
    A block that raises is not checked. Without CUDA it checks nothing. Also a pytest
    fixture.
    """
    size, checked = parse_leak_settings(tolerance, mode, where="no_cuda_leak")
    return NoCudaLeak(tolerance=size, mode=checked, trace=trace)
