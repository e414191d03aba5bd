"""The text of ``%gpumem`` results: the ladder of each device, who holds the memory, what
a cell changed and the lines that allocated it, ``%gpumem watch``'s line. Pure
functions over the reports of :mod:`gpumagic.memory`; the HTML is in
:mod:`gpumagic.memory_result`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpumagic.memory import CONTEXT_NOTE
from gpumagic.memory_timeline import timeline_lines
from gpumagic.units import format_bytes, wrap_text

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gpumagic.memory import DeviceMemory, MemoryReport, PeakReset
    from gpumagic.memory_cell import CellDeviceChange, CellMemoryReport
    from gpumagic.stacks import TraceLine


__all__ = [
    "cell_notes",
    "change_rows",
    "device_notes",
    "device_rows",
    "format_cell_report",
    "format_report",
    "format_watch_line",
    "holder_rows",
    "holder_summary",
    "released_texts",
    "reset_note",
    "trace_rows",
]


def _b(n: int | None) -> str:
    return "n/a" if n is None else format_bytes(n)


def _signed(n: int) -> str:
    return ("+" if n >= 0 else "") + format_bytes(n)


def _row(label: str, value: str, comment: str = "") -> str:
    return f"  {label:<28}{value:>11}   {comment}".rstrip()


def device_rows(state: DeviceMemory) -> list[tuple[str, str, str]]:
    """``(label, value, comment)`` rows of one device's ladder (text and HTML share them)."""
    rows: list[tuple[str, str, str]] = []
    if state.torch_initialized and state.allocated is not None:
        rows.append(
            ("allocated by tensors", _b(state.allocated), f"peak {_b(state.peak_allocated)}")
        )
        rows.append(
            (
                "+ cached by torch",
                _b(state.cached),
                f"= reserved {_b(state.reserved)} (free for torch to reuse)",
            )
        )
    if state.processes is not None:
        mine = state.this_process
        if state.torch_initialized and state.self_listed:
            rows.append(
                (
                    "+ CUDA context, libraries",
                    _b(state.outside_allocator),
                    "this process, outside torch's allocator",
                )
            )
        if state.self_listed:
            rows.append((f"= this process (pid {state.pid})", _b(mine), "as nvidia-smi shows it"))
        elif not state.torch_initialized:
            rows.append(
                (
                    f"this process (pid {state.pid})",
                    "0 B",
                    "CUDA not initialised here: no context, nothing held",
                )
            )
        others = state.others
        listing = ", ".join(f"pid {p.pid} {_b(p.used)}" for p in others[:4])
        if len(others) > 4:
            listing += f", {len(others) - 4} more"
        rows.append((f"+ other processes ({len(others)})", _b(state.others_used), listing))
        rows.append(
            (
                "+ not charged to a process",
                _b(state.unattributed),
                "driver, processes this container cannot see",
            )
        )
    if state.device_used is not None:
        extra = f"free {_b(state.device_free)}"
        if state.driver_reserved:
            extra += f", reserved by the driver {_b(state.driver_reserved)}"
        rows.append(("= device used", _b(state.device_used), extra))
    return rows


def _device_heading(state: DeviceMemory) -> str:
    total = f" · {format_bytes(state.total)}" if state.total else ""
    return f"{state.label} {state.name}{total}"


def device_notes(state: DeviceMemory) -> list[str]:
    """Notes that go with one device's figures."""
    notes = list(state.notes)
    if not state.torch_initialized:
        notes.insert(
            0,
            "torch has not initialised CUDA in this process; these figures come from "
            f"NVML, and gpumem created no context to read torch's ({CONTEXT_NOTE})",
        )
    return notes


def format_report(report: MemoryReport) -> str:
    """``%gpumem`` as aligned text."""
    if report.unavailable:
        return f"gpumem: {report.unavailable}"
    lines = [f"gpumem: {report.summary}"]
    lines.extend(_released_lines(report))
    for state in report.devices:
        lines.append(_device_heading(state))
        lines.extend(_row(*row) for row in device_rows(state))
        lines.extend(f"  note: {n}" for n in device_notes(state))
    lines.extend(f"note: {reset_note(r)}" for r in report.peak_resets)
    if report.scan is not None:
        lines.extend(_holder_lines(report))
    lines.extend(f"note: {n}" for n in report.notes)
    return "\n".join(lines)


