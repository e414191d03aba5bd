"""The roofline of a ``%cudatime`` measurement (pure: numbers in, text and SVG out).

A body that does ``flops`` floating-point operations and moves ``bytes`` per loop has
an arithmetic intensity of ``flops / bytes`` FLOP per byte. The device can do at most
``peak_flops`` per second and move at most ``bandwidth`` bytes per second, so the
fastest it can run the body is ``min(peak_flops, bandwidth * intensity)`` FLOP/s: the
roof. The ridge point, ``peak_flops / bandwidth``, is where the two limits meet: below
it the body is memory-bound, above it compute-bound.

:func:`roofline_svg` draws it: a small log-log chart, self-contained (no script, no
external resource, no font), in the page's own text colour (``currentColor``) with
translucent fills, so it reads in light and dark themes.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

from gpumagic.units import format_rate

__all__ = ["Roofline"]


@dataclass(frozen=True)
class Roofline:
    """One body on one device's roofline: work per loop, time per loop and the peaks
    (``None`` where unknown)."""

    #: FLOPs per loop.
    flops: float
    #: Bytes read and written per loop.
    bytes: float
    #: Seconds per loop.
    seconds: float
    #: The device's peak FLOP/s for the body's precision, if known.
    peak_flops: float | None
    #: The device's DRAM bandwidth in bytes per second, if known.
    bandwidth: float | None

    @property
    def intensity(self) -> float:
        """FLOP per byte read or written."""
        return self.flops / self.bytes if self.bytes > 0 else math.inf

    @property
    def ridge(self) -> float | None:
        """The intensity where the memory roof meets the compute roof, if both are known."""
        if not (self.peak_flops and self.bandwidth):
            return None
        return self.peak_flops / self.bandwidth

    @property
    def achieved(self) -> float:
        """FLOP/s reached."""
        return self.flops / self.seconds if self.seconds > 0 else math.nan

    @property
    def roof(self) -> float | None:
        """The most FLOP/s the device allows at this intensity."""
        if not (self.peak_flops and self.bandwidth):
            return None
        return min(self.peak_flops, self.bandwidth * self.intensity)

    @property
    def bound(self) -> str:
        """``"compute-bound"``, ``"memory-bound"``, or ``""`` without a ridge."""
        ridge = self.ridge
        if ridge is None:
            return ""
        return "compute-bound" if self.intensity >= ridge else "memory-bound"

    def row(self) -> tuple[str, str, str]:
        """The one line the text output shows: the verdict, the intensity and the ridge."""
        intensity = f"{_number(self.intensity)} FLOP/B"
        ridge = self.ridge
        if ridge is None or self.peak_flops is None or self.bandwidth is None:
            return ("intensity", intensity, "FLOP per byte moved; no peaks to compare")
        side = "above" if self.intensity >= ridge else "below"
        detail = (
            f"{intensity}, {side} the ridge at {_number(ridge)} FLOP/B "
            f"({format_rate(self.peak_flops, 'FLOP/s')} ÷ {format_rate(self.bandwidth, 'B/s')})"
        )
        roof = self.roof
        if roof and self.flops > 0:
            detail += f"; {self.achieved / roof * 100:.0f} % of the roof"
        return ("roofline", self.bound, detail)

    def svg(self) -> str:
        """The chart, or ``""`` when there is nothing to place on log axes."""
        if self.ridge is None or not (self.flops > 0 and self.bytes > 0 and self.seconds > 0):
            return ""
        return roofline_svg(self)


def _number(value: float) -> str:
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


# The chart's geometry, in SVG user units (pixels at 100 %).
WIDTH, HEIGHT = 300, 190
LEFT, RIGHT, TOP, BOTTOM = 40, 16, 20, 34


def _decades(low: float, high: float) -> tuple[int, int]:
    return math.floor(math.log10(low)), math.ceil(math.log10(high))


def roofline_svg(line: Roofline) -> str:
    """A log-log roofline: FLOP/s against FLOP/byte, the roof, the ridge (dashed) and
    the measured point, with the attainable region shaded."""
    peak, bandwidth, ridge = line.peak_flops, line.bandwidth, line.ridge
    assert peak is not None
    assert bandwidth is not None
    assert ridge is not None
    x_lo, x_hi = _decades(min(line.intensity, ridge) / 8, max(line.intensity, ridge) * 8)
    y_hi = math.ceil(math.log10(peak * 1.5))
    y_lo = min(
        math.floor(math.log10(max(line.achieved, 1e-30) / 2)),
        math.floor(math.log10(bandwidth * 10.0**x_lo)),
    )
    y_lo = max(y_lo, y_hi - 8)  # a point far below the roof sits on the bottom edge
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(intensity: float) -> float:
        return LEFT + (math.log10(intensity) - x_lo) / (x_hi - x_lo) * plot_w

    def y(flops: float) -> float:
        value = (math.log10(max(flops, 10.0**y_lo)) - y_lo) / (y_hi - y_lo)
        return TOP + (1 - min(value, 1.0)) * plot_h

    left_x = 10.0**x_lo
    # The memory roof starts at the left edge, or where it enters the plot from below.
    start = max(left_x, 10.0**y_lo / bandwidth)
    roof = [(start, bandwidth * start), (ridge, peak), (10.0**x_hi, peak)]
    path = " ".join(f"{x(a):.1f},{y(f):.1f}" for a, f in roof)
    bottom = TOP + plot_h
    area = f"{x(start):.1f},{bottom} {path} {LEFT + plot_w},{bottom}"
    ticks, labels = [], []
    for d in range(x_lo, x_hi + 1):
        at = f"{x(10.0**d):.1f}"
        ticks.append(f'<line x1="{at}" y1="{bottom}" x2="{at}" y2="{bottom + 3}"/>')
        labels.append(f'<text x="{at}" y="{bottom + 13}" text-anchor="middle">{_power(d)}</text>')
    for d in range(y_lo, y_hi + 1, max(1, (y_hi - y_lo + 3) // 4)):
        at = f"{y(10.0**d):.1f}"
        ticks.append(f'<line x1="{LEFT - 3}" y1="{at}" x2="{LEFT}" y2="{at}"/>')
        labels.append(
            f'<text x="{LEFT - 5}" y="{y(10.0**d) + 3:.1f}" text-anchor="end">'
            f"{_flops_tick(d)}</text>"
        )
    px, py = x(line.intensity), y(line.achieved)
    label = html.escape(
        f"roofline: {_number(line.intensity)} FLOP/B at "
        f"{format_rate(line.achieved, 'FLOP/s')}; ridge at {_number(ridge)} FLOP/B; "
        f"{line.bound}"
    )
    anchor = "end" if px > LEFT + plot_w * 0.6 else "start"
    dx = -10 if anchor == "end" else 10
    # The rate's label goes above the point, or below it where the roof runs just above
    # (a point near the roof), so the roof never strikes through it.
    roof_y = y(min(peak, bandwidth * line.intensity))
    label_y = py - 10 if py - roof_y > 18 else py + 18
    return (
        f'<svg class="gpumagic-roofline" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{label}" '
        'style="display:block;margin:4px 0;color:inherit;fill:currentColor;'
        'stroke:currentColor;font-size:10px;font-family:inherit">'
        f'<polygon points="{area}" style="fill-opacity:0.08;stroke:none"/>'
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" '
        'style="fill:none;stroke-opacity:0.35"/>'
        f'<polyline points="{path}" style="fill:none;stroke-width:2"/>'
        f'<line x1="{x(ridge):.1f}" y1="{TOP}" x2="{x(ridge):.1f}" y2="{bottom}" '
        'style="stroke-dasharray:3 3;stroke-opacity:0.6"/>'
        f'<g style="stroke-opacity:0.6;stroke-width:1">{"".join(ticks)}</g>'
        f'<g style="stroke:none">{"".join(labels)}'
        f'<text x="2" y="10">FLOP/s</text></g>'
        f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4.5" style="fill-opacity:0.85;stroke:none"/>'
        f'<circle cx="{px:.1f}" cy="{py:.1f}" r="8" style="fill:none;stroke-width:1.2"/>'
        f'<text x="{px + dx:.1f}" y="{label_y:.1f}" text-anchor="{anchor}" '
        f'style="stroke:none">{html.escape(format_rate(line.achieved, "FLOP/s"))}</text>'
        f'<text x="{x(ridge) + 3:.1f}" y="{TOP + 11}" style="stroke:none">ridge</text>'
        f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 4}" text-anchor="middle" '
        'style="stroke:none">FLOP per byte</text>'
        "</svg>"
    )


def _power(d: int) -> str:
    return f"{10.0**d:g}" if -2 <= d <= 3 else f"1e{d}"


def _flops_tick(d: int) -> str:
    return format_rate(10.0**d, "").replace(" ", "")
