"""``%lprun`` tables: line_profiler's text layout (plus GPU and memory columns when
asked for), a self-contained HTML table with time bars, and the notes under them.

Without ``--gpu``/``--memory`` columns the text table *is* line_profiler's: it is
printed by ``LineStats.print``. With them, the same layout is rebuilt here (same
column widths, number formats and source lookup) with the extra columns inserted
before "Line Contents".
"""

from __future__ import annotations

import contextlib
import html
import io
import linecache
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from line_profiler.line_profiler import get_code_block, get_column_widths, is_generated_code
from line_profiler.toml_config import ConfigSource

from gpumagic.lineprof_notes import backward_column, line_gpu, notes, self_column
from gpumagic.units import format_bytes, format_time

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

    from gpumagic.lineprof import LineProfileResult
    from gpumagic.lineprof_attribution import LineGpu
    from gpumagic.lineprof_record import Label, LineExtras

__all__ = ["LineProfileDisplay", "cell_sources_kept", "render_html", "render_text"]

_SYNC_TITLE = (
    "the host waited for the GPU here: a synchronizing CUDA call "
    "(.item(), .cpu(), printing a tensor, nonzero(), ...)"
)


def _signed_bytes(n: int) -> str:
    return "0 B" if n == 0 else ("+" if n > 0 else "") + format_bytes(n)


def _peak_text(extras: LineExtras) -> str:
    if extras.mem_hits == 0:
        return ""
    return ("≤" if extras.mem_peak_bound else "") + format_bytes(extras.mem_peak)


@contextlib.contextmanager
def cell_sources_kept() -> Iterator[None]:
    """Keep the sources that no file holds (IPython's and Jupyter's cells, kept in
    :mod:`linecache` with no modification time) while the block runs: line_profiler's
    table calls ``linecache.clearcache()`` before reading each real file, which would
    leave every cell without its source (the tables of cell functions printed after a
    file's function empty; "Could not get source" in later tracebacks). Within the
    block, ``linecache.clearcache`` clears everything else and keeps those entries; it
    is put back afterwards."""
    original = linecache.clearcache

    def clearcache() -> None:
        kept = _cell_entries()
        original()
        linecache.cache.update(kept)

    linecache.clearcache = clearcache
    try:
        yield
    finally:
        linecache.clearcache = original


def _cell_entries() -> dict[str, Any]:
    return {
        name: entry
        for name, entry in linecache.cache.items()
        if len(entry) == 4 and entry[1] is None  # not a lazy (1-tuple) entry
    }


def render_text(
    result: LineProfileResult, output_unit: float | None = None, stripzeros: bool = False
) -> str:
    """The text table (line_profiler's layout, its ``File:`` lines included) followed
    by the notes."""
    stream = io.StringIO()
    if result.gpu_columns or result.memory_columns:
        _show_text(result, stream, output_unit, stripzeros)
    else:
        with cell_sources_kept():
            result.stats.print(stream, output_unit=output_unit, stripzeros=stripzeros)
    text = stream.getvalue().rstrip()
    lines = notes(result)
    if lines:
        text += "\n\n" + "\n".join(f"* {line}" for line in lines)
    return text


# -- text, line_profiler's layout with extra columns ---------------------------------


def _show_text(
    result: LineProfileResult,
    stream: io.StringIO,
    output_unit: float | None,
    stripzeros: bool,
) -> None:
    unit = result.stats.unit
    stream.write("Timer unit: %g s\n\n" % (output_unit if output_unit is not None else unit))
    config = ConfigSource.from_config(None).path
    for label, timings in result.stats.timings.items():
        _show_func(
            result,
            label=label,
            timings=timings,
            output_unit=output_unit,
            stream=stream,
            stripzeros=stripzeros,
            config=config,
        )