def reset_note(reset: PeakReset) -> str:
    return (
        f"cuda:{reset.device}'s peak counter was reset by %gpumem for {reset.label}; "
        f"the peak before was {format_bytes(reset.peak_before)}"
    )


def released_texts(report: MemoryReport) -> list[str]:
    """One sentence per device for ``--gc`` / ``--empty-cache``."""
    found = []
    if report.gc_objects is not None:
        found.append(f"gc.collect() collected {report.gc_objects} objects")
    for r in report.released:
        parts = []
        if r.gc_freed is not None:
            parts.append(f"gc freed {_b(r.gc_freed)} of tensors (kept in torch's cache)")
        if r.cache_released is not None:
            parts.append(f"empty_cache() returned {_b(r.cache_released)} to the driver")
        if r.process_released is not None:
            parts.append(f"this process now holds {_b(r.process_released)} less per NVML")
        if parts:
            found.append(f"cuda:{r.index}: " + "; ".join(parts))
    return found


def _released_lines(report: MemoryReport) -> list[str]:
    return [f"released: {t}" for t in released_texts(report)]


def holder_rows(report: MemoryReport) -> list[tuple[str, str, str, str, str]]:
    """``(size, name, shape, dtype, device)`` of the ``top`` largest holders."""
    if report.scan is None:
        return []
    rows = []
    for holder in report.scan.holders[: report.top]:
        name = holder.names[0]
        others = list(holder.names[1:])
        if others or holder.more_names:
            more = f" +{holder.more_names}" if holder.more_names else ""
            name += f" (also {', '.join(others)}{more})"
        shape = (
            "(" + ", ".join(map(str, holder.shape)) + ("," if len(holder.shape) == 1 else "") + ")"
        )
        rows.append((format_bytes(holder.nbytes), name, shape, holder.dtype, holder.device))
    return rows


def holder_summary(report: MemoryReport) -> list[str]:
    """The totals under the holder table."""
    scan = report.scan
    if scan is None:
        return []
    found = []
    for index, unreachable in report.unreachable:
        label = f"cuda:{index}"
        count = sum(1 for h in scan.holders if h.device == label)
        if not count and not unreachable:
            continue  # a device this process holds nothing on: nothing to say
        found.append(
            f"{label}: names reach {format_bytes(scan.reachable(label))} in {count} "
            f"storage{'' if count == 1 else 's'}; {format_bytes(unreachable)} is reachable "
            "from no name (autograd graphs, closures, library workspaces such as cuBLAS's, "
            "caches, other threads' tensors)"
        )
    if scan.truncated:
        found.append(f"the walk stopped after {scan.visited} objects; some names may be missing")
    return found


def _holder_lines(report: MemoryReport) -> list[str]:
    rows = holder_rows(report)
    scan = report.scan
    assert scan is not None
    lines = [
        f"Largest live CUDA tensors reachable from your names "
        f"({len(rows)} of {len(scan.holders)} storages):"
    ]
    if rows:
        header = ("size", "name", "shape", "dtype", "device")
        widths = [max(len(r[i]) for r in (*rows, header)) for i in range(5)]
        widths[1] = min(widths[1], 60)
        for row in (header, *rows):
            size, *rest = row
            cells = [f"{size:>{widths[0]}}"] + [
                f"{c:<{w}}" for c, w in zip(rest, widths[1:], strict=True)
            ]
            lines.append(("  " + "  ".join(cells)).rstrip())
    else:
        lines.append("  (no live CUDA tensor is reachable from a name)")
    for text in holder_summary(report):
        lines.extend(wrap_text(text, width=90, initial_indent="  ", subsequent_indent="  "))
    return lines


def change_rows(change: CellDeviceChange) -> list[tuple[str, str, str]]:
    """``(label, value, comment)`` rows of one device's change in a cell."""
    start, end = change.start, change.end
    rows = [
        (
            "allocated",
            _signed(change.allocated_delta),
            f"{format_bytes(start.allocated)} → {format_bytes(end.allocated)}",
        )
    ]
    if change.peak is not None:
        rows.append(
            (
                "peak",
                format_bytes(change.peak),
                f"{_signed(change.peak_above_start or 0)} above the start of the cell",
            )
        )
    else:
        rows.append(
            (
                "peak",
                f"≤ {format_bytes(change.peak_upper or 0)}",
                "not exact: --keep-peak left your higher earlier peak in the counter",
            )
        )
    rows.append(
        (
            "reserved",
            _signed(change.reserved_delta),
            f"{format_bytes(start.reserved)} → {format_bytes(end.reserved)}",
        )
    )
    if change.process_delta is not None:
        rows.append(
            (
                "this process",
                _signed(change.process_delta),
                f"→ {format_bytes(change.process_end or 0)} per NVML (CUDA context included)",
            )
        )
    return rows


