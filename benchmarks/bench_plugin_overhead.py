"""What pytest_cuda costs a suite that uses no CUDA feature.

Generates a 1,000-test CPU-only suite and runs it in fresh ``pytest`` processes with
the plugin on and with ``-p no:cuda`` (the anchor), interleaved pair by pair so drift
in machine load hits both sides alike. Reports the median wall time of each side, the
median of the paired differences, and whether torch was imported in either run. The
suite's conftest records ``"torch" in sys.modules`` at session end.

Also times the one piece of work the plugin does in every run: discovery for the
report header (``gpumagic.cuda.status()``: torch's version file and NVML, no torch
import, no CUDA context), first call in a fresh interpreter each time.

    python benchmarks/bench_plugin_overhead.py [--runs 21] [--json results.jsonl]

Appends one JSON object to ``--json`` and prints a markdown table last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpumagic import cuda

TESTS = 1000
FILES = 20

CONFTEST = """
import os
import sys


def pytest_sessionfinish(session):
    with open(os.environ["BENCH_TORCH_LOG"], "a") as log:
        log.write(f"{'torch' in sys.modules}\\n")
"""

DISCOVERY = """
import sys
import time

from gpumagic import cuda

t0 = time.perf_counter()
cuda.status()
elapsed = time.perf_counter() - t0
print(elapsed, "torch" in sys.modules)
"""


def write_suite(root: Path) -> None:
    """``FILES`` modules of plain CPU tests, ``TESTS`` in all, some parametrized."""
    (root / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    per_file = TESTS // FILES
    for f in range(FILES):
        lines = ["import pytest", ""]
        plain = per_file - 10
        for t in range(plain):
            lines += [f"def test_{t}():", f"    assert {t} + 1 == {t + 1}", ""]
        lines += [
            '@pytest.mark.parametrize("x", range(10))',
            "def test_param(x):",
            "    assert x * 2 >= x",
            "",
        ]
        (root / f"test_mod_{f:02d}.py").write_text("\n".join(lines))


def run_suite(root: Path, plugin_on: bool, log: Path) -> float:
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root)]
    if not plugin_on:
        args[3:3] = ["-p", "no:cuda"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["BENCH_TORCH_LOG"] = str(log)
    t0 = time.perf_counter()
    done = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - t0
    if done.returncode != 0 or f"{TESTS} passed" not in done.stdout:
        raise SystemExit(f"the generated suite did not pass:\n{done.stdout}\n{done.stderr}")
    return elapsed


def torch_imported(log: Path) -> bool:
    return any(line.strip() == "True" for line in log.read_text().splitlines())


def discovery_seconds(runs: int) -> tuple[list[float], bool]:
    times, imported = [], False
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-c", DISCOVERY], capture_output=True, text=True, check=True
        ).stdout.split()
        times.append(float(out[0]))
        imported |= out[1] == "True"
    return times, imported


def spread(values: list[float], digits: int = 0) -> str:
    """The interquartile range in ms: ``"1412 to 1460"``."""
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"{q[0] * 1000:.{digits}f} to {q[2] * 1000:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21, help="pairs of runs (default 21)")
    parser.add_argument("--json", type=Path, help="append one JSON line with the results")
    args = parser.parse_args()

    status = cuda.status()
    device = status.devices[0].name if status.available else "no GPU (CPU only)"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "suite"
        root.mkdir()
        write_suite(root)
        logs = {True: Path(tmp) / "on.log", False: Path(tmp) / "off.log"}
        for log in logs.values():
            log.write_text("")
        run_suite(root, True, Path(tmp) / "warmup.log")  # bytecode caches, page cache
        run_suite(root, False, Path(tmp) / "warmup.log")
        on: list[float] = []
        off: list[float] = []
        for i in range(args.runs):
            # Alternate which side goes first, so neither always follows the other.
            for side in (True, False) if i % 2 == 0 else (False, True):
                (on if side else off).append(run_suite(root, side, logs[side]))
        imported_on, imported_off = torch_imported(logs[True]), torch_imported(logs[False])
    discovery, discovery_imported_torch = discovery_seconds(args.runs)

    diffs = [a - b for a, b in zip(on, off, strict=True)]
    on_med, off_med = statistics.median(on), statistics.median(off)
    diff_med = statistics.median(diffs)
    result = {
        "benchmark": "plugin_overhead",
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device,
        "driver": status.driver_version,
        "torch": status.torch_version,
        "cuda": status.cuda_version,
        "python": platform.python_version(),
        "pytest": pytest.__version__,
        "tests": TESTS,
        "pairs": args.runs,
        "on_median_s": round(on_med, 4),
        "off_median_s": round(off_med, 4),
        "paired_diff_median_s": round(diff_med, 4),
        "overhead_pct": round(100 * diff_med / off_med, 2),
        "on_over_off": round(on_med / off_med, 4),
        "on_s": [round(t, 4) for t in on],
        "off_s": [round(t, 4) for t in off],
        "torch_imported_plugin_on": imported_on,
        "torch_imported_plugin_off": imported_off,
        "discovery_median_ms": round(1000 * statistics.median(discovery), 2),
        "discovery_imported_torch": discovery_imported_torch,
    }
    if args.json:
        with args.json.open("a") as out:
            out.write(json.dumps(result) + "\n")

    print(f"pytest_cuda overhead on a {TESTS}-test CPU-only suite, {args.runs} interleaved pairs")
    print(f"device: {device}; torch {status.torch_version}; pytest {pytest.__version__}\n")
    print("| run | median wall (ms) | IQR (ms) | torch imported |")
    print("| --- | ---: | ---: | --- |")
    print(f"| `-p no:cuda` (anchor) | {off_med * 1000:.0f} | {spread(off)} | {imported_off} |")
    print(f"| plugin on | {on_med * 1000:.0f} | {spread(on)} | {imported_on} |")
    print(
        f"| on - off, paired median | {diff_med * 1000:+.1f} "
        f"({100 * diff_med / off_med:+.2f} %) | {spread(diffs)} | |"
    )
    print(
        f"| discovery for the header (first `cuda.status()` of a process) | "
        f"{1000 * statistics.median(discovery):.2f} | {spread(discovery, 2)} | "
        f"{discovery_imported_torch} |"
    )


if __name__ == "__main__":
    main()