def _source_lines(filename: str, start: int, linenos: list[int], stream: io.StringIO) -> list[str]:
    if os.path.exists(filename) or is_generated_code(filename):
        # Only a real file is refreshed (edited since: read it again). A cell's or
        # generated code's source lives only in linecache, and refreshing a name that
        # is not a file on disk would drop it.
        if os.path.isfile(filename):
            linecache.checkcache(filename)
        return list(get_code_block(filename, start))
    stream.write("\n")
    stream.write(f"Could not find file {filename}\n")
    stream.write("Are you sure you are running this program from the same directory\n")
    stream.write("that you ran the profiler from?\n")
    stream.write("Continuing without the function's contents.\n")
    count = 1 if not linenos else max(linenos) - min(*linenos, start) + 1
    return [""] * count


def _fit(value: float, width: int) -> str:
    text = f"{value:5.1f}"
    return text if len(text) <= width else f"{value:5.3g}"


def _show_func(  # noqa: PLR0915 (line_profiler's show_func, with more columns)
    result: LineProfileResult,
    *,
    label: Label,
    timings: list[tuple[int, int, int]],
    output_unit: float | None,
    stream: io.StringIO,
    stripzeros: bool,
    config: object,
) -> None:
    filename, start, name = label
    unit = result.stats.unit
    extras = result.extras.get(label, {})
    total_hits = sum(t[1] for t in timings)
    total_time = sum(t[2] for t in timings)
    if stripzeros and total_hits == 0:
        return
    scalar = unit / (output_unit if output_unit is not None else unit)
    seconds_scalar = 1.0 / (output_unit if output_unit is not None else unit)
    gpu = result.gpu_columns
    memory = result.memory_columns
    on_gpu = line_gpu(result, label)
    total_gpu_ns = sum(figures.total_ns for figures in on_gpu.values())
    own, backward = self_column(result), backward_column(result)

    stream.write("Total time: %g s\n" % (total_time * unit))
    if gpu:
        stream.write("Total GPU time: %g s\n" % (total_gpu_ns * 1e-9))
    if os.path.exists(filename) or is_generated_code(filename):
        stream.write(f"File: {filename}\n")
        stream.write(f"Function: {name} at line {start}\n")
    sublines = _source_lines(filename, start, [t[0] for t in timings], stream)

    configured = get_column_widths(config)
    widths: dict[str, int] = {
        col: max(width, configured.get(col, width)) for col, width in get_column_widths().items()
    }
    widths.update({"gpu": widths["time"], "gpupct": widths["percent"], "syncs": 6})
    widths.update({"self": widths["time"], "bwd": widths["time"]})
    widths.update({"mem": 10, "peak": 10})

    display: dict[int, tuple[str, ...]] = {}
    for lineno, nhits, duration in timings:
        percent = "" if total_time == 0 else f"{100 * duration / total_time:5.1f}"
        cells = [
            str(nhits) if len(str(nhits)) <= widths["hits"] else f"{nhits:g}",
            _fit(duration * scalar, widths["time"]),
            _fit(float(duration) * scalar / nhits, widths["perhit"]) if nhits else "",
            percent,
        ]
        extra = extras.get(lineno)
        if gpu:
            figures = on_gpu.get(lineno)
            if figures is not None:
                cells.append(_fit(figures.total_ns * 1e-9 * seconds_scalar, widths["gpu"]))
                share = 100 * figures.total_ns / total_gpu_ns if total_gpu_ns else 0.0
                cells.append(f"{share:5.1f}")
                if own:
                    cells.append(_fit(figures.self_ns * 1e-9 * seconds_scalar, widths["self"]))
                if backward:
                    bwd = figures.backward_total_ns * 1e-9 * seconds_scalar
                    cells.append(_fit(bwd, widths["bwd"]) if figures.backward_total_ns else "")
            else:
                cells += [""] * (2 + own + backward)
            cells.append(str(extra.syncs) if extra is not None and extra.syncs else "")
        if memory:
            if extra is not None and extra.mem_hits:
                cells += [_signed_bytes(extra.mem_delta), _peak_text(extra)]
            else:
                cells += ["", ""]
        display[lineno] = tuple(cells)

    order = ["line", "hits", "time", "perhit", "percent"]
    header = ["Line #", "Hits", "Time", "Per Hit", "% Time"]
    if gpu:
        order += ["gpu", "gpupct"] + ["self"] * own + ["bwd"] * backward + ["syncs"]
        header += ["GPU Time", "% GPU"] + ["Self"] * own + ["Bwd"] * backward + ["Syncs"]
    if memory:
        order += ["mem", "peak"]
        header += ["Mem Δ", "Peak"]
    for index, column in enumerate(order[1:]):
        longest = max((len(cells[index]) for cells in display.values()), default=0)
        widths[column] = max(widths[column], longest)

    template = " ".join("%" + str(widths[k]) + "s" for k in order) + "  %-s"
    header_line = template % (*header, "Line Contents")
    stream.write("\n")
    stream.write(header_line)
    stream.write("\n")
    stream.write("=" * len(header_line))
    stream.write("\n")
    empty = ("",) * (len(order) - 1)
    cells_of: tuple[str, ...]
    for lineno, line in zip(range(start, start + len(sublines)), sublines, strict=False):
        cells_of = display.get(lineno, empty)
        stream.write(template % (lineno, *cells_of, line.rstrip("\n").rstrip("\r")))
        stream.write("\n")
    stream.write("\n")


