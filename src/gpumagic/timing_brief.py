"""The short form of a host timing (``%cudatime`` without a GPU, as ``%timeit``): the
time, the spread and one warning at most, in three lines of 80 columns; and the spread
every rendering shows (no IQR under :data:`IQR_RUNS` runs).

Pure formatting: no torch, no IPython.
"""

from __future__ import annotations

import textwrap
from typing import Protocol

from gpumagic.units import format_time

__all__ = ["IQR_RUNS", "Timed", "lines", "spread"]

#: Runs below which no IQR is shown (the quartiles of fewer say little).
IQR_RUNS = 5
WIDTH = 80
MORE = " … (--verbose)"


class Timed(Protocol):
    """What the short form reads of a :class:`~gpumagic.timing_result.CudaTimeResult`."""

    repeat: int
    loops: int
    precision: int
    label: str
    magic: str
    warnings: list[str]

    @property
    def median(self) -> float: ...
    @property
    def iqr(self) -> float: ...
    @property
    def rel_iqr(self) -> float: ...
    @property
    def best(self) -> float: ...
    @property
    def worst(self) -> float: ...


def _percent(value: float) -> str:
    return f"{value * 100:.0f} %" if value >= 0.1 else f"{value * 100:.1f} %"


def spread(result: Timed) -> str:
    """IQR and min from :data:`IQR_RUNS` runs, else min and max (too few for an IQR)."""
    t = result.precision
    runs = f"{result.repeat} run{'s' if result.repeat != 1 else ''}"
    if result.repeat >= IQR_RUNS:
        return (
            f"IQR {format_time(result.iqr, t)} ({_percent(result.rel_iqr)})"
            f" · min {format_time(result.best, t)}"
        )
    if result.repeat == 1:
        return f"{runs}: no spread to show"
    return f"min {format_time(result.best, t)} · max {format_time(result.worst, t)}"


def lines(result: Timed) -> list[str]:
    """The short host form: at most three lines of at most 80 columns (a long label is
    cut; a long warning is cut, its whole text in ``warnings`` and under ``--verbose``)."""
    runs = f"{result.repeat} run{'s' if result.repeat != 1 else ''}"
    loops = f"{result.loops:,} loop{'s' if result.loops != 1 else ''}"
    median = format_time(result.median, result.precision)
    tail = f"    {median} per loop on the host"
    label = result.label
    room = max(WIDTH - len(result.magic) - 2 - len(tail), 20)
    if len(label) > room:
        label = label[: room - 1] + "…"
    out = [
        f"{result.magic}  {label}".rstrip() + tail,
        f"  median of {runs} \u00d7 {loops} · {spread(result)}",
    ]
    if result.warnings:
        more = len(result.warnings) - 1
        text = result.warnings[0] + (f" (and {more} more: --verbose)" if more else "")
        wrapped = textwrap.wrap(text, width=WIDTH, initial_indent="  ! ")
        if len(wrapped) > 1:
            cut = textwrap.wrap(text, width=WIDTH - len(MORE), initial_indent="  ! ")[0]
            wrapped = [cut.rstrip(",;:(") + MORE]
        out.append(wrapped[0])
    return out
