"""The pages speak to someone using or contributing to gpumagic, not about the machines
and jobs it was developed with (issue 29): no "our probe", no job-runner variables."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "docs" / "howto").glob("*.md"),
    ]
)
# The changelog records history in its own words.
PAGES = [p for p in PAGES if p.name != "changelog.md"]
DEVELOPMENT_WORDS = (
    "in our probe",
    "the development machine",
    "$OUT",
    "carried wheels",
    "the GPU image",
    "to the GPU machine",
)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_words_about_how_the_project_is_developed(page: Path) -> None:
    text = page.read_text()
    found = [words for words in DEVELOPMENT_WORDS if words in text]
    assert not found, f"{page.name}: {found}"


def test_contributing_says_the_gpu_check_is_one_command() -> None:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    assert "bash scripts/gpu-check.sh\n" in text
    assert "torch aside: your\ntorch is used as it is" in text