# -- HTML -------------------------------------------------------------------------------

_STYLE = """
.gm-lprun{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
.gm-lprun table{border-collapse:collapse;margin:4px 0 12px 0}
.gm-lprun th{text-align:right;padding:2px 8px;border-bottom:1px solid #999;white-space:nowrap}
.gm-lprun th.src{text-align:left}
.gm-lprun td{text-align:right;padding:1px 8px;white-space:nowrap}
.gm-lprun td.src{text-align:left;white-space:pre}
.gm-lprun tr.sync td{background:rgba(255,193,7,.16)}
.gm-lprun .head{margin:8px 0 2px 0}
.gm-lprun .warn{font-weight:bold;box-shadow:inset 0 -2px rgba(230,120,0,.9)}
.gm-lprun ul{margin:4px 0;padding-left:18px}
.gm-lprun td.pct{padding-right:2px}
.gm-lprun td.bar{text-align:left;padding-left:0;width:62px}
.gm-lprun td.bar span{display:inline-block;height:9px;border-radius:1px}
"""


def _bar(share: float, colour: str) -> str:
    """A percentage and its bar side by side: the bar has a cell width of its own, so it
    is never drawn over a number."""
    share = max(0.0, min(100.0, share))
    return (
        f'<td class="pct">{share:.1f}</td><td class="bar"><span style="width:{share * 0.6:.1f}px;'
        f'background:{colour}"></span></td>'
    )


