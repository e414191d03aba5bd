"""pytest_cuda's leak check on a real third-party GPU test suite (``bench_leaks.py --suite``).

Runs the suite's tests (a folder, with ``--files`` and ``-k`` to select) in a fresh
``pytest`` process per run: one untimed warm-up with the plugin off (imports, on-disk
kernel caches), then ``rounds`` rounds of the configurations, interleaved so drift hits
each alike (each round starts one configuration later; the median wall time counts),
and, with ``--xdist``, the check under ``-n 4`` once. Every run seeds the random generators at
each test's setup (``seed_each_test.py``), so an outcome that differs from the anchor's
is the configuration's doing, not the luck of unseeded tests. The configurations:

* ``plugin loaded``: no option (the anchor: what a suite pays with the plugin
  installed and no check asked for);
* ``--cuda-leak-check``: the default check;
* ``--cuda-leak-check --cuda-leak-trace``: the holder search without its time limit
  (left out with ``--no-trace``, so that more rounds fit in the same time);
* ``--cuda-limit-memory=1TiB``, with ``--limit``: a memory limit no test reaches, what
  a limit costs the suite.

For each: the wall time of the whole process, the summed and the worst per-test growth
of teardown time against the anchor (pytest's ``--durations``), the outcomes (JUnit
XML), the tests whose outcome differs from the anchor's, every ``LEAKED`` line, and how
many of them name the allocating line and a holder (or say why there is none).
Third-party code is never committed here: ``docs/performance.md`` says how to get each
suite; on the GPU machine it travels as an ignored folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

CONFIGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("plugin loaded", ()),
    ("--cuda-leak-check", ("--cuda-leak-check",)),
    ("--cuda-leak-check --cuda-leak-trace", ("--cuda-leak-check", "--cuda-leak-trace")),
)
#: The memory limit on every test, one no test reaches: what a limit costs a suite.
LIMIT = ("--cuda-limit-memory=1TiB", ("--cuda-limit-memory=1TiB",))
PLUGIN_OFF = ("plugin off", ("-p", "no:cuda"))
XDIST = ("--cuda-leak-check -n 4", ("--cuda-leak-check", "-n", "4"))
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


#: A run that takes longer than this (seconds) is stopped and counted as timed out.
RUN_TIMEOUT_S = float(os.environ.get("BENCH_SUITE_RUN_TIMEOUT_S", "300"))


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
        try:
            done = subprocess.run(
                command,
                check=False,
                cwd=suite,
                capture_output=True,
                text=True,
                env=env,
                timeout=RUN_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            done = subprocess.CompletedProcess(command, -9, out, f"timed out after {exc.timeout} s")
        wall = time.perf_counter() - started
        results = outcomes(junit) if junit.exists() else {}
    phases = {"setup": 0.0, "call": 0.0, "teardown": 0.0}
    teardowns: dict[str, float] = {}
    for line in done.stdout.splitlines():
        found = _DURATION.match(line)
        if found:
            phases[found.group(2)] += float(found.group(1))
            if found.group(2) == "teardown":
                teardowns[found.group(3)] = float(found.group(1))
    teardown = phases["teardown"]
    leaked = [line.strip() for line in done.stdout.splitlines() if line.startswith("LEAKED ")]
    return {
        "wall_s": wall,
        "teardown_s": teardown,
        "teardowns": teardowns,
        "phases_s": phases,
        "exit": done.returncode,
        "outcomes": results,
        "leaked": leaked,
        "tail": done.stdout[-2000:] + done.stderr[-2000:],
    }


def leaked_lines(lines: list[str]) -> dict[str, int]:
    """How many ``LEAKED`` lines name the allocating line, a holder, or why no holder
    was found (nothing in Python reaches it, or the search ran out of time)."""
    return {
        "leaked_count": len(lines),
        "with_line": sum(", allocated at " in line for line in lines),
        "with_holder": sum(
            ", held by " in line and ", held by an unknown holder" not in line for line in lines
        ),
        "with_holder_or_why": sum(", held by " in line for line in lines),
    }


def teardown_growth(anchor: list[dict[str, Any]], runs: list[dict[str, Any]]) -> tuple[float, str]:
    """The largest growth of one test's teardown time over the anchor's (the anchor's
    fastest of its runs, this configuration's slowest), and which test."""
    base: dict[str, float] = {}
    for run in anchor:
        for name, seconds in run["teardowns"].items():
            base[name] = min(seconds, base.get(name, seconds))
    worst, which = 0.0, ""
    for run in runs:
        for name, seconds in run["teardowns"].items():
            grown = seconds - base.get(name, 0.0)
            if grown > worst:
                worst, which = grown, name
    return worst, which


def environment(bench: str, suite: str = "") -> dict[str, Any]:
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
        "suite": suite,
    }
    for name in ("pytest", "pytest-xdist", "torch_geometric", "torchvision", "gpytorch"):
        with contextlib.suppress(PackageNotFoundError):
            found[name.replace("-", "_")] = version(name)
    return found


