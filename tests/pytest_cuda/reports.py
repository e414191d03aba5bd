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
#: test's set-up, issue 40): those it started, and those its fork servers forked.
RANKS_AT_CALL = """
import os
from pathlib import Path

import pytest


def _children(pid):
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def _command(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _rank_processes():
    children = _children(os.getpid())
    ranks = [pid for pid in children if b"rank_main" in _command(pid)]
    for server in [pid for pid in children if b"forkserver_main" in _command(pid)]:
        ranks += _children(server)
    return ranks


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    print(f"RANKS WHEN {item.name} IS CALLED: {len(_rank_processes())}")
"""
