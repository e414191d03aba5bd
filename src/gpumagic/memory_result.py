"""What ``%gpumem -o`` and ``%%gpumem -o`` return, and how the reports look.

:class:`GpuMemResult` and :class:`CellMemResult` wrap the reports of
:mod:`gpumagic.memory`: ``to_dict()`` for JSON, aligned text in terminals
(``_repr_pretty_``) and self-contained HTML in notebooks (``_repr_html_``: inline
styles only, no script, nothing fetched from the network; text takes the page's own
colours so it reads in light and dark themes).
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpumagic import memory, memory_cell, memory_text
from gpumagic.memory_svg import timeline_svg
from gpumagic.memory_timeline import peak_rows
from gpumagic.units import format_bytes

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["CellMemResult", "GpuMemResult"]

# Bar colours (segments carry no text; the legend's text uses the page's colour).
_COLOURS = {
    "allocated": "#4c78a8",
    "cached": "#9ecae9",
    "context": "#f58518",
    "others": "#e45756",
    "unattributed": "#bab0ac",
}
_BOX = "font-family:inherit;line-height:1.45;margin:2px 0 6px 0"
_CELL = "padding:1px 10px 1px 0;text-align:left;vertical-align:top;border:none"
_NUM = "padding:1px 10px 1px 0;text-align:right;font-variant-numeric:tabular-nums;border:none"


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _table(
    rows: Sequence[Sequence[str]], numeric: Sequence[int], header: Sequence[str] = ()
) -> str:
    parts = ["<table style='border-collapse:collapse;margin:2px 0'>"]
    if header:
        parts.append("<tr>")
        parts.extend(
            f"<th style='{_NUM if i in numeric else _CELL};font-weight:600'>{_e(h)}</th>"
            for i, h in enumerate(header)
        )
        parts.append("</tr>")
    for row in rows:
        parts.append("<tr>")
        parts.extend(
            f"<td style='{_NUM if i in numeric else _CELL}'>{_e(c)}</td>" for i, c in enumerate(row)
        )
        parts.append("</tr>")
    parts.append("</table>")
    return "".join(parts)


def _notes(notes: Sequence[str]) -> str:
    return "".join(f"<div style='margin:1px 0'>note: {_e(n)}</div>" for n in notes)


def _bar(state: memory.DeviceMemory) -> str:
    """Allocated / cached / context / other processes / unattributed within the total."""
    total = state.total
    if not total:
        return ""
    parts = [
        ("allocated", "allocated by tensors", state.allocated),
        ("cached", "cached by torch", state.cached),
        ("context", "CUDA context, libraries", state.outside_allocator),
        ("others", "other processes", state.others_used if state.processes is not None else None),
        ("unattributed", "not charged to a process", state.unattributed),
    ]
    shown = [(key, label, value) for key, label, value in parts if value]
    if not shown:
        return ""
    segments = "".join(
        f"<div title='{_e(label)}: {_e(format_bytes(value))}' "
        f"style='width:{max(0.3, 100 * value / total):.2f}%;background:{_COLOURS[key]}'></div>"
        for key, label, value in shown
        if value
    )
    described = ", ".join(f"{label} {format_bytes(value)}" for _, label, value in shown if value)
    legend = "".join(
        f"<span style='margin-right:12px;white-space:nowrap'><span style='display:inline-block;"
        f"width:10px;height:10px;margin-right:4px;background:{_COLOURS[key]}'></span>"
        f"{_e(label)} {_e(format_bytes(value))}</span>"
        for key, label, value in shown
        if value
    )
    return (
        f"<div role='img' aria-label='{_e(described)} of {_e(format_bytes(total))}' "
        "style='display:flex;width:100%;max-width:640px;height:14px;margin:3px 0;"
        "border:1px solid rgba(128,128,128,0.6);border-radius:3px;overflow:hidden'>"
        f"{segments}</div><div style='font-size:90%'>{legend}</div>"
    )


def report_html(report: memory.MemoryReport) -> str:
    """``%gpumem`` as HTML."""
    if report.unavailable:
        return f"<div style='{_BOX}'>gpumem: {_e(report.unavailable)}</div>"
    parts = [f"<div style='{_BOX}'>", f"<div>gpumem: {_e(report.summary)}</div>"]
    parts.extend(f"<div>released: {_e(t)}</div>" for t in memory_text.released_texts(report))
    for state in report.devices:
        heading = f"{state.label} {state.name}" + (
            f" · {format_bytes(state.total)}" if state.total else ""
        )
        parts.append(f"<div style='font-weight:600;margin-top:6px'>{_e(heading)}</div>")
        parts.append(_bar(state))
        parts.append(_table(memory_text.device_rows(state), numeric=(1,)))
        parts.append(_notes(memory_text.device_notes(state)))
    parts.append(_notes([memory_text.reset_note(r) for r in report.peak_resets]))
    if report.scan is not None:
        rows = memory_text.holder_rows(report)
        parts.append(
            "<div style='font-weight:600;margin-top:6px'>Largest live CUDA tensors reachable "
            f"from your names ({len(rows)} of {len(report.scan.holders)} storages)</div>"
        )
        if rows:
            parts.append(
                _table(rows, numeric=(0,), header=("size", "name", "shape", "dtype", "device"))
            )
        else:
            parts.append("<div>(no live CUDA tensor is reachable from a name)</div>")
        parts.extend(f"<div>{_e(t)}</div>" for t in memory_text.holder_summary(report))
    parts.append(_notes(report.notes))
    parts.append("</div>")
    return "".join(parts)


def cell_report_html(report: memory_cell.CellMemoryReport) -> str:
    """``%%gpumem`` as HTML."""
    if report.unavailable:
        return f"<div style='{_BOX}'>gpumem: {_e(report.unavailable)}</div>"
    parts = [f"<div style='{_BOX}'>"]
    for change in report.shown:
        parts.append(
            f"<div style='font-weight:600'>%%gpumem {_e(report.label)} · "
            f"{_e(change.label)} {_e(change.name)}</div>"
        )
        parts.append(_table(memory_text.change_rows(change), numeric=(1,)))
    if report.trace is not None:
        parts.append(
            "<div style='font-weight:600;margin-top:6px'>Still allocated at the end of the "
            "cell, by the line that allocated it</div>"
        )
        rows = memory_text.trace_rows(report.trace)
        if rows:
            parts.append(_table(rows, numeric=(0, 1), header=("size", "blocks", "line")))
        else:
            parts.append("<div>(nothing allocated in this cell is still alive)</div>")
    for timeline in report.timelines or ():
        label = f"cuda:{timeline.device}"
        parts.append(
            f"<div style='font-weight:600;margin-top:6px'>Timeline {_e(label)}: allocated "
            f"memory over the cell ({timeline.events} allocator events)</div>"
        )
        parts.append(timeline_svg(timeline, label))
        rows = peak_rows(timeline)
        if rows:
            parts.append(
                "<div style='margin-top:2px'>At the peak "
                f"({_e(format_bytes(timeline.peak))}), by line:</div>"
            )
            parts.append(_table(rows, numeric=(0, 1), header=("size", "blocks", "line")))
    parts.append(_notes(memory_text.cell_notes(report)))
    parts.append("</div>")
    return "".join(parts)


def _device_dict(state: memory.DeviceMemory) -> dict[str, Any]:
    return {
        "index": state.index,
        "name": state.name,
        "total": state.total,
        "torch_initialized": state.torch_initialized,
        "allocated": state.allocated,
        "cached": state.cached,
        "reserved": state.reserved,
        "peak_allocated": state.peak_allocated,
        "peak_reserved": state.peak_reserved,
        "requested": state.requested,
        "pid": state.pid,
        "this_process": state.this_process,
        "outside_allocator": state.outside_allocator,
        "other_processes": [{"pid": p.pid, "used": p.used} for p in state.others],
        "others_used": state.others_used if state.processes is not None else None,
        "unattributed": state.unattributed,
        "device_used": state.device_used,
        "device_free": state.device_free,
        "driver_reserved": state.driver_reserved,
        "notes": memory_text.device_notes(state),
    }


@dataclass(frozen=True)
class GpuMemResult:
    """What ``%gpumem -o`` returns: the figures of each device, and with ``--top`` the
    largest live CUDA tensors with the names that reach them."""

    #: What was read: every device's figures, the holders, what was released.
    report: memory.MemoryReport

    def to_dict(self) -> dict[str, Any]:
        """Plain data (bytes as ints; ``None`` where a figure is unknown here)."""
        report = self.report
        scan = report.scan
        return {
            "summary": report.summary,
            "unavailable": report.unavailable,
            "devices": [_device_dict(d) for d in report.devices],
            "holders": None
            if scan is None
            else [
                {
                    "names": list(h.names),
                    "nbytes": h.nbytes,
                    "device": h.device,
                    "shape": list(h.shape),
                    "dtype": h.dtype,
                    "tensors": h.tensors,
                }
                for h in scan.holders[: report.top]
            ],
            "unreachable": {f"cuda:{i}": n for i, n in report.unreachable},
            "released": [
                {
                    "index": r.index,
                    "gc_freed": r.gc_freed,
                    "cache_released": r.cache_released,
                    "process_released": r.process_released,
                }
                for r in report.released
            ],
            "gc_objects": report.gc_objects,
            "peak_resets": [
                {"device": r.device, "label": r.label, "peak_before": r.peak_before}
                for r in report.peak_resets
            ],
            "notes": list(report.notes),
        }

    def text(self) -> str:
        """Aligned text, as shown in a terminal."""
        return memory_text.format_report(self.report)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's RepresentationPrinter
        p.text(self.text())

    def _repr_html_(self) -> str:
        return report_html(self.report)

    def __str__(self) -> str:
        return self.text()


@dataclass(frozen=True)
class CellMemResult:
    """What ``%%gpumem -o`` returns: the cell's change per device (allocated, exact
    peak, reserved, this process), with ``--trace`` the lines behind what is left, and
    with ``--timeline`` the memory over the cell (``to_dict()["timeline"]``: one entry
    per device, see :meth:`~gpumagic.memory_timeline.Timeline.to_dict`)."""

    #: What the cell did: per device, the trace and the timelines.
    report: memory_cell.CellMemoryReport

    def to_dict(self) -> dict[str, Any]:
        """Plain data (bytes as ints; ``None`` where a figure is unknown here)."""
        report = self.report
        return {
            "label": report.label,
            "unavailable": report.unavailable,
            "initialized_by_cell": report.initialized_by_cell,
            "devices": [
                {
                    "index": c.index,
                    "name": c.name,
                    "allocated_start": c.start.allocated,
                    "allocated_end": c.end.allocated,
                    "allocated_delta": c.allocated_delta,
                    "peak": c.peak,
                    "peak_above_start": c.peak_above_start,
                    "peak_upper_bound": c.peak_upper,
                    "reserved_start": c.start.reserved,
                    "reserved_end": c.end.reserved,
                    "reserved_delta": c.reserved_delta,
                    "process_delta": c.process_delta,
                    "peak_counter_reset": c.reset is not None,
                    "peak_before_reset": c.reset.peak_before if c.reset else None,
                }
                for c in report.changes
            ],
            "trace": None if report.trace is None else [t.to_dict() for t in report.trace],
            "timeline": None
            if report.timelines is None
            else [t.to_dict() for t in report.timelines],
            "notes": memory_text.cell_notes(report),
        }

    def text(self) -> str:
        """Aligned text, as shown in a terminal."""
        return memory_text.format_cell_report(self.report)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's RepresentationPrinter
        p.text(self.text())

    def _repr_html_(self) -> str:
        return cell_report_html(self.report)

    def __str__(self) -> str:
        return self.text()
