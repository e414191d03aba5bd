"""Every HTML output of the demo notebook renders in a real browser, light and dark.

Headless Chromium (Debian's ``chromium``; ``.ci/run`` installs it; one for the session,
see ``browser.py``) loads each ``text/html`` output alone in a page of its own, once
with a light and once with a dark theme, takes a screenshot, and a script in the page
reports which text elements are invisible or hard to read (WCAG contrast under 4.5:1
against the background they are drawn on).
The outputs come from the notebook executed here (CPU) and, when present, from
``docs/demo-gpu.ipynb`` (executed on the GPU machine). With
``GPUMAGIC_SCREENSHOT_DIR=docs/_static/screenshots`` the screenshots are kept.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from browser import CHROMIUM

if TYPE_CHECKING:
    from browser import Browser

ROOT = Path(__file__).resolve().parents[1]
GPU_NOTEBOOK = ROOT / "docs" / "demo-gpu.ipynb"
pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="headless Chromium is not installed "
        "(Debian package 'chromium'; .ci/run installs it)",
    ),
    pytest.mark.xdist_group("demo_notebook"),  # the worker that executed the notebook
]

THEMES = {
    "light": "color-scheme: light; background: #ffffff; color: #1f2328;",
    "dark": "color-scheme: dark; background: #1e1e1e; color: #d4d4d4;",
}
MIN_CONTRAST = 4.5
WIDTH = 1000  # px: the page's width
MAX_HEIGHT = 4100  # px: the tallest viewport a page is checked and photographed in

# Runs in the page: for each element holding text, is it visible, and how well does
# its colour stand out from the backgrounds composited beneath it?
CHECK_SCRIPT = """
<script>
function rgba(c) {
  const p = c.match(/[\\d.]+/g).map(Number);
  return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1];
}
function lum(c) {
  const f = v => {
    v /= 255;
    return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4);
  };
  return 0.2126 * f(c[0]) + 0.7152 * f(c[1]) + 0.0722 * f(c[2]);
}
function over(top, base) {
  return [0, 1, 2].map(i => top[i] * top[3] + base[i] * (1 - top[3]));
}
function background(el) {
  const chain = [];
  for (let e = el; e; e = e.parentElement) chain.unshift(e);
  let bg = [255, 255, 255];
  for (const e of chain) bg = over(rgba(getComputedStyle(e).backgroundColor), bg);
  return bg;
}
const box = document.getElementById('output').getBoundingClientRect();
const out = {texts: 0, invisible: [], low_contrast: [], min_contrast: 99,
             height: Math.ceil(box.bottom) + 16};
for (const el of document.querySelectorAll('#output *')) {
  const own = [...el.childNodes].filter(n => n.nodeType === 3 && n.textContent.trim());
  // An SVG <title> is the hover text of its parent shape, never drawn itself.
  if (!own.length || ['STYLE', 'SCRIPT', 'TEMPLATE', 'title'].includes(el.tagName)) continue;
  const text = own.map(n => n.textContent.trim()).join(' ').slice(0, 60);
  const style = getComputedStyle(el);
  const rect = el.getBoundingClientRect();
  out.texts += 1;
  if (rect.width < 1 || rect.height < 1 || style.visibility === 'hidden' ||
      style.display === 'none' || Number(style.opacity) === 0) {
    out.invisible.push(text); continue;
  }
  const bg = background(el);
  const fg = over(rgba(style.color), bg);
  const [a, b] = [lum(fg), lum(bg)].sort((x, y) => y - x);
  const ratio = (a + 0.05) / (b + 0.05);
  out.min_contrast = Math.min(out.min_contrast, ratio);
  if (ratio < MIN_CONTRAST) out.low_contrast.push(text + ' (' + ratio.toFixed(2) + ':1)');
}
document.getElementById('report').textContent = JSON.stringify(out);
</script>
""".replace("MIN_CONTRAST", str(MIN_CONTRAST))


def html_outputs(book: dict[str, Any], origin: str) -> list[tuple[str, str]]:
    found = []
    for cell in book["cells"]:
        if cell["cell_type"] != "code":
            continue
        for k, output in enumerate(cell.get("outputs", [])):
            page = output.get("data", {}).get("text/html")
            if page:
                body = "".join(page) if isinstance(page, list) else page
                found.append((f"{origin}-{cell.get('id', 'cell')}-{k}", body))
    return found


def render(
    browser: Browser, name: str, body: str, theme: str, workdir: Path
) -> tuple[dict[str, Any], Path]:
    """Load one output alone in a page: the check script's report, and a screenshot.

    The check runs in a viewport tall enough for any output; the screenshot is taken at
    the output's own height.
    """
    page = workdir / f"{name}-{theme}.html"
    page.write_text(
        f"<!doctype html><html style='{THEMES[theme]}'><head><meta charset='utf-8'>"
        f"<title>{html.escape(name)}</title></head>"
        f"<body style='margin:16px;font-family:sans-serif;font-size:14px'>"
        f"<div id='output'>{body}</div><pre id='report' style='display:none'></pre>"
        f"{CHECK_SCRIPT}</body></html>"
    )
    shot = workdir / f"{name}-{theme}.png"
    with browser.page(page.as_uri(), width=WIDTH, height=MAX_HEIGHT) as tab:
        text = browser.evaluate(tab, "document.getElementById('report').textContent")
        assert text, f"the check script did not run for {name}"
        report: dict[str, Any] = json.loads(text)
        height = min(max(int(report["height"]), 120), MAX_HEIGHT)
        browser.resize(tab, width=WIDTH, height=height)
        browser.screenshot(tab, shot)
    return report, shot


def keep_screenshot(shot: Path) -> None:
    """Copy ``shot`` into ``GPUMAGIC_SCREENSHOT_DIR`` when it is set."""
    if folder := os.environ.get("GPUMAGIC_SCREENSHOT_DIR"):
        Path(folder).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(folder) / shot.name)


def outputs_to_check(executed_demo: dict[str, Any]) -> list[tuple[str, str]]:
    outputs = html_outputs(executed_demo, "cpu")
    if GPU_NOTEBOOK.exists():
        import nbformat

        outputs += html_outputs(dict(nbformat.read(GPU_NOTEBOOK, as_version=4)), "gpu")
    return outputs


def test_html_outputs_are_self_contained(executed_demo: dict[str, Any]) -> None:
    for name, body in outputs_to_check(executed_demo):
        external = re.findall(
            r"""(?:src|href)\s*=\s*["']?(?:https?:)?//|@import|url\(\s*["']?(?:https?:)?//""",
            body,
            re.I,
        )
        assert not external, f"{name} loads something from the network: {external}"


@pytest.mark.parametrize("theme", sorted(THEMES))
def test_html_outputs_render_visible_and_readable(
    executed_demo: dict[str, Any], browser: Browser, theme: str, tmp_path: Path
) -> None:
    outputs = outputs_to_check(executed_demo)
    if not outputs:
        pytest.skip("the demo notebook produced no HTML output")
    problems = []
    for name, body in outputs:
        report, shot = render(browser, name, body, theme, tmp_path)
        assert shot.stat().st_size > 1000, f"empty screenshot for {name}"
        if report["texts"] == 0:
            problems.append(f"{name}: no text rendered")
        if report["invisible"]:
            problems.append(f"{name}: invisible text {report['invisible'][:5]}")
        if report["low_contrast"]:
            problems.append(f"{name}: hard to read in {theme} {report['low_contrast'][:5]}")
        keep_screenshot(shot)
    assert not problems, "\n".join(problems)
