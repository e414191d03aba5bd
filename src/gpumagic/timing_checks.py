"""What ``%cudatime`` checks about its own numbers: the SM clock each run ran at and
NVML's reasons for it, runs far off the median clock, the gap between CUDA events and
CUPTI's kernel time, and whether ``--cold``'s flush made a difference.

Pure: numbers in, decisions and sentences out; no CUDA, no IPython. The engine reads
the clocks (:func:`gpumagic.cuda.sm_clock`); :class:`~gpumagic.timing_result.CudaTimeResult`
carries them and shows these sentences.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

from gpumagic.noise import RatioInterval, ratio_interval
from gpumagic.units import format_bytes, format_time, quantile

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "AT_DEFAULT",
    "BELOW_DEFAULT",
    "CLOCK_OUTLIER",
    "COLD_SAME",
    "ColdReadings",
    "at_default_share",
    "clock_range",
    "cold_interval",
    "cold_row",
    "cold_warning",
    "events_row",
    "gap_row",
    "is_throttling",
    "outlier_note",
    "pass_clocks",
    "reason_names",
    "split_off_clock",
    "throttle_line",
    "throttled",
]

# NVML's clocks event reasons (nvml.h's nvmlClocksEventReason*; the bits are stable
# across drivers), most telling first. GPU idle (0x1) is no reason: the clock is read
# right after a run, when the device may already be idle.
_REASONS = (
    (0x4, "power cap"),
    (0x80, "power brake"),
    (0x40, "hardware thermal slowdown"),
    (0x20, "software thermal slowdown"),
    (0x8, "hardware slowdown"),
    (0x10, "sync boost"),
    (0x2, "clocks set by the user"),  # applications clocks, or clocks locked with nvidia-smi
    (0x100, "display clock setting"),
)
#: The reasons that hold the clock back under load (not settings the user made).
_THROTTLING = 0x4 | 0x80 | 0x40 | 0x20 | 0x8 | 0x10
#: A clock at least this close under the default counts as at the default (H100 clocks
#: move in steps of 15 MHz, 0.8 % of 1980 MHz).
AT_DEFAULT = 0.01
#: A median clock this far under the default is held back, whatever NVML says.
BELOW_DEFAULT = 0.05
#: A run whose clock is this far from the median clock is set apart (NVBench discards
#: samples under 75 % of the default clock; a notebook's runs are fewer, so closer).
CLOCK_OUTLIER = 0.10
#: Cold over warm single calls under this: the flush made no difference worth the name
#: (when the calls are too few for an interval: :func:`cold_interval`).
COLD_SAME = 1.03
#: Two passes whose median clocks differ by more than this ran at different clocks.
PASS_CLOCKS = 0.02


def reason_names(mask: int) -> list[str]:
    """NVML's reason bits as words, most telling first; GPU idle and unknown bits left out."""
    return [name for bit, name in _REASONS if mask & bit]


def is_throttling(mask: int | None) -> bool:
    """Whether NVML's reasons hold the clock back (a power, thermal or sync limit)."""
    return bool(mask and mask & _THROTTLING)


def _known(clocks: Sequence[int | None]) -> list[int]:
    return [c for c in clocks if c is not None]


def clock_range(clocks: Sequence[int | None]) -> tuple[int, int, int] | None:
    """``(min, median, max)`` MHz of the runs whose clock was read; ``None`` if none was."""
    known = _known(clocks)
    if not known:
        return None
    return min(known), round(quantile([float(c) for c in known], 0.5)), max(known)


def at_default_share(clocks: Sequence[int | None], default: int | None) -> float | None:
    """The share of the runs (with a clock read) at the default clock."""
    known = _known(clocks)
    if not known or not default:
        return None
    return sum(c >= default * (1 - AT_DEFAULT) for c in known) / len(known)


def throttled(clocks: Sequence[int | None], default: int | None, limited_runs: int) -> bool:
    """Whether the GPU was held back: NVML gave a power, thermal or sync reason after
    some run, or the median clock was well under the default."""
    span = clock_range(clocks)
    if span is None:
        return False
    if limited_runs:
        return True
    return bool(default and span[1] < default * (1 - BELOW_DEFAULT))


