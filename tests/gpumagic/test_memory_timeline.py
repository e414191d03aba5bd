"""The ``--timeline`` core: allocator events (shaped like ``torch.cuda.memory._snapshot()``'s
``device_traces``) → the series, the peak, the lines live at the peak, the sparkline and
the SVG. Plain calls, no torch."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from gpumagic.memory_svg import timeline_svg
from gpumagic.memory_timeline import (
    BEFORE_CELL,
    bands,
    build_timeline,
    envelope,
    sparkline,
    timeline_lines,
)

MiB = 2**20
GiB = 2**30
CELL = "<ipython-input-3-abc>"
TORCH = "/site-packages/torch/_tensor.py"


def frames(line: int, filename: str = CELL, name: str = "<module>") -> list[dict[str, Any]]:
    """An allocating stack, innermost first: torch's frame, then the user's line."""
    return [
        {"filename": TORCH, "line": 10, "name": "empty"},
        {"filename": filename, "line": line, "name": name},
        {"filename": "/site-packages/IPython/core/interactiveshell.py", "line": 3, "name": "run"},
    ]


class Events:
    """Builds a device's event ring, in torch's shape, one microsecond apart."""

    def __init__(self, start_us: int = 1_000_000) -> None:
        self.list: list[dict[str, Any]] = []
        self.now = start_us

    def add(self, action: str, addr: int, size: int, line: int | None = None) -> Events:
        self.now += 1
        self.list.append(
            {
                "action": action,
                "addr": addr,
                "size": size,
                "stream": 0,
                "time_us": self.now,
                "frames": frames(line) if line is not None else [],
            }
        )
        return self

    def alloc(self, addr: int, size: int, line: int) -> Events:
        return self.add("alloc", addr, size, line)

    def free(self, addr: int, size: int, line: int) -> Events:
        # torch records both; the allocated bytes drop at the request.
        return self.add("free_requested", addr, size, line).add("free_completed", addr, size, line)


def is_user(filename: str) -> bool:
    return "site-packages" not in filename


def where(filename: str, line: int) -> str:
    return f"In[3] line {line}" if filename == CELL else f"{filename}:{line}"


SOURCES = {2: "keep = torch.empty(256 * 2**20)", 3: "tmp = torch.empty(2**30)", 4: "del tmp"}


def source(filename: str, line: int) -> str:
    return SOURCES.get(line, "") if filename == CELL else ""


def keep_and_temporary(before: int = 4 * MiB) -> tuple[Events, dict[str, Any]]:
    """The done-when cell: keeps 256 MiB, makes and drops a 1 GiB temporary."""
    events = (
        Events()
        .add("segment_alloc", 0x1000, 256 * MiB)
        .alloc(0x1000, 256 * MiB, 2)
        .add("segment_alloc", 0x9000, GiB)
        .alloc(0x9000, GiB, 3)
        .free(0x9000, GiB, 4)
    )
    figures = {
        "start_allocated": before,
        "start_reserved": 20 * MiB,
        "end_allocated": before + 256 * MiB,
    }
    return events, figures


def timeline_of(events: Events, **figures: Any) -> Any:
    return build_timeline(
        events.list,
        device=0,
        cell_files=frozenset({CELL}),
        is_user=is_user,
        where=where,
        source=source,
        **figures,
    )


def test_the_series_follows_allocations_and_requested_frees() -> None:
    events, figures = keep_and_temporary()
    timeline = timeline_of(events, **figures)
    start = 4 * MiB
    assert timeline.allocated == (
        start,
        start,
        start + 256 * MiB,
        start + 256 * MiB,
        start + 256 * MiB + GiB,
        start + 256 * MiB,  # free_requested
        start + 256 * MiB,  # free_completed: no change
    )
    assert timeline.reserved[-1] == 20 * MiB + 256 * MiB + GiB
    assert timeline.complete
    assert timeline.events == 6
    assert timeline.times_us[1:] == tuple(e["time_us"] for e in events.list)


def test_the_peak_is_split_by_the_line_that_allocated_it() -> None:
    events, figures = keep_and_temporary()
    timeline = timeline_of(events, **figures)
    assert timeline.peak == 4 * MiB + 256 * MiB + GiB
    assert timeline.peak_index == 4
    assert [(t.where, t.nbytes, t.blocks) for t in timeline.at_peak] == [
        ("In[3] line 3", GiB, 1),
        ("In[3] line 2", 256 * MiB, 1),
    ]
    assert timeline.at_peak[0].source == "tmp = torch.empty(2**30)"
    assert timeline.before_cell == 4 * MiB


def test_memory_from_before_the_cell_freed_during_it_leaves_the_peak() -> None:
    events = Events().alloc(0x1, 8 * MiB, 2).free(0x77, 30 * MiB, 3).alloc(0x2, 8 * MiB, 4)
    timeline = timeline_of(
        events, start_allocated=40 * MiB, start_reserved=64 * MiB, end_allocated=26 * MiB
    )
    assert timeline.peak == 48 * MiB  # after the first allocation, before the free
    assert timeline.peak_index == 1
    assert timeline.before_cell == 40 * MiB
    assert timeline.allocated[-1] == 26 * MiB


def test_the_first_of_equal_peaks_is_marked() -> None:
    events = Events().alloc(0x1, MiB, 2).free(0x1, MiB, 3).alloc(0x2, MiB, 4)
    timeline = timeline_of(events, start_allocated=0, start_reserved=0, end_allocated=MiB)
    assert timeline.peak_index == 1


def test_events_before_the_cell_are_left_out_of_a_users_recording() -> None:
    events = Events(start_us=100).alloc(0x1, 64 * MiB, 1)  # before the cell, at 101
    events.now = 500
    events.alloc(0x2, MiB, 2)
    timeline = build_timeline(
        events.list,
        device=0,
        start_allocated=64 * MiB,
        start_reserved=64 * MiB,
        end_allocated=65 * MiB,
        start_us=400,
    )
    assert timeline.allocated == (64 * MiB, 65 * MiB)
    assert timeline.times_us[0] == 400
    assert timeline.complete


def test_a_ring_that_lost_the_cells_start_is_anchored_at_the_end() -> None:
    # The ring kept only the last two events: the 256 MiB allocation is gone.
    events, figures = keep_and_temporary()
    lost = Events()
    lost.list = events.list[-3:]
    timeline = timeline_of(lost, **figures)
    assert not timeline.complete
    assert timeline.allocated[-1] == figures["end_allocated"]
    assert timeline.peak == 4 * MiB + 256 * MiB + GiB
    assert [t.nbytes for t in timeline.at_peak] == [GiB]
    assert timeline.before_cell == 4 * MiB + 256 * MiB


def test_no_events_give_a_flat_line() -> None:
    timeline = build_timeline(
        [], device=1, start_allocated=5 * MiB, start_reserved=8 * MiB, end_allocated=5 * MiB
    )
    assert timeline.allocated == (5 * MiB,)
    assert timeline.events == 0
    assert timeline.peak == 5 * MiB
    assert timeline.at_peak == ()
    assert "(nothing was allocated)" not in "\n".join(timeline_lines(timeline, "cuda:1"))


def test_stacks_without_a_user_frame_and_other_cells_are_named() -> None:
    events = Events()
    events.list.append(
        {"action": "alloc", "addr": 1, "size": MiB, "time_us": 2, "frames": frames(1)[:1]}
    )
    events.list.append(
        {
            "action": "alloc",
            "addr": 2,
            "size": 2 * MiB,
            "time_us": 3,
            "frames": frames(7, "<ipython-input-1-def>", "make") + frames(5)[1:],
        }
    )
    timeline = timeline_of(events, start_allocated=0, start_reserved=0, end_allocated=3 * MiB)
    made, library = timeline.at_peak
    assert (made.where, made.function, made.via) == (
        "<ipython-input-1-def>:7",
        "make",
        "In[3] line 5",
    )
    assert library.where == "library code only"


def test_lines_beyond_the_top_ones_are_folded() -> None:
    events = Events()
    for line in range(1, 10):
        events.alloc(line, line * MiB, line)
    timeline = timeline_of(events, start_allocated=MiB, start_reserved=0, end_allocated=46 * MiB)
    found = bands(timeline, top=3)
    assert [b.label for b in found] == [
        "In[3] line 9",
        "In[3] line 8",
        "In[3] line 7",
        "other lines (6)",
        BEFORE_CELL,
    ]
    assert sum(b.nbytes for b in found) == timeline.peak
    assert found[0].title == "In[3] line 9 · 9.0 MiB"


def test_envelope_keeps_a_one_event_spike() -> None:
    values = [0] * 10_000
    values[7_777] = 5
    squeezed = envelope(values, 100)
    assert len(squeezed) == 100
    assert max(squeezed) == 5
    assert envelope([1, 2, 3], 100) == [1, 2, 3]


def test_sparkline_is_one_line_of_blocks_scaled_to_the_peak() -> None:
    line = sparkline([0, 10, 20, 80, 20], width=48)
    assert line == " ▁▂█▂".replace(" ", "▁")
    long = sparkline(list(range(1000)), width=40)
    assert len(long) == 40
    assert long[-1] == "█"
    assert set(long) <= set("▁▂▃▄▅▆▇█")
    assert sparkline([0, 0]) == "▁▁"


def test_the_terminal_view_has_the_sparkline_and_the_table_at_the_peak() -> None:
    events, figures = keep_and_temporary()
    text = "\n".join(timeline_lines(timeline_of(events, **figures), "cuda:0"))
    assert re.search(
        r"Timeline cuda:0 \(6 allocator events\): [▁-█]+  4\.0 MiB → peak 1\.3 GiB", text
    )
    assert "At the peak (event 4 of 6" in text
    assert "1.0 GiB       1  In[3] line 3: tmp = torch.empty(2**30)" in text
    assert "256.0 MiB       1  In[3] line 2: keep = torch.empty(256 * 2**20)" in text
    assert "4.0 MiB          allocated before the cell" in text


def test_to_dict_is_json_with_the_series_and_the_lines() -> None:
    events, figures = keep_and_temporary()
    data = json.loads(json.dumps(timeline_of(events, **figures).to_dict()))
    assert data["peak"] == max(data["allocated"])
    assert data["allocated"][data["peak_index"]] == data["peak"]
    assert len(data["allocated"]) == len(data["reserved"]) == len(data["time_us"]) == 7
    assert [(t["where"], t["nbytes"]) for t in data["at_peak"]] == [
        ("In[3] line 3", GiB),
        ("In[3] line 2", 256 * MiB),
    ]
    assert data["before_cell"] == 4 * MiB
    assert data["complete"] is True


# ---------------------------------------------------------------------------
# The SVG


def test_the_svg_is_self_contained() -> None:
    events, figures = keep_and_temporary()
    svg = timeline_svg(timeline_of(events, **figures), "cuda:0")
    assert svg.startswith("<svg ")
    assert svg.endswith("</svg>")
    for outside in ("<script", "href", "src=", "url(", "@import", "<style", "<foreignObject"):
        assert outside not in svg
    # Text takes the page's colour; no colour is fixed for it.
    assert "fill='currentColor'" in svg
    assert not re.search(r"<text[^>]*fill=", svg)


def test_each_band_has_a_hover_title_naming_the_line_and_size() -> None:
    events, figures = keep_and_temporary()
    svg = timeline_svg(timeline_of(events, **figures), "cuda:0")
    rects = re.findall(r"<rect [^>]*><title>([^<]*)</title></rect>", svg)
    assert rects[::-1] == [  # stacked from the bottom: before the cell first
        "In[3] line 3: tmp = torch.empty(2**30) · 1.0 GiB",
        "In[3] line 2: keep = torch.empty(256 * 2**20) · 256.0 MiB",
        "allocated before the cell · 4.0 MiB",
    ]
    assert "peak 1.3 GiB" in svg
    assert "stroke-dasharray='4 3'" in svg  # reserved


def test_source_text_is_escaped() -> None:
    SOURCES[5] = "y = a < b & c > '\"'"
    try:
        events = Events().alloc(0x1, MiB, 5)
        svg = timeline_svg(
            timeline_of(events, start_allocated=0, start_reserved=0, end_allocated=MiB), "cuda:0"
        )
    finally:
        del SOURCES[5]
    assert "a &lt; b &amp; c &gt; &#x27;&quot;&#x27;" in svg
    assert "a < b" not in svg


@pytest.mark.parametrize("count", [0, 1, 30_000])
def test_the_svg_stays_small_whatever_the_number_of_events(count: int) -> None:
    events = Events()
    for i in range(count // 2):
        events.alloc(i, MiB, 2).add("free_requested", i, MiB, 2)
    timeline = timeline_of(events, start_allocated=0, start_reserved=0, end_allocated=0)
    svg = timeline_svg(timeline, "cuda:0")
    assert len(svg) < 40_000
    assert svg.count("<polyline") == 2
