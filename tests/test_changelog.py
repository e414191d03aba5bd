"""The changelog: a section per version with its date, one line per change a user
notices, no benchmark figures and no internals.

A version's heading is ``## [VERSION] - YYYY-MM-DD``, followed by ``(unreleased)`` for
the version being developed, which must be the one ``pyproject.toml`` declares. Each
change is one bullet on one line. Figures measured by the benchmarks belong in the
docs' Performance page, module paths and the project's issue numbers in its
Architecture page and history: a test reads each bullet for them.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "CHANGELOG.md").read_text()
HEADING = re.compile(r"^## \[(?P<version>[^\]]+)\] - (?P<date>\d{4}-\d\d-\d\d)(?P<rest>.*)$")
KINDS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")
#: A measured figure: a number with a unit of time, rate, size or a ratio.
FIGURE = re.compile(r"\d(?:[\d.,]*)\s?(?:µs|ms|s\b|\u00d7|x\b|%|[KMGT]i?B\b|TFLOP/s|GB/s)")
#: What only a reader of the code knows: a source file, a private module, an issue.
INTERNAL = re.compile(r"(?<!conftest)\.py\b|\bissue \d+|src/|tests/|benchmarks/|scripts/")


def versions() -> list[re.Match[str]]:
    return [m for line in TEXT.splitlines() if (m := HEADING.match(line))]


def bullets() -> list[str]:
    return [line for line in TEXT.splitlines() if line.startswith("- ")]


def test_each_version_has_a_section_with_its_date() -> None:
    found = versions()
    assert found, "CHANGELOG.md has no '## [VERSION] - YYYY-MM-DD' heading"
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert found[0]["version"] == declared
    unreleased = [m for m in found if "unreleased" in m["rest"]]
    assert unreleased in ([], [found[0]]), "only the newest version may be unreleased"
    dates = [m["date"] for m in found]
    assert dates == sorted(dates, reverse=True)
    headings = re.findall(r"^## .*$", TEXT, re.MULTILINE)
    assert len(headings) == len(found), f"a section without a version and date: {headings}"
    for kind in re.findall(r"^### (.*)$", TEXT, re.MULTILINE):
        assert kind in KINDS, kind


def test_one_line_per_change() -> None:
    lines = TEXT.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("- "):
            after = lines[i + 1] if i + 1 < len(lines) else ""
            assert not after.startswith(" "), f"continues on a second line: {line[:60]}"
    assert len(bullets()) >= 20


def test_no_benchmark_figures_and_no_internals() -> None:
    for line in bullets():
        figures = FIGURE.findall(line)
        assert not figures, f"a measured figure belongs in the docs: {figures} in {line[:80]}"
        internal = INTERNAL.findall(line)
        assert not internal, f"an internal detail: {internal} in {line[:80]}"
