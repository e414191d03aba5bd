"""The ``%%gpumem --timeline`` picture renders in a real browser, light and dark.

The result's HTML (the cell's table, the SVG, the table at the peak) is built from
allocator events shaped like torch's (the timeline's reference cell: 256 MiB kept, a
1 GiB temporary), then checked the way ``test_html_render.py`` checks the demo
notebook's outputs: every text visible, contrast at least 4.5:1 against what it is
drawn on, and nothing in it that would load from the network (no script, link, ``src``,
``href`` or ``url()``). With
``GPUMAGIC_SCREENSHOT_DIR=docs/_static/screenshots`` the screenshots are kept.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest

from browser import CHROMIUM
from gpumagic.cuda import AllocatorStats
from gpumagic.memory_cell import CellDeviceChange, CellMemoryReport
from gpumagic.memory_result import CellMemResult
from gpumagic.memory_timeline import build_timeline
from test_html_render import THEMES, keep_screenshot, render

if TYPE_CHECKING:
    from pathlib import Path

    from browser import Browser

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium is not installed (Debian package 'chromium')"
)

MiB = 2**20
GiB = 2**30
CELL = "<ipython-input-3-abc>"
SOURCES = {
    1: "keep = torch.empty(256 * 2**20, dtype=torch.uint8, device='cuda')",
    2: "tmp = torch.empty(2**30, dtype=torch.uint8, device='cuda')",
    4: "y = helper(keep) @ w",
}


def result() -> CellMemResult:
    events = []
    now = 1_000

    def add(action: str, addr: int, size: int, line: int) -> None:
        nonlocal now
        now += 10
        events.append(
            {
                "action": action,
                "addr": addr,
                "size": size,
                "time_us": now,
                "frames": [{"filename": CELL, "line": line, "name": "<module>"}],
            }
        )

    add("segment_alloc", 1, 256 * MiB, 1)
    add("alloc", 1, 256 * MiB, 1)
    for i in range(40):  # small temporaries
        add("alloc", 100 + i, 2 * MiB, 4)
        add("free_requested", 100 + i, 2 * MiB, 4)
    add("segment_alloc", 2, GiB, 2)
    add("alloc", 2, GiB, 2)
    add("alloc", 3, 8 * MiB, 4)
    add("free_requested", 2, GiB, 3)
    start = AllocatorStats(allocated=20 * MiB, reserved=22 * MiB, requested=20 * MiB)
    end = AllocatorStats(
        allocated=284 * MiB,
        reserved=22 * MiB + 256 * MiB + GiB,
        peak_allocated=284 * MiB + GiB,
        requested=284 * MiB,
    )
    timeline = build_timeline(
        events,
        device=0,
        start_allocated=start.requested,
        start_reserved=start.reserved,
        end_allocated=end.requested,
        cell_files=frozenset({CELL}),
        where=lambda filename, line: f"In[3] line {line}",
        source=lambda filename, line: SOURCES.get(line, ""),
    )
    change = CellDeviceChange(0, "NVIDIA H100 80GB HBM3", start, end, peak=end.peak_allocated)
    return CellMemResult(CellMemoryReport("In[3]", (change,), timelines=(timeline,)))


def test_the_timeline_is_self_contained() -> None:
    body = result()._repr_html_()
    assert "<svg " in body
    external = re.findall(
        r"""(?:src|href)\s*=\s*["']?(?:https?:)?//|@import|url\(|<script|<link""", body, re.I
    )
    assert not external


@pytest.mark.parametrize("theme", sorted(THEMES))
def test_the_timeline_renders_visible_and_readable(
    browser: Browser, theme: str, tmp_path: Path
) -> None:
    report, shot = render(browser, "gpumem-timeline", result()._repr_html_(), theme, tmp_path)
    assert shot.stat().st_size > 1000
    assert report["texts"] >= 20  # the tables, the axes, the peak and the legend
    assert not report["invisible"], report["invisible"]
    assert not report["low_contrast"], report["low_contrast"]
    assert report["min_contrast"] >= 4.5
    keep_screenshot(shot)
