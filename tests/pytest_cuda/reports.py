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
