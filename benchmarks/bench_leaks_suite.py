"""pytest_cuda's leak check on a real third-party GPU test suite (``bench_leaks.py --suite``).

Runs the suite's tests (a folder, with ``--files`` and ``-k`` to select) once per
configuration, each in a fresh ``pytest`` process, in this order:

* ``plugin off``: ``-p no:cuda`` (the anchor);
* ``plugin loaded``: no option;
* ``--cuda-leak-check``;
* ``--cuda-leak-check -n 4`` (pytest-xdist).

For each: the wall time of the whole process, the summed teardown time of the tests
(pytest's ``--durations``), the outcomes (JUnit XML), the tests whose outcome differs
from the anchor's, and every ``LEAKED`` line of the report. Third-party code is never
committed here: ``docs/performance.md`` says how to get the suite (a ``git clone`` at
the tag of the installed version); on the GPU machine it travels as an ignored folder.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

CONFIGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("plugin off", ("-p", "no:cuda")),
    ("plugin loaded", ()),
    ("--cuda-leak-check", ("--cuda-leak-check",)),
    ("--cuda-leak-check -n 4", ("--cuda-leak-check", "-n", "4")),
)
_DURATION = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S+)")


def outcomes(junit: Path) -> dict[str, str]:
    """``{test id: passed|failed|error|skipped}`` from a JUnit XML file (a teardown
    error, such as a leak, counts over the call's pass)."""
    found: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        state = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                state = {"failure": "failed"}.get(child.tag, child.tag)
        if found.get(name) in ("failed", "error"):
            continue
        found[name] = state
    return found


def run_config(
    suite: Path, targets: list[str], options: tuple[str, ...], keyword: str | None
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [
            sys.executable,
            "-m",
            "pytest",
            *targets,
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            "--durations=0",
            "--durations-min=0",
            *options,
        ]
        if keyword:
            command += ["-k", keyword]
        started = time.perf_counter()
        done = subprocess.run(
            command, check=False, cwd=suite, capture_output=True, text=True, env=os.environ.copy()
        )
        wall = time.perf_counter() - started
        results = outcomes(junit) if junit.exists() else {}
    teardown = 0.0
    for line in done.stdout.splitlines():
        found = _DURATION.match(line)
        if found and found.group(2) == "teardown":
            teardown += float(found.group(1))
    leaked = [line.strip() for line in done.stdout.splitlines() if line.startswith("LEAKED ")]
    return {
        "wall_s": wall,
        "teardown_s": teardown,
        "exit": done.returncode,
        "outcomes": results,
        "leaked": leaked,
        "tail": done.stdout[-2000:] + done.stderr[-2000:],
    }


def main(suite: Path, files: list[str], keyword: str | None, out: Path | None) -> None:
    targets = files or ["."]
    rows = []
    anchor: dict[str, str] = {}
    for label, options in CONFIGS:
        result = run_config(suite, targets, options, keyword)
        if not anchor:
            anchor = result["outcomes"]
        changed = sorted(
            name for name, state in result["outcomes"].items() if anchor.get(name, state) != state
        )
        result.update(label=label, changed=changed)
        rows.append(result)
        print(
            f"{label}: {result['wall_s']:.1f} s wall, {result['teardown_s']:.1f} s teardown, "
            f"{len(result['outcomes'])} tests, {len(changed)} outcome changes, "
            f"{len(result['leaked'])} LEAKED (exit {result['exit']})",
            flush=True,
        )
    base = rows[0]["wall_s"]
    print(
        "\n| configuration | wall (s) | vs plugin off | teardown (s) | tests | outcome changes "
        "| LEAKED |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['label']} | {row['wall_s']:.1f} | {row['wall_s'] / base:.2f} | "
            f"{row['teardown_s']:.1f} | {len(row['outcomes'])} | {len(row['changed'])} | "
            f"{len(row['leaked'])} |"
        )
    for row in rows:
        for line in row["leaked"]:
            print(f"  [{row['label']}] {line}")
        for name in row["changed"][:20]:
            print(
                f"  [{row['label']}] changed: {name}: {anchor.get(name)} -> {row['outcomes'][name]}"
            )
    if out is not None:
        with out.open("a") as stream:
            for row in rows:
                kept = {k: v for k, v in row.items() if k != "outcomes"}
                stream.write(json.dumps(kept) + "\n")
