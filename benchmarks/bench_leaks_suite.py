"""pytest_cuda's leak check on a real third-party GPU test suite (``bench_leaks.py --suite``).

Runs the suite's tests (a folder, with ``--files`` and ``-k`` to select) in a fresh
``pytest`` process per run: one untimed warm-up (imports, on-disk kernel caches), then
``rounds`` rounds of the first three configurations, interleaved so drift hits each
alike (the median wall time counts), and the xdist one once. Every run seeds the random
generators at each test's setup (``seed_each_test.py``), so an outcome that differs
from the anchor's is the configuration's doing, not the luck of unseeded tests. The
configurations:

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

import contextlib
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
#: PyTorch's checker on the first tests that use CUDA (torch_leak_check.py), compared
#: with the anchor and with --cuda-leak-check on the same run's tests.
TORCH_CONFIG = ("PyTorch CudaMemoryLeakCheck", ("-p", "no:cuda", "-p", "torch_leak_check"))
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
    env = os.environ.copy()
    # One hash seed for every process: a suite that parametrizes over a set collects in
    # the same order in each pytest-xdist worker (else: "different tests were collected").
    env["PYTHONHASHSEED"] = "0"
    here = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
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
            "-p",
            "seed_each_test",
            *options,
        ]
        if keyword:
            command += ["-k", keyword]
        started = time.perf_counter()
        done = subprocess.run(
            command, check=False, cwd=suite, capture_output=True, text=True, env=env
        )
        wall = time.perf_counter() - started
        results = outcomes(junit) if junit.exists() else {}
    phases = {"setup": 0.0, "call": 0.0, "teardown": 0.0}
    for line in done.stdout.splitlines():
        found = _DURATION.match(line)
        if found:
            phases[found.group(2)] += float(found.group(1))
    teardown = phases["teardown"]
    leaked = [line.strip() for line in done.stdout.splitlines() if line.startswith("LEAKED ")]
    return {
        "wall_s": wall,
        "teardown_s": teardown,
        "phases_s": phases,
        "exit": done.returncode,
        "outcomes": results,
        "leaked": leaked,
        "tail": done.stdout[-2000:] + done.stderr[-2000:],
    }


def environment(bench: str) -> dict[str, Any]:
    """The first JSON line of a result file: which benchmark, machine and versions."""
    from datetime import UTC, datetime
    from importlib.metadata import PackageNotFoundError, version

    import torch

    found: dict[str, Any] = {
        "bench": bench,
        "kind": "environment",
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }
    for name in ("pytest", "pytest-xdist", "torch_geometric"):
        with contextlib.suppress(PackageNotFoundError):
            found[name.replace("-", "_")] = version(name)
    return found


def compare_with_torch(
    suite: Path, files: list[str], keyword: str | None, out: Path | None = None
) -> None:
    """The anchor, PyTorch's checker and ours, once each, on the same tests; the tests
    each checker fails that the anchor passes are its reported leaks."""
    targets = files or ["."]
    anchor = run_config(suite, targets, CONFIGS[0][1], keyword)
    rows: list[dict[str, Any]] = [environment("leaks_suite_torch")]
    for label, options in (TORCH_CONFIG, CONFIGS[2]):
        result = run_config(suite, targets, options, keyword)
        changed = sorted(
            name
            for name, state in result["outcomes"].items()
            if anchor["outcomes"].get(name, state) != state
        )
        checked = [line for line in result["tail"].splitlines() if "tests checked" in line]
        print(
            f"{label}: {result['wall_s']:.1f} s wall against {anchor['wall_s']:.1f} s "
            f"({result['wall_s'] / anchor['wall_s']:.3f}), {len(changed)} tests failed that "
            f"pass without it, {len(result['leaked'])} LEAKED {' '.join(checked)}",
            flush=True,
        )
        for name in changed[:20]:
            before, after = anchor["outcomes"].get(name), result["outcomes"][name]
            print(f"  [{label}] {name}: {before} -> {after}")
        rows.append(
            {
                "bench": "leaks_suite_torch",
                "label": label,
                "wall_s": result["wall_s"],
                "anchor_wall_s": anchor["wall_s"],
                "ratio": result["wall_s"] / anchor["wall_s"],
                "changed": changed,
                "leaked": result["leaked"],
            }
        )
    if out is not None:
        with out.open("a") as stream:
            for row in rows:
                stream.write(json.dumps(row) + "\n")


def main(
    suite: Path, files: list[str], keyword: str | None, out: Path | None, rounds: int = 2
) -> None:
    targets = files or ["."]
    warm = run_config(suite, targets, CONFIGS[0][1], keyword)
    print(f"warm-up ({CONFIGS[0][0]}): {warm['wall_s']:.1f} s wall, untimed", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in CONFIGS}
    for round_ in range(rounds):
        # Odd rounds run the configurations in reverse: none always follows another.
        order = CONFIGS if round_ == 0 else CONFIGS[:3][:: -1 if round_ % 2 else 1]
        for label, options in order:
            result = run_config(suite, targets, options, keyword)
            runs[label].append(result)
            phases = ", ".join(f"{k} {v:.1f} s" for k, v in result["phases_s"].items())
            print(
                f"round {round_ + 1} {label}: {result['wall_s']:.1f} s wall ({phases}), "
                f"{len(result['outcomes'])} tests (exit {result['exit']})",
                flush=True,
            )
    anchor: dict[str, str] = runs[CONFIGS[0][0]][0]["outcomes"]
    rows = []
    for label, _ in CONFIGS:
        found = runs[label]
        result = dict(found[0])
        walls = sorted(r["wall_s"] for r in found)
        result["wall_s"] = walls[len(walls) // 2] if len(walls) % 2 else sum(walls[-2:]) / 2
        result["walls"] = [r["wall_s"] for r in found]
        result["teardown_s"] = max(r["teardown_s"] for r in found)
        changed = sorted(
            {
                name
                for r in found
                for name, state in r["outcomes"].items()
                if anchor.get(name, state) != state
            }
        )
        result.update(label=label, changed=changed)
        rows.append(result)
        print(
            f"{label}: {result['wall_s']:.1f} s wall (runs: "
            f"{', '.join(f'{w:.1f}' for w in result['walls'])}), "
            f"{result['teardown_s']:.1f} s teardown, {len(result['outcomes'])} tests, "
            f"{len(changed)} outcome changes, {len(result['leaked'])} LEAKED",
            flush=True,
        )
        if len(result["outcomes"]) < len(anchor) // 2:
            print(f"  [{label}] the JUnit file holds few tests; the run ended with:")
            print("    " + result["tail"][-1500:].replace("\n", "\n    "))
    base, loaded = rows[0]["wall_s"], rows[1]["wall_s"]
    print(
        "\n| configuration | wall (s), median | vs plugin off | vs plugin loaded | teardown (s) "
        "| tests | outcome changes | LEAKED |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['label']} | {row['wall_s']:.1f} | {row['wall_s'] / base:.3f} | "
            f"{row['wall_s'] / loaded:.3f} | {row['teardown_s']:.1f} | {len(row['outcomes'])} "
            f"| {len(row['changed'])} | {len(row['leaked'])} |"
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
            stream.write(json.dumps(environment("leaks_suite")) + "\n")
            for row in rows:
                kept = {k: v for k, v in row.items() if k != "outcomes"}
                stream.write(json.dumps({"bench": "leaks_suite", **kept}) + "\n")
