"""What a CUDA memory limit costs a test that stays under it (issue 42: <= 50 us a test,
<= +2 % on a suite's wall time).

Micro: the limit's own work per test, in this process on ``cuda:0``
(:class:`pytest_cuda.leaks.limit_watch.LimitWatch`: ``begin`` resets the peak counters,
``over`` reads them), around a clean test body (one small tensor made and freed), timed
against the body alone, with the allocator's events recorded as a limit records them
(``context="alloc"``) and without. The limit touches only the devices with a CUDA
context: measured first with ``cuda:0``'s alone, then (on a machine with several) once
every device has one (``*_all_devices``: an earlier test used them all). Suite: a
generated suite of small CUDA tests run in fresh pytest processes with
``--cuda-limit-memory=1TiB`` and without, interleaved round by round (the order
alternating), as paired differences of the wall time.

    python benchmarks/bench_memory_limit.py [--calls 5000] [--rounds 7] [--json results.jsonl]

Appends one JSON object to ``--json`` and prints a markdown table last. Needs a GPU.
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
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpumagic import cuda
from pytest_cuda.leaks.limit_watch import LimitWatch
from pytest_cuda.leaks.recording import StackRecording

TESTS = 300

SUITE = """
import pytest
import torch


@pytest.mark.parametrize("n", range({tests}))
def test_small(n):
    x = torch.randn(256, 256, device="cuda")
    assert (x @ x).isfinite().all().item()
"""


def _body(torch: object) -> None:
    x = torch.empty(1024, device="cuda")  # type: ignore[attr-defined]
    del x


def per_call_us(calls: int, *, watched: bool) -> list[float]:
    """Microseconds of each of ``calls`` clean test bodies, with the limit's work
    around each or without."""
    torch = cuda.torch_module()
    watch = LimitWatch(1 << 40, "--cuda-limit-memory")
    found = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        if watched:
            watch.begin()
        _body(torch)
        if watched and watch.over():
            raise SystemExit("a clean body went over a 1 TiB limit")
        found.append((time.perf_counter_ns() - t0) / 1000)
    return found


def micro(calls: int) -> dict[str, float]:
    torch = cuda.torch_module()
    torch.empty(1, device="cuda")  # the context first
    result = micro_rounds(calls)
    total = torch.cuda.device_count()
    if total > 1:
        for device in range(1, total):
            torch.empty(1, device=f"cuda:{device}")  # a context on each
        result |= micro_rounds(calls, "_all_devices")
        result["devices_in_use_all_devices"] = len(cuda.devices_with_context())
    return result


def micro_rounds(calls: int, suffix: str = "") -> dict[str, float]:
    """Medians of the body alone and watched, recorded and not; ``suffix`` on each key."""
    result: dict[str, float] = {}
    for recorded in (False, True):
        recording = StackRecording(event_stacks=True)
        if recorded:
            recording.ensure()
        try:
            label = ("recorded" if recorded else "unrecorded") + suffix
            per_call_us(calls // 10, watched=True)  # warm-up
            bare, watched = [], []
            for _ in range(5):  # interleaved blocks, so drift hits both alike
                bare += per_call_us(calls // 5, watched=False)
                watched += per_call_us(calls // 5, watched=True)
            result[f"body_{label}_median_us"] = round(statistics.median(bare), 2)
            result[f"watched_{label}_median_us"] = round(statistics.median(watched), 2)
            result[f"limit_cost_{label}_us"] = round(
                statistics.median(watched) - statistics.median(bare), 2
            )
        finally:
            recording.close()
    return result


def run_suite(root: Path, limited: bool) -> float:
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root)]
    if limited:
        args.append("--cuda-limit-memory=1TiB")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    t0 = time.perf_counter()
    done = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - t0
    if done.returncode != 0 or f"{TESTS} passed" not in done.stdout:
        raise SystemExit(f"the generated suite did not pass:\n{done.stdout}\n{done.stderr}")
    return elapsed


def suite(rounds: int) -> dict[str, object]:
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "test_suite.py").write_text(SUITE.format(tests=TESTS))
        run_suite(root, limited=False)  # bytecode and page caches
        for i in range(rounds):
            for limited in (i % 2 == 0, i % 2 != 0):
                times[limited].append(run_suite(root, limited))
    diffs = [a - b for a, b in zip(times[True], times[False], strict=True)]
    base = statistics.median(times[False])
    return {
        "suite_tests": TESTS,
        "suite_rounds": rounds,
        "suite_unlimited_s": [round(t, 4) for t in times[False]],
        "suite_limited_s": [round(t, 4) for t in times[True]],
        "suite_paired_diff_median_s": round(statistics.median(diffs), 4),
        "suite_overhead_pct": round(100 * statistics.median(diffs) / base, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000, help="clean bodies timed (5000)")
    parser.add_argument("--rounds", type=int, default=7, help="suite rounds, 0: none (7)")
    parser.add_argument("--json", type=Path, help="append one JSON line with the results")
    args = parser.parse_args()
    status = cuda.status()
    if not status.available:
        raise SystemExit(f"needs a GPU: {status.reason}")
    result: dict[str, object] = {
        "benchmark": "memory_limit",
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": status.devices[0].name,
        "driver": status.driver_version,
        "torch": status.torch_version,
        "cuda": status.cuda_version,
        "python": platform.python_version(),
        "pytest": pytest.__version__,
        "calls": args.calls,
        **micro(args.calls),
    }
    if args.rounds:
        result.update(suite(args.rounds))
    if args.json:
        with args.json.open("a") as out:
            out.write(json.dumps(result) + "\n")
    print(f"CUDA memory limit on a clean test; {result['device']}, torch {status.torch_version}\n")
    print("| what | median |")
    print("| --- | ---: |")
    for label in ("unrecorded", "recorded", "unrecorded_all_devices", "recorded_all_devices"):
        if f"body_{label}_median_us" not in result:
            continue  # one device
        print(f"| clean body, {label} | {result[f'body_{label}_median_us']} µs |")
        print(f"| limit's work around it, {label} | {result[f'limit_cost_{label}_us']:+} µs |")
    if args.rounds:
        print(
            f"| {TESTS}-test suite, --cuda-limit-memory=1TiB - none, paired | "
            f"{result['suite_paired_diff_median_s']:+} s ({result['suite_overhead_pct']:+} %) |"
        )


if __name__ == "__main__":
    main()