def throttle_line(
    clocks: Sequence[int | None], default: int | None, reasons: Sequence[str], limited_runs: int
) -> str | None:
    """One line for a GPU that was held back, with the reason and the distance from the
    default clock; ``None`` when it was not (or the clocks are unknown)."""
    if not throttled(clocks, default, limited_runs):
        return None
    span = clock_range(clocks)
    assert span is not None
    low, _, high = span
    ran = _span(span)
    why = "; ".join(reasons) if reasons else "NVML gave no reason"
    known = len(_known(clocks))
    if limited_runs and limited_runs < known:
        why += f" after {limited_runs} of {known} runs"
    if default and low < default:
        near, far = ((default - c) / default * 100 for c in (high, low))
        if round(near) <= 0:
            below = f"up to {far:.0f} %"
        elif round(near) != round(far):
            below = f"{near:.0f}\u2013{far:.0f} %"
        else:
            below = f"{far:.0f} %"
        why += f"; {below} under the default {default} MHz"
    elif default:
        why += f"; default {default} MHz"
    return f"the GPU ran at {ran} ({why}): this time holds at that clock"


def split_off_clock(clocks: Sequence[int | None]) -> tuple[list[int], list[int]]:
    """Indices of the runs to keep and of those set apart: a run whose clock is more
    than :data:`CLOCK_OUTLIER` from the median clock of the runs. Runs with no clock
    read are kept, and so is every run when half of them or more would be set apart
    (no clock is the usual one: the throttle line gives the range)."""
    span = clock_range(clocks)
    if span is None:
        return list(range(len(clocks))), []
    median = span[1]
    keep: list[int] = []
    apart: list[int] = []
    for i, c in enumerate(clocks):
        far = c is not None and abs(c - median) > CLOCK_OUTLIER * median
        (apart if far else keep).append(i)
    if 2 * len(apart) >= len(clocks):
        return list(range(len(clocks))), []
    return keep, apart


def pass_clocks(events: Sequence[int | None], profiled: Sequence[int | None]) -> str | None:
    """``--timer cupti``'s events row, when its runs (without the profiler) ran at
    another clock than the profiled runs: both ranges, and where the two timers meet at
    one clock; ``None`` when the medians are within :data:`PASS_CLOCKS` or unknown."""
    ours, theirs = clock_range(events), clock_range(profiled)
    if ours is None or theirs is None or abs(ours[1] - theirs[1]) <= PASS_CLOCKS * theirs[1]:
        return None
    return (
        f"ran at {_span(ours)}, the profiled runs at {_span(theirs)}: the ratio compares "
        "two clocks; the gaps row compares the same loops at one"
    )


def events_row(
    events: float,
    n: int,
    cupti: float,
    clocks: tuple[Sequence[int | None], Sequence[int | None]],
    precision: int,
) -> tuple[str, str, str]:
    """``--timer cupti``'s ``events`` row: ``events``, the median per loop of the ``n``
    event runs made without the profiler, against the ``cupti`` headline; ``clocks``:
    the event runs' and the profiled runs' SM clocks (:func:`pass_clocks`)."""
    detail = f"CUDA events, median of {n} run{'s' if n != 1 else ''} without the profiler"
    detail += f" · {events / cupti:.3f}\u00d7 CUPTI"
    apart = pass_clocks(*clocks)
    return (
        "events",
        f"{format_time(events, precision)} per loop",
        detail + (f" · {apart}" if apart else ""),
    )


def _span(clocks: tuple[int, int, int]) -> str:
    low, _, high = clocks
    return f"{low}\u2013{high} MHz" if low != high else f"{low} MHz"


def outlier_note(
    apart: Sequence[tuple[float, int]], runs: int, median_mhz: int, dropped: bool, precision: int
) -> str:
    """The note on runs set apart by their clock: how many, at which clocks and times."""
    which = ", ".join(
        f"{format_time(t, precision)} at {mhz} MHz" for t, mhz in sorted(apart, key=lambda a: a[1])
    )
    head = (
        f"{len(apart)} of {runs} run{'s' if runs != 1 else ''} ran more than "
        f"{CLOCK_OUTLIER * 100:.0f} % off the median clock of {median_mhz} MHz ({which})"
    )
    if dropped:
        return head + ": left out of the numbers (--clock-outliers drop)."
    return head + ": kept in the numbers; --clock-outliers drop leaves them out."


