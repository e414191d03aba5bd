"""What pytest_cuda costs a suite that uses no CUDA feature.

Generates a 1,000-test CPU-only suite and runs it in fresh ``pytest`` processes three
ways, interleaved round by round (the order rotating) so drift in machine load hits
all alike: ``-p no:cuda`` (the anchor), the core alone (the modules in
``pytest_cuda.plugin.MODE_PLUGINS`` blocked: leak checks, sync modes) and the whole
plugin as installed. Reports the median wall time of each, the median of the paired
differences to the anchor, and whether torch was imported. The suite's conftest records
``"torch" in sys.modules`` at session end. Bytecode caches are written in the warm-up
runs, as for an installed package (``PYTHONDONTWRITEBYTECODE`` is dropped).

Also times the one piece of work the plugin does in every run: discovery for the
report header (``gpumagic.cuda.status()``: torch's version file and NVML, no torch
import, no CUDA context), first call in a fresh interpreter each time.

    python benchmarks/bench_plugin_overhead.py [--rounds 15] [--json results.jsonl]

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
from pytest_cuda import plugin

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
from pytest_cuda import plugin

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


# The three ways to run the suite: pytest options for each.
VARIANTS: dict[str, list[str]] = {
    "off": ["-p", "no:cuda"],
    "core": [arg for name in plugin.MODE_PLUGINS for arg in ("-p", f"no:{name}")],
    "on": [],
}


def run_suite(root: Path, variant: str, log: Path) -> float:
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *VARIANTS[variant]]
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PYTEST_") and k != "PYTHONDONTWRITEBYTECODE"
    }
    env["BENCH_TORCH_LOG"] = str(log)
    t0 = time.perf_counter()
    done = subprocess.run(
        [*args, str(root)], cwd=root, env=env, capture_output=True, text=True, check=False
    )
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


def row(name: str, values: list[float], note: str = "") -> str:
    return f"| {name} | {statistics.median(values) * 1000:.0f} | {spread(values)} | {note} |"


def spread(values: list[float], digits: int = 0) -> str:
    """The interquartile range in ms: ``"1412 to 1460"``."""
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"{q[0] * 1000:.{digits}f} to {q[2] * 1000:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="rounds of 3 runs (default 15)")
    parser.add_argument("--json", type=Path, help="append one JSON line with the results")
    args = parser.parse_args()

    status = cuda.status()
    device = status.devices[0].name if status.available else "no GPU (CPU only)"
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "suite"
        root.mkdir()
        write_suite(root)
        logs = {name: Path(tmp) / f"{name}.log" for name in VARIANTS}
        for name, log in logs.items():
            log.write_text("")
            run_suite(root, name, Path(tmp) / "warmup.log")  # bytecode and page caches
        names = list(VARIANTS)
        for i in range(args.rounds):
            for name in names[i % 3 :] + names[: i % 3]:  # rotate who goes first
                times[name].append(run_suite(root, name, logs[name]))
        imported = {name: torch_imported(log) for name, log in logs.items()}
    discovery, discovery_imported_torch = discovery_seconds(args.rounds)

    off = times["off"]
    diffs = {
        name: [a - b for a, b in zip(times[name], off, strict=True)] for name in ("core", "on")
    }
    off_med = statistics.median(off)
    result: dict[str, object] = {
        "benchmark": "plugin_overhead",
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device,
        "driver": status.driver_version,
        "torch": status.torch_version,
        "cuda": status.cuda_version,
        "python": platform.python_version(),
        "pytest": pytest.__version__,
        "tests": TESTS,
        "rounds": args.rounds,
        "blocked_for_core": list(plugin.MODE_PLUGINS),
        "discovery_median_ms": round(1000 * statistics.median(discovery), 2),
        "discovery_imported_torch": discovery_imported_torch,
    }
    for name, values in times.items():
        result[f"{name}_median_s"] = round(statistics.median(values), 4)
        result[f"{name}_s"] = [round(t, 4) for t in values]
        result[f"torch_imported_{name}"] = imported[name]
    for name, values in diffs.items():
        result[f"{name}_paired_diff_median_s"] = round(statistics.median(values), 4)
        result[f"{name}_overhead_pct"] = round(100 * statistics.median(values) / off_med, 2)
    if args.json:
        with args.json.open("a") as out:
            out.write(json.dumps(result) + "\n")

    print(f"pytest_cuda overhead on a {TESTS}-test CPU-only suite, {args.rounds} rounds")
    print(f"device: {device}; torch {status.torch_version}; pytest {pytest.__version__}\n")
    print("| run | median wall (ms) | IQR (ms) | torch imported |")
    print("| --- | ---: | ---: | --- |")
    print(row("`-p no:cuda` (anchor)", off, str(imported["off"])))
    print(row("core only (leak and sync modules blocked)", times["core"], str(imported["core"])))
    print(row("whole plugin (as installed)", times["on"], str(imported["on"])))
    for name, label in (("core", "core"), ("on", "whole plugin")):
        med = statistics.median(diffs[name])
        print(
            f"| {label} - anchor, paired median | {med * 1000:+.1f} "
            f"({100 * med / off_med:+.2f} %) | {spread(diffs[name])} | |"
        )
    print(
        f"| discovery for the header (first `cuda.status()` of a process) | "
        f"{1000 * statistics.median(discovery):.2f} | {spread(discovery, 2)} | "
        f"{discovery_imported_torch} |"
    )


if __name__ == "__main__":
    main()
