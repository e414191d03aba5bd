"""What ``%cudatime`` measured: :class:`CudaTimeResult` and its renderings
(:func:`~gpumagic.timing_compare.compare` puts several side by side).

Pure data and formatting: no torch, no IPython. A result carries the attributes of
IPython's ``TimeitResult`` (``loops``, ``repeat``, ``best``, ``worst``, ``all_runs``,
``average``, ``stdev``, ``timings``, ``compile_time``) so code written for ``%timeit -o``
keeps working, plus the robust statistics (median, IQR), the three clocks (GPU events,
host wall, CUPTI kernels), the first call, the verdict and the warnings.
"""

from __future__ import annotations

import html
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from gpumagic import timing_brief as brief
from gpumagic import timing_checks as checks
from gpumagic.roofline import Roofline
from gpumagic.timing_brief import IQR_RUNS
from gpumagic.units import format_bytes, format_rate, format_time, quantile, wrap_text

if TYPE_CHECKING:
    from gpumagic.timing_budget import BudgetSpent

__all__ = [
    "DASH",
    "FIRST_CALL_WARNING",
    "IQR_RUNS",
    "TIMES",
    "CudaTimeResult",
    "KernelStat",
    "SyncSite",
    "format_time",
    "quantile",
]

#: Properties :meth:`CudaTimeResult.to_dict` leaves out (``gpu_times`` is ``timings``).
_NOT_IN_DICT = ("gpu_times", "roofline", "brief")
TIMES = "\u00d7"  # multiplication sign
DASH = "\u2013"  # en dash
#: First call / steady state above which the engine warns about the first call.
FIRST_CALL_WARNING = 10


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
    #: ``--kernels``/``--validate``/``--timer cupti``: GPU seconds per loop that CUPTI recorded, the
    #: durations of the body's kernels, copies and memsets summed; ``None`` without them.
    kernel_time: float | None = None
    #: ``--kernels``: seconds per loop from the first kernel's start to the last one's end,
    #: gaps included.
    kernel_span: float | None = None
    #: ``--kernels``: each kernel, per loop, as :class:`KernelStat`.
    kernels: list[KernelStat] = field(default_factory=list)
    #: Loops the profiled runs had (0 without ``--kernels``).
    kernel_loops: int = 0
    #: :attr:`kernel_time` over the host wall time of the same loops: how busy the GPU was.
    busy_fraction: float | None = None
    #: One line such as ``"GPU-bound: GPU busy 97 % of wall time"``; empty when nothing was
    #: decided.
    verdict: str = ""
    #: ``--validate``: events time over CUPTI kernel time for the same loops.
    cupti_ratio: float | None = None
    #: ``--kernels``/``--validate``/``--timer cupti``: the CUDA-event seconds per loop
    #: of the profiled loops (:attr:`gap_time` is its excess over :attr:`kernel_time`).
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
    #: Seconds per loop an empty run measures on this clock: times near it are overhead.
    floor: float | None = None
    #: Whether the GPU time runs to the devices' idle because the body left work on other
    #: streams.
    side_streams: bool = False
    #: Whether Ctrl-C ended the measurement early (the runs so far are kept).
    interrupted: bool = False
    #: Where the time after the first call went, part by part of the budget.
    budget_spent: BudgetSpent | None = None
    #: What may make the numbers misleading, one sentence each (``!`` lines).
    warnings: list[str] = field(default_factory=list)
    #: Options asked for and not applied, each as ``"--graph not used: needs CUDA"``
    #: (:func:`~gpumagic.timing_compare.compare` shows them in the result's row).
    not_applied: list[str] = field(default_factory=list)
    #: How the numbers were made, one sentence each (``·`` lines).
    notes: list[str] = field(default_factory=list)
    #: Significant digits shown (``-p``).
    precision: int = 3
    #: The magic that made it (``%cudatime`` or ``%%cudatime``): the output's heading.
    magic: str = "%cudatime"
    #: Whether a host timing shows every row, warning and note (``--verbose``); by
    #: default it shows three lines at most: the time, the spread and one warning (GPU
    #: timings always show everything).
    verbose: bool = False
    #: What the headline is: ``"events"`` (CUDA events on the GPU, ``time.perf_counter``
    #: on the host) or ``"cupti"`` (``--timer cupti``: :attr:`all_runs` are profiled runs
    #: timed by CUPTI's summed kernel time).
    timer: str = "events"
    #: ``--timer cupti``: the per-loop time of each run on CUDA events, measured without
    #: the profiler, shown beside the headline.
    event_timings: list[float] = field(default_factory=list)
    #: ``--timer cupti``: the SM clock in MHz read right after each of those event runs.
    event_clocks_mhz: list[int | None] = field(default_factory=list)
    #: The SM clock in MHz read right after each run of :attr:`all_runs` (``None``: not
    #: read); empty where NVML is unavailable and on the host.
    run_clocks_mhz: list[int | None] = field(default_factory=list)
    #: The SM clock when nothing holds the GPU back (NVML's default applications clock,
    #: else its maximum), in MHz; ``None`` when unknown.
    default_clock_mhz: int | None = None
    #: NVML's reasons for the clock after the runs (``power cap``, ``hardware thermal
    #: slowdown``, ``sync boost``, ``clocks set by the user``...), most telling first.
    throttle_reasons: list[str] = field(default_factory=list)
    #: Runs after which NVML gave a power, thermal or sync reason for the clock.
    throttled_runs: int = 0
    #: Runs set apart because their SM clock was far off the median clock:
    #: ``(seconds per loop, MHz)`` each (``--clock-outliers``).
    clock_outliers: list[tuple[float, int]] = field(default_factory=list)
    #: Whether :attr:`clock_outliers` were left out (``--clock-outliers drop``).
    clock_outliers_dropped: bool = False
    #: ``--cold``: seconds per loop of each warm single call of the body (no flush).
    cold_warm_timings: list[float] = field(default_factory=list)
    #: ``--cold``: the median of :attr:`cold_warm_timings`, for the L2 check.
    cold_warm_time: float | None = None
    #: ``--cold``: bytes overwritten before each call.
    flush_bytes: int | None = None
    #: The timed GPU's L2 cache size in bytes, where known.
    l2_bytes: int | None = None

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

    # -- the checks -------------------------------------------------------------------
    @property
    def clocks_mhz(self) -> tuple[int, int, int] | None:
        """``(min, median, max)`` SM clock of the runs in MHz; ``None`` when unknown."""
        return checks.clock_range(self.run_clocks_mhz)

    @property
    def at_default_clock(self) -> float | None:
        """The share of the runs at the default clock (:attr:`default_clock_mhz`)."""
        return checks.at_default_share(self.run_clocks_mhz, self.default_clock_mhz)

    @property
    def throttled(self) -> bool:
        """Whether the GPU was held back: NVML gave a power, thermal or sync reason, or
        the median clock was well under the default. ``False`` when the clocks are
        unknown."""
        return checks.throttled(self.run_clocks_mhz, self.default_clock_mhz, self.throttled_runs)

    @property
    def gap_time(self) -> float | None:
        """CUDA events minus CUPTI kernel time per loop of the profiled loops (launch and
        inter-kernel gaps); ``None`` without kernel figures."""
        if self.cupti_events_time is None or self.kernel_time is None:
            return None
        return self.cupti_events_time - self.kernel_time

    @property
    def events_time(self) -> float | None:
        """Median CUDA-event time per loop: the headline, or beside it under ``--timer
        cupti``; ``None`` on the host."""
        if self.timer == "cupti":
            return quantile(self.event_timings, 0.5) if self.event_timings else None
        return self.gpu_time

    @property
    def cold_warm_ratio(self) -> float | None:
        """``--cold``: the median over warm single calls of the same body."""
        warm = self.cold_warm_time
        return self.median / warm if warm and warm > 0 else None

    # -- renderings -----------------------------------------------------------------
    def __str__(self) -> str:
        what = "GPU time" if self.clock == "gpu" else "host time"
        runs = f"{self.repeat} run{'s' if self.repeat != 1 else ''}"
        loops = f"{self.loops:,} loop{'s' if self.loops != 1 else ''} each"
        spread = (
            f"IQR {self._t(self.iqr)}, min {self._t(self.best)}"
            if self.repeat >= IQR_RUNS
            else f"min {self._t(self.best)}, max {self._t(self.worst)}"
        )
        text = f"{self._t(self.median)} {what} per loop (median of {runs}, {loops}; {spread})"
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
        spread = brief.spread(self)
        out: list[tuple[str, str, str]] = []
        mode = {"graph": ", CUDA graph replays", "cold": ", L2 flushed before each loop"}
        mode["cold graph"] = ", CUDA graph replays, L2 flushed before each loop"
        if self.clock == "gpu":
            out.append(("GPU time", f"{self._t(self.median)} per loop", f"{runs} · {spread}"))
            clock = "CUPTI kernel time of profiled runs" if self.timer == "cupti" else "CUDA events"
            detail = clock + mode.get(self.mode, "")
            if self.side_streams:
                detail += "; includes work on other streams (device-wide completion)"
            out.append(("", "", detail))
            events = self.events_time
            if self.timer == "cupti" and events is not None:
                out.append(
                    checks.events_row(
                        events,
                        len(self.event_timings),
                        self.median,
                        (self.event_clocks_mhz, self.run_clocks_mhz),
                        self.precision,
                    )
                )
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
        gaps = checks.gap_row(
            self.cupti_events_time,
            self.kernel_time,
            self.kernel_span,
            self.kernel_loops,
            self.precision,
        )
        if gaps is not None:
            out.append(gaps)
        if self.cupti_ratio is not None:
            out.append(
                (
                    "CUPTI check",
                    f"{self.cupti_ratio:.3f}{TIMES}",
                    f"events {self._t(self.cupti_events_time)} vs CUPTI kernel time "
                    f"{self._t(self.kernel_time)} per loop, same {self.kernel_loops:,} loops",
                )
            )
        if self.mode.startswith("cold"):
            cold = checks.cold_row(self)
            if cold is not None:
                out.append(cold)
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

    @property
    def brief(self) -> bool:
        """Whether the renderings are the short host form (a host timing without
        :attr:`verbose`): the time, the spread and one warning at most."""
        return self.clock == "host" and not self.verbose

    def text(self) -> str:
        """The multi-line terminal rendering (three lines at most on the host, unless
        :attr:`verbose`)."""
        if self.brief:
            return "\n".join(brief.lines(self))
        lines = [f"{self.magic}  {self.label}".rstrip() + f"    [{self._header()}]"]
        indent = " " * len(f"  {'':<12} {'':<20} ")
        for name, value, detail in self.rows():
            head = f"  {name:<12} {value:<20} "
            if len(head) > len(indent) and detail:  # a value wider than its column
                lines.append(head.rstrip())
                head = indent
            parts = wrap_text(detail, width=80 - len(indent)) or [""]
            lines.append((head + parts[0]).rstrip())
            lines.extend(indent + part for part in parts[1:])
        for mark, texts in (("!", self.warnings), ("·", self.notes)):
            for text in texts:
                lines.extend(
                    wrap_text(text, width=80, initial_indent=f"  {mark} ", subsequent_indent="    ")
                )
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's RepresentationPrinter
        p.text("CudaTimeResult(...)" if cycle else self.text())

    def _repr_html_(self) -> str:
        """Self-contained HTML: inline styles only, colours inherited from the page."""
        e = html.escape
        cell = "padding:1px 10px 1px 0;text-align:left;vertical-align:top;border:none"
        rows = []
        shown = self.rows()[:1] if self.brief else self.rows()
        for name, value, detail in shown:
            rows.append(
                f'<tr><th style="{cell};font-weight:600">{e(name)}</th>'
                f'<td style="{cell};white-space:nowrap"><b>{e(value)}</b></td>'
                f'<td style="{cell}">{e(detail)}</td></tr>'
            )
        warnings = self.warnings[:1] if self.brief else self.warnings
        items = "".join(f"<li>⚠ {e(w)}</li>" for w in warnings)
        if not self.brief:
            items += "".join(f"<li>{e(n)}</li>" for n in self.notes)
        roofline = self.roofline if not self.brief else None
        notes = f'<ul style="margin:4px 0 0 0;padding-left:1.2em">{items}</ul>' if items else ""
        label = f" <code>{e(self.label)}</code>" if self.label else ""
        return (
            '<div class="gpumagic-cudatime" style="font-size:0.92em;line-height:1.35">'
            f"<div><b>{e(self.magic)}</b>{label} "
            f'<span style="opacity:0.85">· {e(self._header())}</span> {self._sparkline()}</div>'
            f'<table style="border-collapse:collapse;margin:2px 0">{"".join(rows)}</table>'
            f"{roofline.svg() if roofline else ''}{notes}</div>"
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
        for name, attribute in vars(CudaTimeResult).items():
            if isinstance(attribute, property) and name not in _NOT_IN_DICT:
                data[name] = getattr(self, name)
        return data
