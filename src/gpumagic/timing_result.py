"""What ``%cudatime`` measured: :class:`CudaTimeResult`, its renderings, and :func:`compare`.

Pure data and formatting: no torch, no IPython. A result carries the attributes of
IPython's ``TimeitResult`` (``loops``, ``repeat``, ``best``, ``worst``, ``all_runs``,
``average``, ``stdev``, ``timings``, ``compile_time``) so code written for ``%timeit -o``
keeps working, plus the robust statistics (median, IQR), the three clocks (GPU events,
host wall, CUPTI kernels), the first call, the verdict and the warnings.
"""

from __future__ import annotations

import html
import math
import textwrap
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from gpumagic.roofline import Roofline
from gpumagic.units import format_bytes, format_rate, format_time, quantile

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "FIRST_CALL_WARNING",
    "TIMES",
    "Comparison",
    "ComparisonRow",
    "CudaTimeResult",
    "KernelStat",
    "SyncSite",
    "compare",
    "format_time",
    "quantile",
]

TIMES = "\u00d7"  # multiplication sign
DASH = "\u2013"  # en dash
NBSP = "\u00a0"  # no-break space: textwrap does not break at it

#: First call / steady state above which the engine warns about the first call.
FIRST_CALL_WARNING = 10


def _wrap(text: str, **options: Any) -> list[str]:
    """``textwrap.wrap``, never breaking a number from its ``%``."""
    return [
        line.replace(NBSP, " ") for line in textwrap.wrap(text.replace(" %", NBSP + "%"), **options)
    ]


def _percent(value: float) -> str:
    return f"{value * 100:.0f} %" if value >= 0.1 else f"{value * 100:.1f} %"


@dataclass(frozen=True)
class KernelStat:
    """One GPU kernel (or copy/memset) as CUPTI saw it, per loop of the body."""

    #: The kernel's name as CUPTI reports it (demangled).
    name: str
    #: Launches per loop of the body.
    calls_per_loop: float
    #: GPU seconds per loop, summed over its launches.
    time_per_loop: float


@dataclass(frozen=True)
class SyncSite:
    """A host synchronization the body triggered (found by ``--sync-check``)."""

    #: The torch op that made the host wait (``aten::item``, ``aten::nonzero``...).
    op: str
    #: Where it was called: ``line N`` of the body, else ``file.py:N``.
    where: str
    #: That line's source.
    code: str
    #: How many times per loop of the body it synchronized.
    per_loop: float


