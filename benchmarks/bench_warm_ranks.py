"""What warm rank processes save a suite of ``cuda_distributed`` tests (issue 27).

Generates a file of 20 passing tests at world size 2 (each: an all-reduce of 1,024
floats on the rank's device, checked) and runs it in fresh ``pytest`` processes, round
by round (the order rotating, so drift in machine load hits all alike): with the warm
ranks (the default), with ``isolate=True`` on every test (fresh rank processes per
test, as every test ran before the warm ranks), and, with ``--before-src DIR`` (the
``src`` of an older checkout, e.g. ``git archive <commit> src | tar -x -C DIR``), the
same file under that older plugin; with ``--compare-src LABEL=DIR`` (repeatable), the
same file under the ``src`` in DIR, as a variant named LABEL (e.g. the commit before a
change to the warm ranks). The backend is NCCL where two GPUs are visible, gloo on the
CPU otherwise (``--backend`` picks).

Reports, per variant, the wall time of the whole ``pytest`` run and the time per test
once the ranks are up (the median call time, from ``--junitxml``, of tests 2 to 20),
and the first test's time (the ranks' start)::

    python benchmarks/bench_warm_ranks.py [--rounds 3] [--before-src DIR]
        [--compare-src LABEL=DIR ...] [--json FILE]

Appends an environment line and one line per variant to ``--json`` (bench
``warm_ranks_gloo`` or ``warm_ranks_nccl``) and prints a markdown table last.
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
import time
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpumagic import cuda

TESTS = 20
SRC = Path(__file__).resolve().parents[1] / "src"

TEST = """

@pytest.mark.cuda_distributed(world_size=2, backend={backend!r}{extra})
def test_{index:02d}(cuda_rank):
    t = torch.full((1024,), float(cuda_rank.rank + 1), device=cuda_rank.device)
    dist.all_reduce(t)
    assert torch.all(t == 3.0)
"""


def suite(backend: str, extra: str, tests: int = TESTS) -> str:
    head = "import pytest\nimport torch\nimport torch.distributed as dist\n"
    return head + "".join(
        TEST.format(backend=backend, extra=extra, index=i) for i in range(1, tests + 1)
    )


def run_once(folder: Path, src: Path, devices: str | None) -> tuple[float, list[float]]:
    """One ``pytest`` run: its wall time, and each test's time (junitxml), in order."""
    report = folder / "report.xml"
    env = dict(os.environ, PYTHONPATH=str(src))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += [f"--junitxml={report}", "test_ranks.py"]
    if devices:
        command.append(f"--cuda-devices={devices}")
    started = time.perf_counter()
    done = subprocess.run(command, check=False, cwd=folder, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"the pytest run in {folder} failed:\n{done.stdout}\n{done.stderr}")
    cases = ET.parse(report).getroot().iter("testcase")
    return wall, [float(case.get("time", "nan")) for case in cases]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    parser.add_argument("--before-src", type=Path, help="an older checkout's src folder")
    parser.add_argument(
        "--compare-src",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="another checkout's src folder, run as the variant LABEL (repeatable)",
    )
    parser.add_argument("--json", type=Path, help="append the results as JSON lines")
    parser.add_argument(
        "--isolate-tests",
        type=int,
        default=TESTS,
        help=f"tests in the isolate=True file (default {TESTS}; at least 3): fresh ranks "
        "cost seconds a test, and the figure compared is the time a test",
    )
    args = parser.parse_args()
    if args.isolate_tests < 3:
        parser.error("--isolate-tests: at least 3 (the first test is counted apart)")
    gpus = cuda.devices()
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if len(gpus) >= 2 else "gloo"
    devices = "0,1" if backend == "nccl" else None
    variants: dict[str, tuple[Path, str, int]] = {
        "warm ranks": (SRC, "", TESTS),
        "isolate=True": (SRC, ", isolate=True", args.isolate_tests),
    }
    if args.before_src is not None:
        variants["before (fresh ranks, older plugin)"] = (args.before_src.resolve(), "", TESTS)
    for given in args.compare_src:
        label, _, folder = given.rpartition("=")
        if not label or not Path(folder, "pytest_cuda").is_dir():
            parser.error(f"--compare-src {given!r}: LABEL=DIR, DIR a src folder with pytest_cuda")
        if label in variants:
            parser.error(f"--compare-src {given!r}: the variant {label!r} is already run")
        variants[label] = (Path(folder).resolve(), "", TESTS)
    walls: dict[str, list[float]] = {name: [] for name in variants}
    per_test: dict[str, list[float]] = {name: [] for name in variants}
    first: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="bench-warm-ranks-") as tmp:
        folders = {}
        for number, (name, (_, extra, tests)) in enumerate(variants.items()):
            folders[name] = Path(tmp) / f"v{number}"
            folders[name].mkdir()
            (folders[name] / "test_ranks.py").write_text(suite(backend, extra, tests))
        names = list(variants)
        for round_ in range(args.rounds):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                wall, times = run_once(folders[name], variants[name][0], devices)
                walls[name].append(wall)
                first[name].append(times[0])
                per_test[name].append(statistics.median(times[1:]))
                # Each run's figures as it ends: a run cut short still leaves them.
                print(
                    f"round {round_ + 1} {name}: {wall:.2f} s (first test {times[0]:.2f} s, "
                    f"per test once up {per_test[name][-1]:.3f} s)",
                    flush=True,
                )
    date = datetime.now(UTC).strftime("%Y-%m-%d")
    bench = f"warm_ranks_{backend}"
    device = (
        f"{len(gpus)} x {gpus[0].name}"
        if backend == "nccl"
        else f"CPU only ({platform.machine()}, {os.cpu_count()} cores)"
    )
    env = {
        "bench": bench,
        "kind": "environment",
        "date": date,
        "device": device,
        "python": sys.version.split()[0],
        "pytest": pytest.__version__,
        "torch": cuda.status().torch_version,
    }

    def per_test_wall(name: str) -> float:
        return statistics.median(walls[name]) / variants[name][2]

    anchor = per_test_wall("isolate=True")
    rows = []
    for name in variants:
        rows.append(
            {
                "bench": bench,
                "kind": "variant",
                "variant": name,
                "backend": backend,
                "tests": variants[name][2],
                "rounds": args.rounds,
                "unit": "s",
                "wall_median": statistics.median(walls[name]),
                "wall_min": min(walls[name]),
                "wall_max": max(walls[name]),
                "per_test_median": statistics.median(per_test[name]),
                "per_test_min": min(per_test[name]),
                "per_test_max": max(per_test[name]),
                "first_test_median": statistics.median(first[name]),
                "wall_per_test": per_test_wall(name),
                # Per test: the isolate=True file may hold fewer tests (--isolate-tests).
                "wall_ratio_to_isolate": per_test_wall(name) / anchor,
            }
        )
    if args.json is not None:
        with args.json.open("a") as out:
            for record in (env, *rows):
                out.write(json.dumps(record) + "\n")
    print(f"\nworld size 2, {backend}, {device}, {args.rounds} rounds\n")
    print("| variant | tests | pytest run | per test once up | first test | run a test ÷ isolate |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['variant']} | {row['tests']} | {row['wall_median']:.2f} s | "
            f"{row['per_test_median']:.3f} s | {row['first_test_median']:.2f} s | "
            f"{row['wall_ratio_to_isolate']:.2f} |"
        )


if __name__ == "__main__":
    main()
