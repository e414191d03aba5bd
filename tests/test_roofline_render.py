"""The ``%cudatime`` roofline renders in a real browser, light and dark: visible, readable
(contrast of 4.5:1 or more), nothing loaded from the network.

The results are built from the figures of a 4096³ bf16 matmul and an elementwise add on
an H100, so the chart is checked on any machine; the GPU check's notebook adds the
measured ones (``test_html_render.py``). With
``GPUMAGIC_SCREENSHOT_DIR=docs/_static/screenshots`` the screenshots are kept.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest

from browser import CHROMIUM
from gpumagic.timing_result import CudaTimeResult
from test_html_render import THEMES, keep_screenshot, render

if TYPE_CHECKING:
    from pathlib import Path

    from browser import Browser

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium is not installed (Debian package 'chromium')"
)


def h100(label: str, flops: float, nbytes: float, seconds: float) -> CudaTimeResult:
    runs = [seconds * 100 * (1 + i / 1000) for i in range(12)]
    return CudaTimeResult(
        loops=100,
        repeat=len(runs),
        all_runs=runs,
        host_runs=runs,
        label=label,
        device_name="NVIDIA H100 80GB HBM3",
        flops=flops,
        bytes=nbytes,
        flops_counted=True,
        bytes_counted=True,
        flops_dtype="bf16",
        peak_flops=989.4e12,
        peak_flops_basis="dense bf16 tensor-core peak",
        peak_bytes_per_s=3.35e12,
    )


RESULTS = {
    "roofline-matmul": h100("a @ b", 2 * 4096**3, 3 * 4096**2 * 2, 200e-6),
    "roofline-add": h100("x + y", 2**26, 3 * 2**27, 130e-6),
}


@pytest.mark.parametrize("theme", sorted(THEMES))
@pytest.mark.parametrize("name", sorted(RESULTS))
def test_the_roofline_renders_visible_and_readable(
    browser: Browser, name: str, theme: str, tmp_path: Path
) -> None:
    body = RESULTS[name]._repr_html_()
    assert '<svg class="gpumagic-roofline"' in body
    assert not re.search(r"(?:src|href)\s*=|@import|url\(|https?:", body)
    report, shot = render(browser, name, body, theme, tmp_path)
    assert shot.stat().st_size > 1000
    assert report["texts"] > 10
    assert not report["invisible"], report["invisible"]
    assert not report["low_contrast"], report["low_contrast"]
    assert report["min_contrast"] >= 4.5
    keep_screenshot(shot)
