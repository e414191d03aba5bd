"""Results side by side: :func:`compare` of ``%cudatime -o`` results, and the
:class:`Comparison` it returns (text and HTML).

A row gets a verdict (FASTER or SLOWER) only where the runs support one: the interval
for its speedup (:func:`gpumagic.noise.ratio_interval`, a rank test's interval at
99 %) must leave out 1; otherwise it says ``no difference within the noise``, or
``too few runs to tell``. An option a result asked for and did not get (``--graph``
without CUDA, a capture that failed) is said in its row.

Pure data and formatting: no torch, no IPython.
"""

from __future__ import annotations

import html
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from gpumagic.noise import LEVEL, ratio_interval
from gpumagic.timing_result import DASH, IQR_RUNS, TIMES, CudaTimeResult
from gpumagic.units import format_time

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["NO_DIFFERENCE", "TOO_FEW_RUNS", "Comparison", "ComparisonRow", "compare"]

#: The status of a row whose speedup interval holds 1.
NO_DIFFERENCE = "no difference within the noise"
#: The status of a row whose runs (or the baseline's) are too few for an interval.
TOO_FEW_RUNS = "too few runs to tell"


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
    #: ``"baseline"``, ``"no difference within the noise"``, ``"too few runs to tell"``,
    #: ``"FASTER"`` or ``"SLOWER"`` (with `` (other clock)`` when the clocks differ).
    status: str
    #: Runs behind the median.
    runs: int = 0
    #: Lower end of the interval for :attr:`speedup` (at :data:`gpumagic.noise.LEVEL`);
    #: ``None`` for the baseline and where the runs are too few.
    speedup_low: float | None = None
    #: Upper end of that interval; ``None`` likewise.
    speedup_high: float | None = None
    #: Options the result asked for and did not get, each as ``"--graph not used:
    #: needs CUDA"`` (from :attr:`CudaTimeResult.not_applied`).
    not_applied: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Comparison:
    """Results side by side: the first is the baseline; each other one is FASTER or
    SLOWER where the interval for its speedup leaves out 1, else ``no difference within
    the noise`` (or ``too few runs to tell``)."""

    #: One row per result, the baseline first.
    rows: list[ComparisonRow]
    #: Significant digits shown.
    precision: int = 3

    def _cells(self) -> list[list[str]]:
        header = [
            "",
            "median per loop",
            "IQR",
            "speedup",
            f"{LEVEL * 100:.0f} % interval",
            "vs baseline",
        ]
        body = []
        for r in self.rows:
            t = self.precision
            spread = (
                f"{format_time(r.q1, t)} {DASH} {format_time(r.q3, t)}"
                if r.runs >= IQR_RUNS
                else f"({r.runs} run{'s' if r.runs != 1 else ''})"
            )
            interval = DASH  # the baseline, or too few runs
            if r.speedup_low is not None and r.speedup_high is not None:
                interval = f"{r.speedup_low:.2f}{DASH}{r.speedup_high:.2f}{TIMES}"
            status = "; ".join([r.status, *r.not_applied])
            body.append(
                [
                    r.label,
                    f"{format_time(r.median, t)} ({r.clock})",
                    spread,
                    f"{r.speedup:.2f}{TIMES}",
                    interval,
                    status,
                ]
            )
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
        last = len(header) - 1
        rows = "".join(
            "<tr>"
            + "".join(
                f'<td style="{cell}">{"<b>" + e(c) + "</b>" if i in (0, last) else e(c)}</td>'
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
        """Plain data: ``{"rows": [...]}``, each row's fields by name."""
        return {"rows": [asdict(r) for r in self.rows]}


def compare(*results: CudaTimeResult, labels: Sequence[str] | None = None) -> Comparison:
    """Show ``%cudatime -o`` results side by side, the first one as the baseline.

    Each row gets its median, interquartile range (from 5 runs), speedup against the
    baseline with its 99 % interval, and a status. The interval is the Mann-Whitney
    rank test's (Hodges-Lehmann) interval for the ratio of the baseline's per-loop
    times to this result's, from the runs each one has (:mod:`gpumagic.noise`):
    FASTER or SLOWER when it leaves out 1, ``no difference within the noise`` when it
    holds 1, ``too few runs to tell`` when the runs are too few for it (5 each is
    the fewest). An option the
    result asked for and did not get follows the status (``--graph not used: needs
    CUDA``).
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
        low = high = None
        if i == 0:
            status = "baseline"
        else:
            status, low, high = _verdict(base, r)
            if r.clock != base.clock:
                status += " (other clock)"
        speedup = base.median / r.median if r.median > 0 else math.inf
        rows.append(
            ComparisonRow(
                name,
                r.median,
                r.q1,
                r.q3,
                r.clock,
                speedup,
                status,
                runs=len(r.all_runs),
                speedup_low=low,
                speedup_high=high,
                not_applied=list(r.not_applied),
            )
        )
    return Comparison(rows, precision=base.precision)


def _verdict(base: CudaTimeResult, other: CudaTimeResult) -> tuple[str, float | None, float | None]:
    """The status of ``other`` against ``base``, and the speedup's interval."""
    a = [t for t in base.timings if t > 0 and math.isfinite(t)]
    b = [t for t in other.timings if t > 0 and math.isfinite(t)]
    if not a or not b:
        return TOO_FEW_RUNS, None, None
    interval = ratio_interval(a, b)
    if not interval.bounded:
        return TOO_FEW_RUNS, None, None
    faster_or_slower = "FASTER" if interval.low > 1 else "SLOWER"
    status = NO_DIFFERENCE if interval.holds_one else faster_or_slower
    return status, interval.low, interval.high
