"""Screenshots of built docs pages at 1280 px wide, in furo's light and dark themes.

    python -m sphinx -b html docs /tmp/docs-html
    python scripts/docs_screenshots.py /tmp/docs-html docs/_static/screenshots

takes ``docs-<page>-<theme>.png`` of each page in ``PAGES`` (a ``/`` in a page's name
becomes ``-``), the whole page from top to bottom, with headless Chromium (``chromium``,
``chromium-browser`` or ``google-chrome`` on ``PATH``).

furo keeps the reader's theme in ``localStorage["theme"]`` and reads it at the start of
``<body>``. Each page is copied next to the original (so its relative links to
``_static`` still resolve) with one script before furo's that stores the theme; a first
Chromium run reads the page's height from the DOM, a second takes the screenshot at
that height. The copies are removed afterwards. Nothing is loaded from the network.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PAGES = ("index", "configuration", "howto/fix-a-leak")
THEMES = ("light", "dark")
WIDTH = 1280
MAX_HEIGHT = 16000
# The headless window keeps some pixels of its height for itself.
WINDOW_MARGIN = 100

# At the end of <body>: the page is laid out; the number is written into the DOM that
# --dump-dom prints.
HEIGHT_SCRIPT = (
    "<script>{ const p = document.createElement('pre'); p.id = 'page-height';"
    " p.textContent = String(document.documentElement.scrollHeight);"
    " document.body.appendChild(p); }</script>"
)


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    sys.exit("no chromium on PATH (Debian package 'chromium')")


def chromium(binary: str, profile: Path, *args: str) -> str:
    command = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        f"--user-data-dir={profile}",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout


def themed_copy(page: Path, theme: str, *, measure: bool) -> Path:
    """A copy of ``page`` beside it that opens in ``theme``."""
    text = page.read_text(encoding="utf-8")
    store = f"<script>localStorage.setItem('theme', '{theme}');</script>"
    text, count = re.subn(r"<body([^>]*)>", lambda m: m.group(0) + store, text, count=1)
    if not count:
        raise ValueError(f"{page}: no <body>")
    if measure:
        text = text.replace("</body>", HEIGHT_SCRIPT + "</body>", 1)
    copy = page.with_name(f".shot-{theme}-{'m' if measure else 's'}-{page.name}")
    copy.write_text(text, encoding="utf-8")
    return copy


def screenshot(binary: str, page: Path, theme: str, out: Path, profile: Path) -> None:
    measured = themed_copy(page, theme, measure=True)
    shown = themed_copy(page, theme, measure=False)
    try:
        dom = chromium(
            binary, profile, "--dump-dom", f"--window-size={WIDTH},2000", measured.as_uri()
        )
        match = re.search(r'<pre id="page-height">(\d+)</pre>', dom)
        height = min(int(match.group(1)) if match else 4000, MAX_HEIGHT)
        chromium(
            binary,
            profile,
            f"--screenshot={out}",
            f"--window-size={WIDTH},{height + WINDOW_MARGIN}",
            shown.as_uri(),
        )
    finally:
        measured.unlink(missing_ok=True)
        shown.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("html", type=Path, help="the built HTML docs (sphinx -b html)")
    parser.add_argument("out", type=Path, help="where the PNG files go")
    parser.add_argument("--pages", nargs="*", default=list(PAGES), help="pages, no .html")
    args = parser.parse_args(argv)
    binary = chromium_binary()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="docs-shots-") as tmp:
        for name in args.pages:
            page = args.html / f"{name}.html"
            for theme in THEMES:
                out = args.out / f"docs-{name.replace('/', '-')}-{theme}.png"
                # A fresh profile per theme: localStorage is per profile.
                screenshot(binary, page, theme, out.resolve(), Path(tmp) / theme)
                print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