def cell_notes(report: CellMemoryReport) -> list[str]:
    """Notes under a cell report."""
    notes = []
    if report.initialized_by_cell:
        notes.append(
            "this cell initialised CUDA: the context and library workspaces are outside "
            "torch's figures (see 'this process')"
        )
    for change in report.changes:
        if change.reset is not None:
            notes.append(
                f"{change.label}: to measure this peak the allocator's peak counters were "
                f"reset before the cell (they held {format_bytes(change.reset.peak_before)} "
                "from earlier); torch.cuda.max_memory_allocated() now counts from this "
                "cell. --keep-peak leaves them alone"
            )
    notes.extend(report.notes)
    return notes


def format_cell_report(report: CellMemoryReport) -> str:
    """``%%gpumem`` as aligned text."""
    if report.unavailable:
        return f"gpumem: {report.unavailable}"
    lines = []
    for change in report.shown:
        lines.append(f"%%gpumem {report.label} · {change.label} {change.name}")
        lines.extend(
            f"  {label:<13}{value:>12}   {comment}".rstrip()
            for label, value, comment in change_rows(change)
        )
    if report.trace is not None:
        lines.extend(_trace_lines(report.trace))
    for timeline in report.timelines or ():
        lines.extend(timeline_lines(timeline, f"cuda:{timeline.device}"))
    lines.extend(f"note: {n}" for n in cell_notes(report))
    return "\n".join(lines)


def trace_rows(trace: Sequence[TraceLine], limit: int = 20) -> list[tuple[str, str, str]]:
    """``(size, blocks, where and source)`` rows, largest first."""
    rows = []
    for t in trace[:limit]:
        text = t.where + (f" ({t.function})" if t.function and t.function != "<module>" else "")
        if t.source:
            text += f": {t.source}"
        if t.via:
            text += f"  [via {t.via}]"
        rows.append((format_bytes(t.nbytes), str(t.blocks), text))
    return rows


def _trace_lines(trace: Sequence[TraceLine]) -> list[str]:
    lines = ["Still allocated at the end of the cell, by the line that allocated it:"]
    if not trace:
        lines.append("  (nothing allocated in this cell is still alive)")
        return lines
    lines.append(f"  {'size':>10}  {'blocks':>6}  line")
    lines.extend(f"  {size:>10}  {blocks:>6}  {text}" for size, blocks, text in trace_rows(trace))
    if len(trace) > 20:
        rest = trace[20:]
        lines.append(f"  {format_bytes(sum(t.nbytes for t in rest)):>10}  {len(rest)} more lines")
    total = sum(t.nbytes for t in trace)
    blocks = sum(t.blocks for t in trace)
    lines.append(
        f"  {format_bytes(total):>10}  in all ({blocks} block{'' if blocks == 1 else 's'})"
    )
    return lines


def format_watch_line(report: CellMemoryReport) -> str:
    """``%gpumem watch``: one line per cell."""
    if report.unavailable:
        return f"gpumem {report.label}: {report.unavailable}"
    if not any(c.end.reserved or c.start.reserved for c in report.changes):
        return f"gpumem {report.label}: no CUDA memory in use by torch"
    parts = []
    for change in report.shown:
        if change.peak is not None:
            peak = f"peak {format_bytes(change.peak)} ({_signed(change.peak_above_start or 0)})"
        else:
            peak = f"peak ≤ {format_bytes(change.peak_upper or 0)}"
        parts.append(
            f"{change.label} allocated {_signed(change.allocated_delta)} → "
            f"{format_bytes(change.end.allocated)}, {peak}, reserved "
            f"{format_bytes(change.end.reserved)} ({_signed(change.reserved_delta)})"
        )
    return f"gpumem {report.label}: " + "; ".join(parts)
