"""Reading a planted run's terminal output."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

SKIPPED = re.compile(r"SKIPPED \[(\d+)\] [^:]+(?::\d+)?: (.*)")


def skip_reasons(result: pytest.RunResult) -> dict[str, int]:
    """``{reason: how many tests}`` from the ``-rs`` summary (folded or one line each)."""
    found: dict[str, int] = {}
    for line in result.outlines:
        match = SKIPPED.fullmatch(line)
        if match:
            found[match.group(2)] = found.get(match.group(2), 0) + int(match.group(1))
    return found


#: A conftest for a planted run: prints how many rank processes this pytest process has
#: when each test's call starts (the ranks' start-up belongs to the first multi-rank
#: test's set-up, issue 40).
RANKS_AT_CALL = """
from pathlib import Path

import pytest


def _rank_processes():
    pids = []
    for task in Path("/proc/self/task").iterdir():
        pids += (task / "children").read_text().split()
    return [pid for pid in pids if b"rank_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    print(f"RANKS WHEN {item.name} IS CALLED: {len(_rank_processes())}")
"""
