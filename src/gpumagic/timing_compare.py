"""Results side by side: :func:`compare` of ``%cudatime -o`` results, and the
:class:`Comparison` it returns (text and HTML).

Pure data and formatting: no torch, no IPython.
"""

from __future__ import annotations

import html
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from gpumagic.timing_result import DASH, TIMES, CudaTimeResult
from gpumagic.units import format_time

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["Comparison", "ComparisonRow", "compare"]


@dataclass(frozen=True)
class ComparisonRow:
    """One result in a :class:`Comparison`."""

    #: The result's ``labels=`` entry, else its label, else ``#i``.
    label: str
    #: Median seconds per loop.
    median: float
    #: First quartile, seconds per loop.
    q1: float
    #: Third quartile, seconds per loop.
    q3: float
    #: ``"gpu"`` or ``"host"``.
    clock: str
    #: The baseline's median over this one's (above 1: faster).
    speedup: float
    #: ``"baseline"``, ``"SAME"``, ``"FASTER"`` or ``"SLOWER"`` (with `` (other clock)``
    #: when the clocks differ).
    status: str


@dataclass(frozen=True)
class Comparison:
    """Results side by side: the first is the baseline; the others are SAME, FASTER or
    SLOWER depending on whether their interquartile ranges overlap the baseline's."""

    #: One row per result, the baseline first.
    rows: list[ComparisonRow]
    #: Significant digits shown.
    precision: int = 3

    def _cells(self) -> list[list[str]]:
        header = ["", "median per loop", "IQR", "speedup", "vs baseline"]
        body = [
            [
                r.label,
                f"{format_time(r.median, self.precision)} ({r.clock})",
                f"{format_time(r.q1, self.precision)} {DASH} {format_time(r.q3, self.precision)}",
                f"{r.speedup:.2f}{TIMES}",
                r.status,
            ]
            for r in self.rows
        ]
        return [header, *body]

    def __str__(self) -> str:
        cells = self._cells()
        widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
        return "\n".join(line.rstrip() for line in lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text("Comparison(...)" if cycle else str(self))

    def _repr_html_(self) -> str:
        e = html.escape
        cell = "padding:1px 12px 1px 0;text-align:left;border:none"
        header, *body = self._cells()
        head = "".join(f'<th style="{cell}">{e(c)}</th>' for c in header)
        rows = "".join(
            "<tr>"
            + "".join(
                f'<td style="{cell}">{"<b>" + e(c) + "</b>" if i in (0, 4) else e(c)}</td>'
                for i, c in enumerate(row)
            )
            + "</tr>"
            for row in body
        )
        return (
            '<table class="gpumagic-compare" style="border-collapse:collapse">'
            f"<tr>{head}</tr>{rows}</table>"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [asdict(r) for r in self.rows]}


def compare(*results: CudaTimeResult, labels: Sequence[str] | None = None) -> Comparison:
    """Show ``%cudatime -o`` results side by side, the first one as the baseline.

    Each row gets its median, interquartile range, speedup against the baseline and a
    status: SAME when the interquartile ranges overlap, else FASTER or SLOWER.
    """
    if not results:
        raise ValueError("compare() needs at least one CudaTimeResult (from %cudatime -o)")
    for r in results:
        if not isinstance(r, CudaTimeResult):
            raise TypeError(
                "compare() takes CudaTimeResult objects (from %cudatime -o), "
                f"not {type(r).__name__}"
            )
    if labels is not None and len(labels) != len(results):
        raise ValueError(f"{len(labels)} labels for {len(results)} results")
    names = (
        list(labels) if labels is not None else [r.label or f"#{i}" for i, r in enumerate(results)]
    )
    base = results[0]
    rows = []
    for i, (name, r) in enumerate(zip(names, results, strict=True)):
        if i == 0:
            status = "baseline"
        elif r.q3 >= base.q1 and r.q1 <= base.q3:
            status = "SAME"
        else:
            status = "FASTER" if r.median < base.median else "SLOWER"
        if r.clock != base.clock and i > 0:
            status += " (other clock)"
        speedup = base.median / r.median if r.median > 0 else math.inf
        rows.append(ComparisonRow(name, r.median, r.q1, r.q3, r.clock, speedup, status))
    return Comparison(rows, precision=base.precision)
