"""The ``%%gpumem --timeline`` picture: an inline, self-contained SVG.

Allocated bytes over the cell's allocator events (an area; reserved bytes as a dashed
line), the peak marked, and beside it, on the same scale, a bar of the memory live at
the peak split by the line that allocated it, each band with a ``<title>`` (the hover
text) naming the line and the size. No script, no stylesheet, font or link from
outside: text and axes take the page's colour (``currentColor``) and the fills are
mid-tone colours with some transparency, so the picture reads in light and dark themes,
in Jupyter, VS Code and exported HTML.

Pure: strings from a :class:`~gpumagic.memory_timeline.Timeline`.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from gpumagic.memory_timeline import BEFORE_CELL, bands, envelope
from gpumagic.units import format_bytes

if TYPE_CHECKING:
    from gpumagic.memory_timeline import Band, Timeline

__all__ = ["timeline_svg"]

WIDTH = 840
PLOT_LEFT, PLOT_RIGHT = 70, 440  # the area chart
BAR_LEFT, BAR_WIDTH = 462, 22  # the bar of the peak, on the chart's scale
LEGEND_LEFT = 500
TOP, PLOT_HEIGHT = 26, 150
ROW = 17  # legend row height
LABEL_CHARS = 44  # legend text is cut here; the hover title has all of it

ALLOCATED = "#4c78a8"
PEAK = "#e45756"
BAND_COLOURS = ("#f58518", "#54a24b", "#b279a2", "#4c78a8", "#e45756", "#72b7b2")
OTHER = "#9d755d"


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _cut(text: str, chars: int = LABEL_CHARS) -> str:
    return text if len(text) <= chars else text[: chars - 1] + "…"


def _colour(band: Band, index: int) -> str:
    if band.label == BEFORE_CELL:
        return "currentColor"
    if band.line is None:
        return OTHER
    return BAND_COLOURS[index % len(BAND_COLOURS)]


def timeline_svg(timeline: Timeline, label: str) -> str:
    """The SVG of one device's timeline (``label``: ``"cuda:0"``)."""
    parts: list[str] = []
    values = timeline.allocated
    reserved = timeline.reserved
    scale_top = max(1, timeline.peak, *reserved)
    plot_width = PLOT_RIGHT - PLOT_LEFT
    bottom = TOP + PLOT_HEIGHT

    def y(v: int) -> float:
        return bottom - PLOT_HEIGHT * v / scale_top

    # One step per point (memory holds its value until the next event).
    points = envelope(values, plot_width)
    lines = envelope(reserved, plot_width)
    step = plot_width / len(points)

    def x(i: int) -> float:
        return PLOT_LEFT + i * step

    def steps(series: list[int]) -> str:
        return " ".join(
            f"{x(i):.1f},{y(v):.1f} {x(i + 1):.1f},{y(v):.1f}" for i, v in enumerate(series)
        )

    # Axes and the scale.
    parts.append(
        f"<line x1='{PLOT_LEFT}' y1='{bottom}' x2='{PLOT_RIGHT}' y2='{bottom}' "
        "stroke='currentColor' stroke-opacity='0.5'/>"
        f"<line x1='{PLOT_LEFT}' y1='{TOP}' x2='{PLOT_LEFT}' y2='{bottom}' "
        "stroke='currentColor' stroke-opacity='0.5'/>"
    )
    for value in (0, scale_top // 2, scale_top):
        parts.append(
            f"<text x='{PLOT_LEFT - 6}' y='{y(value) + 4:.1f}' text-anchor='end'>"
            f"{_e(format_bytes(value))}</text>"
        )
    events = timeline.events
    axis = f"{events} allocator event{'' if events == 1 else 's'}" if events else "no events"
    parts.append(
        f"<text x='{(PLOT_LEFT + PLOT_RIGHT) / 2:.0f}' y='{bottom + 16}' "
        f"text-anchor='middle'>{_e(axis)} →</text>"
    )
    # Allocated (area) and reserved (dashed line).
    outline = steps(points)
    area = f"{PLOT_LEFT},{bottom} {outline} {PLOT_RIGHT},{bottom}"
    parts.append(
        f"<polygon points='{area}' fill='{ALLOCATED}' fill-opacity='0.45' stroke='none'>"
        "<title>allocated</title></polygon>"
        f"<polyline points='{outline}' fill='none' stroke='{ALLOCATED}' stroke-width='1.5'/>"
    )
    dashed = steps(lines)
    parts.append(
        f"<polyline points='{dashed}' fill='none' stroke='currentColor' "
        "stroke-opacity='0.7' stroke-dasharray='4 3' stroke-width='1'>"
        "<title>reserved by torch's allocator</title></polyline>"
    )
    # The peak.
    peak_at = timeline.peak_index * len(points) // len(values)
    px, py = x(peak_at) + step / 2, y(timeline.peak)
    parts.append(
        f"<line x1='{px:.1f}' y1='{py:.1f}' x2='{px:.1f}' y2='{bottom}' stroke='{PEAK}' "
        "stroke-dasharray='2 2'/>"
        f"<circle cx='{px:.1f}' cy='{py:.1f}' r='3.5' fill='{PEAK}'>"
        f"<title>peak {_e(format_bytes(timeline.peak))} at event {timeline.peak_index}"
        "</title></circle>"
        f"<text x='{min(max(px, PLOT_LEFT + 40), PLOT_RIGHT - 40):.1f}' y='{TOP - 8}' "
        f"text-anchor='middle' font-weight='600'>peak {_e(format_bytes(timeline.peak))}"
        "</text>"
    )
    # The bar at the peak and its legend.
    shown = bands(timeline)  # largest line first, before the cell last
    level = 0
    for index, band in reversed(list(enumerate(shown))):  # stacked from the bottom
        top_y, low_y = y(level + band.nbytes), y(level)
        level += band.nbytes
        opacity = "0.3" if band.label == BEFORE_CELL else "0.85"
        parts.append(
            f"<rect x='{BAR_LEFT}' y='{top_y:.1f}' width='{BAR_WIDTH}' "
            f"height='{max(0.5, low_y - top_y):.1f}' fill='{_colour(band, index)}' "
            f"fill-opacity='{opacity}'><title>{_e(band.title)}</title></rect>"
        )
    parts.append(
        f"<text x='{BAR_LEFT + BAR_WIDTH / 2}' y='{bottom + 16}' text-anchor='middle'>"
        "at peak</text>"
        f"<text x='{LEGEND_LEFT}' y='{TOP - 8}' font-weight='600'>live at the peak, "
        "by line</text>"
    )
    for index, band in enumerate(shown):
        row_y = TOP + 4 + index * ROW
        opacity = "0.3" if band.label == BEFORE_CELL else "0.85"
        text = band.title.rsplit(" · ", 1)[0]
        parts.append(
            f"<g><title>{_e(band.title)}</title>"
            f"<rect x='{LEGEND_LEFT}' y='{row_y}' width='10' height='10' "
            f"fill='{_colour(band, index)}' fill-opacity='{opacity}'/>"
            f"<text x='{LEGEND_LEFT + 15}' y='{row_y + 9}'>"
            f"<tspan font-weight='600'>{_e(format_bytes(band.nbytes))}</tspan> "
            f"{_e(_cut(text))}</text></g>"
        )
    if not shown:
        parts.append(f"<text x='{LEGEND_LEFT}' y='{TOP + 12}'>(nothing was allocated)</text>")
    height = max(bottom + 26, TOP + 4 + len(shown) * ROW + 8)
    described = (
        f"GPU memory allocated on {label} over {axis}: from "
        f"{format_bytes(values[0])} to a peak of {format_bytes(timeline.peak)}, "
        f"ending at {format_bytes(values[-1])}"
    )
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' role='img' viewBox='0 0 {WIDTH} {height}' "
        f"width='{WIDTH}' height='{height}' style='max-width:100%;height:auto;"
        "display:block;margin:4px 0' fill='currentColor' font-size='11' "
        f"font-family='inherit'><title>{_e(described)}</title>{''.join(parts)}</svg>"
    )