def render_html(
    result: LineProfileResult,
    output_unit: float | None = None,
    stripzeros: bool = False,
    cells: Mapping[str, str] | None = None,
) -> str:
    """A self-contained HTML table per function, with bars for % Time and % GPU;
    ``cells``: the names notebook cells go by (``{filename: "In[2]"}``), shown instead
    of their files."""
    del output_unit  # HTML shows times in s/ms/µs, whatever the text unit is
    unit = result.stats.unit
    gpu = result.gpu_columns
    memory = result.memory_columns
    out = [f'<div class="gm-lprun"><style>{_STYLE}</style>']
    for label, timings in result.stats.timings.items():
        total_hits = sum(t[1] for t in timings)
        if stripzeros and total_hits == 0:
            continue
        filename, start, name = label
        extras = result.extras.get(label, {})
        on_gpu = line_gpu(result, label)
        total = sum(t[2] for t in timings)
        total_gpu_ns = sum(figures.total_ns for figures in on_gpu.values())
        summary = f"total {format_time(total * unit)}"
        if gpu:
            summary += f", GPU {format_time(total_gpu_ns * 1e-9)}"
        cell = (cells or {}).get(filename)
        where = f"{cell}, line {start}" if cell else f"{filename}:{start}"
        out.append(
            f'<div class="head"><b>{html.escape(name)}</b> — {html.escape(where)} — {summary}</div>'
        )
        headers = ["Line #", "Hits", "Time", "Per Hit", "% Time", ""]
        if gpu:
            headers += ["GPU Time", "% GPU", ""]
            headers += ["Self"] * self_column(result) + ["Bwd"] * backward_column(result)
            headers += ["Syncs"]
        if memory:
            headers += ["Mem Δ", "Peak"]
        out.append("<table><thead><tr>")
        out.extend(f"<th>{html.escape(h)}</th>" for h in headers)
        out.append('<th class="src">Line Contents</th></tr></thead><tbody>')
        rows = {line: (hits, duration) for line, hits, duration in timings}
        source = _html_source(filename, start, list(rows))
        for lineno, text in zip(range(start, start + len(source)), source, strict=False):
            out.append(
                _html_row(
                    lineno=lineno,
                    text=text,
                    rows=rows,
                    extras=extras,
                    on_gpu=on_gpu,
                    total=total,
                    total_gpu_ns=total_gpu_ns,
                    unit=unit,
                    result=result,
                )
            )
        out.append("</tbody></table>")
    lines = notes(result)
    if lines:
        out.append("<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in lines) + "</ul>")
    out.append("</div>")
    return "".join(out)


def _html_source(filename: str, start: int, linenos: list[int]) -> list[str]:
    if os.path.exists(filename) or is_generated_code(filename):
        found = list(get_code_block(filename, start))
        if found:
            return found
    count = 1 if not linenos else max(linenos) - min(*linenos, start) + 1
    return [""] * count


def _html_row(
    *,
    lineno: int,
    text: str,
    rows: dict[int, tuple[int, int]],
    extras: dict[int, LineExtras],
    on_gpu: dict[int, LineGpu],
    total: int,
    total_gpu_ns: int,
    unit: float,
    result: LineProfileResult,
) -> str:
    source = html.escape(text.rstrip("\n").rstrip("\r"))
    extra = extras.get(lineno)
    flagged = result.gpu_columns and extra is not None and extra.syncs > 0
    cells: list[str] = [f"<td>{lineno}</td>"]
    if lineno in rows:
        hits, duration = rows[lineno]
        share = 100 * duration / total if total else 0.0
        cells += [
            f"<td>{hits}</td>",
            f"<td>{format_time(duration * unit)}</td>",
            f"<td>{format_time(duration * unit / hits) if hits else ''}</td>",
            _bar(share, "#f4a261"),
        ]
    else:
        cells += ["<td></td>"] * 5
    if result.gpu_columns:
        figures = on_gpu.get(lineno)
        own, backward = self_column(result), backward_column(result)
        if figures is not None:
            share = 100 * figures.total_ns / total_gpu_ns if total_gpu_ns else 0.0
            cells += [f"<td>{format_time(figures.total_ns * 1e-9)}</td>", _bar(share, "#2a9d8f")]
            if own:
                cells.append(f"<td>{format_time(figures.self_ns * 1e-9)}</td>")
            if backward:
                bwd = figures.backward_total_ns
                cells.append(f"<td>{format_time(bwd * 1e-9) if bwd else ''}</td>")
        else:
            cells += ["<td></td>"] * (3 + own + backward)
        if flagged:
            assert extra is not None
            cells.append(
                f'<td class="warn" title="{html.escape(_SYNC_TITLE)}">⚠ {extra.syncs}</td>'
            )
        else:
            cells.append("<td></td>")
    if result.memory_columns:
        if extra is not None and extra.mem_hits:
            cells += [f"<td>{_signed_bytes(extra.mem_delta)}</td>", f"<td>{_peak_text(extra)}</td>"]
        else:
            cells += ["<td></td>"] * 2
    row_class = ' class="sync"' if flagged else ""
    return f'<tr{row_class}>{"".join(cells)}<td class="src">{source}</td></tr>'


@dataclass
class LineProfileDisplay:
    """What ``%lprun`` displays: HTML with time bars, and line_profiler's text table."""

    result: LineProfileResult
    output_unit: float | None = None
    stripzeros: bool = False
    #: ``{filename: "In[2]"}`` for the notebook cells among the profiled files.
    cells: Mapping[str, str] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return render_text(self.result, self.output_unit, self.stripzeros)

    def _repr_html_(self) -> str:
        return render_html(self.result, self.output_unit, self.stripzeros, self.cells)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.text)

    def __repr__(self) -> str:
        return self.text