def gap_row(
    events: float | None, kernels: float | None, span: float | None, loops: int, precision: int
) -> tuple[str, str, str] | None:
    """The ``gaps`` row: CUDA events over CUPTI's summed kernel time of the same loops,
    per loop, split into the idle time between kernels (from CUPTI's span) and the rest
    (launch latency before the first kernel and after the last); ``None`` when events
    do not exceed the kernels."""
    if events is None or not kernels or not events > kernels:
        return None
    gap = events - kernels
    detail = (
        f"CUDA events {format_time(events, precision)} {_minus()} CUPTI kernels "
        f"{format_time(kernels, precision)} per loop, same {loops:,} loops "
        f"({gap / events * 100:.1f} % of the events)"
    )
    if span is not None and kernels <= span <= events:
        detail += (
            f": {format_time(span - kernels, precision)} between kernels, "
            f"{format_time(events - span, precision)} launching and around them"
        )
    return ("gaps", f"{format_time(gap, precision)} per loop", detail)


def _minus() -> str:
    return "\u2212"


def cold_interval(cold_runs: Sequence[float], warm_runs: Sequence[float]) -> RatioInterval | None:
    """The interval for cold over warm single calls (:func:`gpumagic.noise.ratio_interval`),
    ``None`` when either side has no usable run."""
    cold = [t for t in cold_runs if t > 0 and math.isfinite(t)]
    warm = [t for t in warm_runs if t > 0 and math.isfinite(t)]
    return ratio_interval(cold, warm) if cold and warm else None


class ColdReadings(Protocol):
    """What the ``L2 check`` row reads of a ``--cold`` result
    (:class:`~gpumagic.timing_result.CudaTimeResult` has it)."""

    @property
    def median(self) -> float: ...
    @property
    def timings(self) -> list[float]: ...
    @property
    def cold_warm_time(self) -> float | None: ...
    @property
    def cold_warm_timings(self) -> list[float]: ...
    @property
    def flush_bytes(self) -> int | None: ...
    @property
    def l2_bytes(self) -> int | None: ...
    @property
    def precision(self) -> int: ...


def cold_row(result: ColdReadings) -> tuple[str, str, str] | None:
    """The ``L2 check`` row of ``--cold``: cold over warm single calls of the same body
    with its interval (``"no difference within the noise"`` where it holds 1), and the
    bytes flushed against the L2 cache's size."""
    warm, flush_bytes, l2_bytes = result.cold_warm_time, result.flush_bytes, result.l2_bytes
    if warm is None and flush_bytes is None:
        return None
    value = "warm not measured"
    parts = []
    if warm and warm > 0:
        value = f"cold {result.median / warm:.2f}\u00d7 warm"
        interval = cold_interval(result.timings, result.cold_warm_timings)
        if interval is not None and interval.bounded:
            level = f"{interval.level * 100:.0f} %"
            value = (
                f"no difference within the noise ({interval.text()}, {level})"
                if interval.holds_one
                else f"{value} ({interval.text()}, {level})"
            )
        parts.append(f"warm single calls {format_time(warm, result.precision)}")
    if flush_bytes:
        flushed = f"{format_bytes(flush_bytes)} overwritten before each call"
        if l2_bytes:
            flushed += f", {flush_bytes / l2_bytes:.1f}\u00d7 the {format_bytes(l2_bytes)} L2"
        parts.append(flushed)
    return ("L2 check", value, " · ".join(parts))


def cold_warning(
    cold: float, warm: float | None, interval: RatioInterval | None = None
) -> str | None:
    """A warning when cold and warm single calls agree: the flush changed nothing. With
    an ``interval`` (runs enough for one), they agree when it holds 1; else when their
    ratio is under :data:`COLD_SAME`."""
    if not warm or not warm > 0 or not math.isfinite(cold):
        return None
    ratio = cold / warm
    if interval is not None and interval.bounded:
        if not interval.holds_one:
            return None
        said = f"do not differ within the noise ({ratio:.2f}\u00d7, {interval.text()})"
    elif ratio >= COLD_SAME:
        return None
    else:
        said = f"agree ({ratio:.2f}\u00d7)"
    return (
        f"--cold: cold and warm single calls {said}: the flush changed "
        "nothing measurable; the body's data may not stay in L2 between calls anyway "
        "(larger than L2), the body may be compute-bound, or its data never left L2"
    )
