"""Every output a page quotes says where and when it was made (issue 29).

A ```` ```text ```` block that quotes what a magic or the plugin printed about a GPU
(device names, ``cuda:N``, GPU times, leak and poison reports) must have a device and a
date in its own section (from its heading to the block), or in a page-wide statement
("The outputs on this page come from ..."). An output that no GPU run made says so
instead: *simulated* (the fake NVML or allocator of the tests) or *a format example*.
Measured figures in prose are ``tests/test_doc_figures.py``'s.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    page
    for page in sorted([*ROOT.glob("docs/*.md"), *ROOT.glob("docs/howto/*.md")])
    if page.name != "changelog.md"
]
FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
GPU_OUTPUT = re.compile(r"cuda:\d|GPU time|NVIDIA|CUDA memory|LEAKED|sticky CUDA|CUDA error")
DEVICE = re.compile(r"\b(?:H100|H200|A100|NVIDIA)\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
NOT_MEASURED = re.compile(r"\bsimulated\b|\ba\s+format\s+example\b")
PAGE_WIDE = re.compile(r"(?:outputs|messages)[^\n]{0,40}\n?[^\n]{0,40}(?:on this page|below)")


def said(text: str) -> bool:
    return bool(NOT_MEASURED.search(text) or (DEVICE.search(text) and DATE.search(text)))


def unlabelled(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    paragraphs = text.split("\n\n")
    page_wide = any(PAGE_WIDE.search(p) and said(p) for p in paragraphs)
    found = []
    for block in FENCE.finditer(text):
        body = block.group("body")
        if block.group("info").strip() != "text" or not GPU_OUTPUT.search(body):
            continue
        before = text[: block.start()]
        heading = max((h.end() for h in re.finditer(r"^#{1,6} .*$", before, re.M)), default=0)
        if page_wide or said(before[heading:]):
            continue
        line = before.count("\n") + 1
        found.append(f"{page.relative_to(ROOT)}:{line}: {body.splitlines()[0][:60]!r}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_quoted_output_says_its_device_and_date(page: Path) -> None:
    found = unlabelled(page)
    assert not found, "say the device and date (or simulated) of:\n" + "\n".join(found)
