"""The pages' structure: one title each, the gallery last in the navigation, option
tables that hold every option, no internal issue numbers in the prose.

No Sphinx build: these read the Markdown sources and the magics' own parsers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted([*DOCS.glob("*.md"), *DOCS.glob("howto/*.md")])
FENCE = re.compile(r"^(`{3,}|~{3,})[^\n]*\n.*?^\1\s*$", re.MULTILINE | re.DOTALL)
GALLERY = ("demo-gpu", "screenshots")


def prose(text: str) -> str:
    """The page without its fenced blocks (code, outputs, directives)."""
    return FENCE.sub("", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_a_page_has_one_title(page: Path) -> None:
    """A second ``#`` heading becomes a second entry in the navigation."""
    included = re.match(r"```\{include\} \.\./(\S+)", page.read_text())
    if included:  # changelog.md, contributing.md: the file they include has the title
        page = ROOT / included.group(1)
    titles = re.findall(r"^# .+$", prose(page.read_text()), re.MULTILINE)
    assert len(titles) == 1, f"{page.name}: {titles}"


def test_the_gallery_pages_come_last_in_the_navigation() -> None:
    index = (DOCS / "index.md").read_text()
    entries = [
        line.strip()
        for tree in re.findall(r"```\{toctree\}\n(.*?)```", index, re.DOTALL)
        for line in tree.splitlines()
        if line.strip() and not line.startswith(":")
    ]
    assert entries[-len(GALLERY) :] == list(GALLERY), entries
    assert entries[0] == "getting-started"


def test_the_gpumem_option_table_holds_every_option() -> None:
    from gpumagic.memory_magics import GpuMemMagics

    parser = GpuMemMagics.gpumem.parser  # type: ignore[attr-defined]
    options = {
        max(action.option_strings, key=len) for action in parser._actions if action.option_strings
    } - {"-h", "--help"}
    page = (DOCS / "gpumem.md").read_text()
    table = re.search(r"^\| option \| applies to \| effect \|\n((?:\|.*\n)+)", page, re.MULTILINE)
    assert table is not None, "gpumem.md lost its option table"
    listed = set(re.findall(r"^\| `(-[\w-]+)", table.group(1), re.MULTILINE))
    assert listed == options


def labels_from_results() -> set[str]:
    """Row labels with an issue number that the benchmarks wrote into their result files
    (a table shows them, and the prose may name the row)."""
    found: set[str] = set()
    for path in (ROOT / "benchmarks" / "results").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                found.update(
                    v for v in json.loads(line).values() if isinstance(v, str) and "issue " in v
                )
    return found


@pytest.mark.parametrize("page", [*PAGES, ROOT / "README.md"], ids=lambda p: p.name)
def test_no_internal_issue_numbers_in_the_prose(page: Path) -> None:
    """The project's own tracker is not where a reader can follow "issue 28"."""
    if page.name == "changelog.md":
        return
    text = " ".join(prose(page.read_text()).split())
    for label in labels_from_results():  # a row's label, named as the table shows it
        text = text.replace(re.sub(r"(issue \d+).*", r"\1", label), "")
    found = re.findall(r".{0,30}\bissues? \d+.{0,10}", text)
    assert not found, f"{page.name}: {found}"


#: The fixed words of each message docs/troubleshooting.md quotes, as the source writes
#: them (an f-string's parts between its fields).
TROUBLE_MESSAGES = (
    "no usable GPU",
    "CUDA unavailable: ",
    "was built without CUDA (a CPU-only build)",
    "no CUDA here: ",
    "no usable CUDA device here",
    "by pytest_cuda, but it is ",
    "now (changed by a conftest, plugin or ",
    "CUDA would start on the wrong devices",
    "remove the code that sets ",
    "itself, and ",
    " would pin the ",
    "workers too; use one of them",
    "CUDA memory released before judging (kept by design, not leaks)",
    " never finished",
    "A rank that never joins a collective leaves the others waiting in it: the ",
    "stacks above show where each rank was. Raise timeout= in the marker if the ",
    "): this time holds at that clock",
    "clocks drop under sustained load (power or thermal limits) and recover ",
)


def test_troubleshooting_quotes_the_messages_the_code_prints() -> None:
    page = " ".join((DOCS / "troubleshooting.md").read_text().split())
    source = "\n".join(p.read_text() for p in (ROOT / "src").rglob("*.py"))
    for words in TROUBLE_MESSAGES:
        assert words in source, f"the code no longer prints {words!r}"
        assert " ".join(words.split()) in page, f"troubleshooting.md lost {words!r}"
    for topic in ("no-gpu", "wrong-gpu", "leaked-cache", "hung-rank", "clock"):
        assert f"(trouble-{topic})=" in page


#: Figures once typed by hand with no result file behind them (or against the latest
#: one): each now comes from ``benchmarks/results/`` through ``{bench}``, or is gone.
UNBACKED_FIGURES = (
    "1.20\N{MULTIPLICATION SIGN} the plugin-loaded",  # limitations.md, not the latest run's
    "21.68 ms of a 21.8 ms",  # lprun.md, line_profiler's share
    "21.4 ms\nagainst 21.8 ms",  # lprun.md, a CPU loop
    "about 8 µs",  # lprun.md, gpu-seam.md: the allocator's counters
    "at 45 µs",
    "(about 45 µs",
    "0.1013 s",  # debugging.md, launch-blocking
    "22\N{EN DASH}33 s",  # leaks.md, a re-run's process
    "724 TFLOP/s",  # CHANGELOG.md, against 723 on cudatime.md
)


@pytest.mark.parametrize(
    "page", [*PAGES, ROOT / "README.md", ROOT / "CHANGELOG.md"], ids=lambda p: p.name
)
def test_no_figure_without_a_result_file(page: Path) -> None:
    text = page.read_text()
    found = [f for f in UNBACKED_FIGURES if f in text or " ".join(f.split()) in text]
    assert not found, f"{page.name}: cite these with {{bench}} or drop them: {found}"


#: Characters of a code line that fit furo's content column at 1280 px (736 px of
#: monospace; a line of 91 ran 2 px past it).
CODE_WIDTH = 88
#: Blocks whose lines wrap at the content width (docs/_static/gpumagic.css).
WRAPPED = ("text", "console")
BLOCK = re.compile(r"^(?P<fence>`{3,})(?P<info>[^\n]*)\n(?P<body>.*?)^(?P=fence)\s*$", re.M | re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_no_line_runs_off_the_page(page: Path) -> None:
    """Outputs wrap (the stylesheet); code keeps its lines, so they must fit."""
    too_long = []
    for block in BLOCK.finditer(page.read_text()):
        info, body = block["info"].strip(), block["body"]
        language = re.sub(r"^\{code-block\}\s*", "", info).split()[0] if info else ""
        directive = info.startswith("{") and not info.startswith("{code-block}")
        if language in WRAPPED or ":class: wrap" in body or directive:
            continue
        too_long += [line for line in body.splitlines() if len(line) > CODE_WIDTH]
    assert not too_long, f"{page.name}: lines over {CODE_WIDTH} characters: {too_long}"


def test_outputs_wrap_at_the_content_width() -> None:
    css = (DOCS / "_static" / "gpumagic.css").read_text()
    rule = re.search(r"([^{}]*)\{[^}]*white-space:\s*pre-wrap", css)
    assert rule is not None
    for language in WRAPPED:
        assert f"div.highlight-{language} pre" in rule.group(1)