def compare_with_torch(
    suite: Path, files: list[str], keyword: str | None, out: Path | None = None
) -> None:
    """The anchor, PyTorch's checker and ours, once each, on the same tests; the tests
    each checker fails that the anchor passes are its reported leaks."""
    targets = files or ["."]
    anchor = run_config(suite, targets, PLUGIN_OFF[1], keyword)
    rows: list[dict[str, Any]] = [environment("leaks_suite_torch")]
    for label, options in (TORCH_CONFIG, CONFIGS[1]):
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
    suite: Path,
    files: list[str],
    keyword: str | None,
    out: Path | None,
    rounds: int = 2,
    *,
    name: str = "",
    xdist: bool = False,
    trace: bool = True,
    limit: bool = False,
) -> None:
    targets = files or ["."]
    name = name or suite.name
    warm = run_config(suite, targets, PLUGIN_OFF[1], keyword)
    print(f"[{name}] warm-up ({PLUGIN_OFF[0]}): {warm['wall_s']:.1f} s wall, untimed", flush=True)
    configs = list(CONFIGS if trace else CONFIGS[:2]) + ([LIMIT] if limit else [])
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in (*configs, XDIST)}
    for round_ in range(rounds):
        # Each round starts one configuration later: none keeps one place in the order
        # (reversing odd rounds would keep the middle one in the middle).
        shift = round_ % len(configs)
        for label, options in configs[shift:] + configs[:shift]:
            result = run_config(suite, targets, options, keyword)
            runs[label].append(result)
            print(
                f"[{name}] round {round_ + 1} {label}: {result['wall_s']:.1f} s wall, "
                f"setup {result['phases_s']['setup']:.1f} s, "
                f"call {result['phases_s']['call']:.1f} s, "
                f"teardown {result['phases_s']['teardown']:.1f} s, {len(result['outcomes'])} "
                f"tests (exit {result['exit']}), {len(result['leaked'])} LEAKED",
                flush=True,
            )
            if round_ == 0:  # shown as they come: a run cut short keeps them
                for line in result["leaked"]:
                    print(f"  [{name}] [{label}] {line}", flush=True)
    if xdist:
        configs.append(XDIST)
        runs[XDIST[0]].append(run_config(suite, targets, XDIST[1], keyword))
    anchor_runs = runs[CONFIGS[0][0]]
    anchor: dict[str, str] = anchor_runs[0]["outcomes"]
    rows = []
    for label, _ in configs:
        found = runs[label]
        walls = sorted(r["wall_s"] for r in found)
        worst, which = teardown_growth(anchor_runs, found)
        changed = sorted(
            {
                test
                for r in found
                for test, state in r["outcomes"].items()
                if anchor.get(test, state) != state
            }
        )
        leaked = found[-1]["leaked"]
        rows.append(
            {
                "bench": "leaks_growing",
                "suite": name,
                "label": label,
                "wall_s": statistics.median(walls),
                "walls": [r["wall_s"] for r in found],
                "teardown_s": max(r["phases_s"]["teardown"] for r in found),
                "worst_teardown_growth_s": worst,
                "worst_teardown_test": which,
                "tests": len(found[0]["outcomes"]),
                "changed": changed,
                "leaked": leaked,
                **leaked_lines(leaked),
                "tail": found[-1]["tail"][-1500:],
            }
        )
    base = rows[0]["wall_s"]
    for row in rows:
        row["ratio_to_loaded"] = row["wall_s"] / base
    print(
        f"\n[{name}] | configuration | wall (s), median | vs plugin loaded | teardown (s) | "
        "worst test's teardown growth (s) | tests | outcome changes | LEAKED | with line "
        "| with holder | holder or why |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['label']} | {row['wall_s']:.1f} | {row['ratio_to_loaded']:.3f} | "
            f"{row['teardown_s']:.1f} | {row['worst_teardown_growth_s']:.2f} "
            f"({row['worst_teardown_test']}) | {row['tests']} | {len(row['changed'])} | "
            f"{len(row['leaked'])} | {row['with_line']} | {row['with_holder']} | "
            f"{row['with_holder_or_why']} |"
        )
    for row in rows:
        for test in row["changed"][:20]:
            print(
                f"  [{name}] [{row['label']}] changed: {test}: {anchor.get(test)} -> "
                f"{next(r['outcomes'].get(test) for r in runs[row['label']])}"
            )
    if out is not None:
        with out.open("a") as stream:
            stream.write(json.dumps(environment("leaks_growing", name)) + "\n")
            for row in rows:
                stream.write(json.dumps(row) + "\n")