@dataclass
class CudaTimeResult:
    """The outcome of one ``%cudatime`` run.

    ``flops`` and ``bytes`` are the work per loop, given or counted in one extra,
    untimed call; with the device's peaks (:mod:`gpumagic.peaks`) and the median time
    they give :attr:`tflops`, :attr:`gbps`, :attr:`intensity` and :attr:`roofline`.

    Times are in seconds. ``all_runs`` holds the total of each run (a run is a block of
    ``loops`` back-to-back calls of the body) on the primary clock: CUDA events on the
    GPU (``clock == "gpu"``) or ``time.perf_counter`` on the host (``clock == "host"``,
    when there is no GPU or the body launched no GPU work). ``host_runs`` holds the host
    wall time of the same runs, device synchronized: what the user waits for.
    """

    #: Calls of the body per run (``-n``, or sized to the budget).
    loops: int
    #: Runs measured (``-r``, or until the spread or the budget stopped them).
    repeat: int
    #: Seconds of each whole run on the primary clock (see :attr:`clock`).
    all_runs: list[float]
    #: Host wall seconds of each whole run, device synchronized.
    host_runs: list[float]
    #: ``"gpu"`` (CUDA events) or ``"host"`` (``time.perf_counter``: no GPU, ``--device
    #: cpu``, or a body that launched no GPU work).
    clock: str = "gpu"
    #: ``"eager"``, ``"graph"`` (``--graph`` replays), ``"cold"`` or ``"cold graph"``
    #: (``--cold``).
    mode: str = "eager"
    #: Seconds to compile the cell's code into the timed function.
    compile_time: float = 0.0
    #: Host wall seconds of the first call, devices synchronized (kept out of every other
    #: figure); ``None`` when not measured.
    first_call: float | None = None
    #: The body's first line of code, as the output's title.
    label: str = ""
    #: The timed GPU's name; ``None`` on the host.
    device_name: str | None = None
    #: The timed GPU's index (``--device``, else the current device).
    device_index: int | None = None
    #: Every device synchronized around each run (those with a CUDA context).
    devices: list[int] = field(default_factory=list)
    #: ``torch.__version__``, or ``None`` without torch.
    torch_version: str | None = None
    #: The CUDA version torch was built with, or ``None``.
    cuda_version: str | None = None
    #: ``--kernels``/``--validate``: GPU seconds per loop that CUPTI recorded, the
    #: durations of the body's kernels, copies and memsets summed; ``None`` without them.
    kernel_time: float | None = None
    #: ``--kernels``: seconds per loop from the first kernel's start to the last one's end,
    #: gaps included.
    kernel_span: float | None = None
    #: ``--kernels``: each kernel, per loop, as :class:`KernelStat`.
    kernels: list[KernelStat] = field(default_factory=list)
    #: Loops the profiled run had (0 without ``--kernels``).
    kernel_loops: int = 0
    #: :attr:`kernel_time` over the host wall time of the same loops: how busy the GPU was.
    busy_fraction: float | None = None
    #: One line such as ``"GPU-bound: GPU busy 97 % of wall time"``; empty when nothing was
    #: decided.
    verdict: str = ""
    #: ``--validate``: events time over CUPTI kernel time for the same loops.
    cupti_ratio: float | None = None
    #: ``--validate``: the CUDA-event seconds per loop of those loops.
    cupti_events_time: float | None = None
    #: ``--sync-check``: host synchronizations per loop; ``None`` without it.
    syncs_per_loop: float | None = None
    #: ``--sync-check``: where they happened, as :class:`SyncSite`.
    sync_sites: list[SyncSite] = field(default_factory=list)
    #: FLOPs per loop: given (``--flops``) or counted; ``None`` when unknown.
    flops: float | None = None
    #: Bytes read and written per loop: given (``--bytes``) or counted (a lower bound);
    #: ``None`` when unknown.
    bytes: float | None = None
    #: The device's peak FLOP/s for :attr:`flops_dtype`, if known.
    peak_flops: float | None = None
    #: What :attr:`peak_flops` is (``fp32 peak (CUDA cores)``...), or why there is none.
    peak_flops_basis: str = ""
    #: The device's DRAM bandwidth: the data sheet's, else what the hardware reports.
    peak_bytes_per_s: float | None = None
    #: The data sheet the peaks come from (an address), if any.
    peak_source: str = ""
    #: Whether :attr:`flops` was counted (not given).
    flops_counted: bool = False
    #: Whether :attr:`bytes` was counted (not given).
    bytes_counted: bool = False
    #: The precision that did most of the counted FLOPs (``fp32``, ``bf16``...).
    flops_dtype: str = ""
    #: Ops that do arithmetic but have no FLOP formula in torch's counter.
    not_counted: list[str] = field(default_factory=list)
    #: Seconds per loop that an empty run measures on this clock: times near it are
    #: overhead.
    floor: float | None = None
    #: Whether the GPU time runs to the devices' idle because the body left work on other
    #: streams.
    side_streams: bool = False
    #: Whether Ctrl-C ended the measurement early (the runs so far are kept).
    interrupted: bool = False
    #: What may make the numbers misleading, one sentence each (``!`` lines).
    warnings: list[str] = field(default_factory=list)
    #: How the numbers were made, one sentence each (``·`` lines).
    notes: list[str] = field(default_factory=list)
    #: Significant digits shown (``-p``).
    precision: int = 3

    # -- IPython TimeitResult compatibility ------------------------------------------
    @property
    def timings(self) -> list[float]:
        """Per-loop time of each run on the primary clock."""
        return [t / self.loops for t in self.all_runs]

    @property
    def best(self) -> float:
        """Fastest per-loop time of any run (as ``TimeitResult``)."""
        return min(self.timings) if self.all_runs else math.nan

    @property
    def worst(self) -> float:
        """Slowest per-loop time of any run (as ``TimeitResult``)."""
        return max(self.timings) if self.all_runs else math.nan

    @property
    def average(self) -> float:
        """Mean per-loop time over the runs (as ``TimeitResult``); see :attr:`median`."""
        return math.fsum(self.timings) / len(self.all_runs) if self.all_runs else math.nan

    @property
    def stdev(self) -> float:
        """Population standard deviation of :attr:`timings` (as ``TimeitResult``)."""
        if not self.all_runs:
            return math.nan
        mean = self.average
        return math.sqrt(math.fsum((x - mean) ** 2 for x in self.timings) / len(self.all_runs))

    # -- robust statistics -----------------------------------------------------------
    @property
    def median(self) -> float:
        """Median per-loop time over the runs: the figure the output leads with."""
        return quantile(self.timings, 0.5)

    @property
    def q1(self) -> float:
        """First quartile of :attr:`timings`."""
        return quantile(self.timings, 0.25)

    @property
    def q3(self) -> float:
        """Third quartile of :attr:`timings`."""
        return quantile(self.timings, 0.75)

    @property
    def iqr(self) -> float:
        """Interquartile range of :attr:`timings` (``q3 - q1``): the spread shown."""
        return self.q3 - self.q1

    @property
    def rel_iqr(self) -> float:
        """:attr:`iqr` as a fraction of :attr:`median` (``nan`` when the median is 0)."""
        median = self.median
        return self.iqr / median if median > 0 else math.nan

    @property
    def gpu_times(self) -> list[float]:
        """Per-loop GPU time of each run (empty when the clock is the host's)."""
        return self.timings if self.clock == "gpu" else []

    @property
    def host_times(self) -> list[float]:
        """Per-loop host wall time of each run."""
        return [t / self.loops for t in self.host_runs]

    @property
    def gpu_time(self) -> float | None:
        """Median GPU time per loop, or ``None`` when no GPU time was measured."""
        return self.median if self.clock == "gpu" else None

    @property
    def host_time(self) -> float:
        """Median host wall time per loop (device synchronized)."""
        return quantile(self.host_times, 0.5)

    @property
    def tflops(self) -> float | None:
        """Achieved TFLOP/s from :attr:`flops` (given or counted) and the median time."""
        return self.flops / self.median / 1e12 if self.flops and self.median > 0 else None

    @property
    def gbps(self) -> float | None:
        """Achieved GB/s from :attr:`bytes` (given or counted) and the median time."""
        return self.bytes / self.median / 1e9 if self.bytes and self.median > 0 else None

    @property
    def roofline(self) -> Roofline | None:
        """The body on the device's roofline, once its FLOPs and bytes are known."""
        if self.flops is None or not self.bytes or not self.median > 0:
            return None
        return Roofline(self.flops, self.bytes, self.median, self.peak_flops, self.peak_bytes_per_s)

    @property
    def intensity(self) -> float | None:
        """Arithmetic intensity: FLOP per byte read and written."""
        line = self.roofline
        return line.intensity if line is not None else None

    # -- renderings -----------------------------------------------------------------
    def __str__(self) -> str:
        what = "GPU time" if self.clock == "gpu" else "host time"
        runs = f"{self.repeat} run{'s' if self.repeat != 1 else ''}"
        loops = f"{self.loops:,} loop{'s' if self.loops != 1 else ''} each"
        text = (
            f"{self._t(self.median)} {what} per loop (median of {runs}, {loops}; "
            f"IQR {self._t(self.iqr)}, min {self._t(self.best)})"
        )
        if self.clock == "gpu":
            text += f"; host {self._t(self.host_time)} per loop"
        return text

    def __repr__(self) -> str:
        return f"<CudaTimeResult : {self}>"

    def _t(self, seconds: float | None) -> str:
        return format_time(seconds, self.precision)

    def _header(self) -> str:
        parts = [self.device_name or "host (no GPU)"]
        if self.torch_version:
            parts.append(f"torch {self.torch_version}")
        if self.cuda_version:
            parts.append(f"CUDA {self.cuda_version}")
        return " · ".join(parts)

    def rows(self) -> list[tuple[str, str, str]]:
        """The result as ``(name, value, detail)`` rows, shared by text and HTML."""
        runs = f"median of {self.repeat} run{'s' if self.repeat != 1 else ''}"
        runs += f" {TIMES} {self.loops:,} loop{'s' if self.loops != 1 else ''}"
        spread = f"IQR {self._t(self.iqr)} ({_percent(self.rel_iqr)})"
        spread += f" · min {self._t(self.best)}"
        out: list[tuple[str, str, str]] = []
        mode = {"graph": ", CUDA graph replays", "cold": ", L2 flushed before each loop"}
        mode["cold graph"] = ", CUDA graph replays, L2 flushed before each loop"
        if self.clock == "gpu":
            out.append(("GPU time", f"{self._t(self.median)} per loop", f"{runs} · {spread}"))
            detail = "CUDA events" + mode.get(self.mode, "")
            if self.side_streams:
                detail += "; includes work on other streams (device-wide completion)"
            out.append(("", "", detail))
            out.append(
                (
                    "host wall",
                    f"{self._t(self.host_time)} per loop",
                    "what you wait for, device synchronized",
                )
            )
        else:
            out.append(("host time", f"{self._t(self.median)} per loop", f"{runs} · {spread}"))
        if self.first_call is not None:
            ratio = self.first_call / self.host_time if self.host_time > 0 else math.nan
            detail = "not in the numbers above"
            if 2 <= ratio < FIRST_CALL_WARNING:  # above it, a warning says so
                detail += f" ({ratio:,.0f}{TIMES} the steady state)"
            out.append(("first call", self._t(self.first_call), detail))
        if self.kernel_time is not None:
            count = sum(k.calls_per_loop for k in self.kernels)
            detail = f"CUPTI, {count:.3g} kernel{'s' if count != 1 else ''} per loop"
            if self.busy_fraction is not None:
                detail += f" · GPU busy {_percent(self.busy_fraction)} of wall time"
            out.append(("kernels", f"{self._t(self.kernel_time)} per loop", detail))
        if self.cupti_ratio is not None:
            out.append(
                (
                    "CUPTI check",
                    f"{self.cupti_ratio:.3f}{TIMES}",
                    f"events {self._t(self.cupti_events_time)} vs CUPTI kernel time "
                    f"{self._t(self.kernel_time)} per loop, same {self.kernel_loops:,} loops",
                )
            )
        if self.verdict:
            out.append(("verdict", self.verdict, ""))
        if self.syncs_per_loop is not None:
            out.append(
                (
                    "host syncs",
                    f"{self.syncs_per_loop:.3g} per loop",
                    "; ".join(f"{s.op} at {s.where}: {s.code}" for s in self.sync_sites)
                    or "none found by torch.cuda.set_sync_debug_mode",
                )
            )
        out.extend(self._throughput_rows())
        return out

    def _throughput_rows(self) -> list[tuple[str, str, str]]:
        out = []
        tflops, gbps = self.tflops, self.gbps
        if tflops is not None and self.flops:
            detail = []
            if self.peak_flops:
                detail.append(
                    f"{_percent(tflops * 1e12 / self.peak_flops)} of "
                    f"{format_rate(self.peak_flops, 'FLOP/s')} {self.peak_flops_basis}"
                )
            elif self.peak_flops_basis:
                detail.append(self.peak_flops_basis)
            if self.flops_counted:
                detail.append(f"{format_rate(self.flops, 'FLOP')} per loop, counted")
            out.append(("compute", format_rate(tflops * 1e12, "FLOP/s"), " · ".join(detail)))
        if gbps is not None and self.bytes:
            detail = []
            if self.peak_bytes_per_s:
                detail.append(
                    f"{_percent(gbps * 1e9 / self.peak_bytes_per_s)} of "
                    f"{format_rate(self.peak_bytes_per_s, 'B/s')} DRAM peak"
                )
            if self.bytes_counted:
                detail.append(
                    f"{format_bytes(self.bytes)} per loop read and written, counted (a lower bound)"
                )
            out.append(("memory", format_rate(gbps * 1e9, "B/s"), " · ".join(detail)))
        line = self.roofline
        if line is not None:
            out.append(line.row())
        return out

    def text(self) -> str:
        """The multi-line terminal rendering."""
        lines = [f"%cudatime  {self.label}".rstrip() + f"    [{self._header()}]"]
        for name, value, detail in self.rows():
            head = f"  {name:<12} {value:<20} "
            parts = _wrap(detail, width=max(20, 80 - len(head))) or [""]
            lines.append((head + parts[0]).rstrip())
            lines.extend(" " * len(head) + part for part in parts[1:])
        for mark, texts in (("!", self.warnings), ("·", self.notes)):
            for text in texts:
                lines.extend(
                    _wrap(text, width=80, initial_indent=f"  {mark} ", subsequent_indent="    ")
                )
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's RepresentationPrinter
        p.text("CudaTimeResult(...)" if cycle else self.text())

    def _repr_html_(self) -> str:
        """Self-contained HTML: inline styles only, colours inherited from the page."""
        e = html.escape
        cell = "padding:1px 10px 1px 0;text-align:left;vertical-align:top;border:none"
        rows = []
        for name, value, detail in self.rows():
            rows.append(
                f'<tr><th style="{cell};font-weight:600">{e(name)}</th>'
                f'<td style="{cell};white-space:nowrap"><b>{e(value)}</b></td>'
                f'<td style="{cell}">{e(detail)}</td></tr>'
            )
        items = "".join(f"<li>⚠ {e(w)}</li>" for w in self.warnings)
        items += "".join(f"<li>{e(n)}</li>" for n in self.notes)
        notes = f'<ul style="margin:4px 0 0 0;padding-left:1.2em">{items}</ul>' if items else ""
        label = f" <code>{e(self.label)}</code>" if self.label else ""
        return (
            '<div class="gpumagic-cudatime" style="font-size:0.92em;line-height:1.35">'
            f"<div><b>%cudatime</b>{label} "
            f'<span style="opacity:0.85">· {e(self._header())}</span> {self._sparkline()}</div>'
            f'<table style="border-collapse:collapse;margin:2px 0">{"".join(rows)}</table>'
            f"{self.roofline.svg() if self.roofline else ''}{notes}</div>"
        )

    def _sparkline(self) -> str:
        """An inline SVG of the per-loop time of each run (no text, current colour)."""
        values = self.timings
        if len(values) < 3:
            return ""
        low, high = min(values), max(values)
        width, height = 4 * len(values), 14
        bars = []
        for i, v in enumerate(values):
            h = 3 + (height - 3) * ((v - low) / (high - low) if high > low else 0.5)
            bars.append(
                f'<rect x="{4 * i}" y="{height - h:.1f}" width="3" height="{h:.1f}"></rect>'
            )
        return (
            f'<svg width="{width}" height="{height}" role="img" aria-label="per-run times" '
            'style="vertical-align:middle;fill:currentColor;opacity:0.6">'
            f"{''.join(bars)}</svg>"
        )

    def to_dict(self) -> dict[str, Any]:
        """Every field and statistic as plain JSON-serializable values."""
        data = asdict(self)
        for name in (
            "timings",
            "best",
            "worst",
            "average",
            "stdev",
            "median",
            "q1",
            "q3",
            "iqr",
            "rel_iqr",
            "gpu_time",
            "host_time",
            "host_times",
            "tflops",
            "gbps",
            "intensity",
        ):
            data[name] = getattr(self, name)
        return data


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
