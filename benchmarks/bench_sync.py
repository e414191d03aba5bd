"""What the CUDA debug modes of pytest_cuda cost, measured on the GPU.

* A suite of small-op tests (200 tests; each runs 20 element-wise ops on 4096 floats
  and checks one value with ``.item()``), run by pytest in a fresh process per run:
  the default run (the post-test health check on), ``--cuda-sync=per-op``,
  ``--cuda-sync=launch-blocking``, and the plugin switched off
  (``-p no:pytest_cuda.sync_plugin``), and the plugin with its synchronize swapped
  for a no-op (its hooks alone). Time = the median wall time of one test's whole
  protocol (setup, call, teardown, reports, every plugin's hooks; the first 10 tests
  left out), so interpreter start and collection do not count. Runs are interleaved
  over rounds; medians over rounds, with min-max. Reported as ratios to the default
  run; the health check's cost per test is default - plugin off. Target: <= 0.05 ms.
* The health check alone: ``gpumagic.cuda.async_error()`` on an idle GPU (what each
  test pays twice), and in a process where torch has not initialised CUDA.
* In-process loops, against the CUDA kernel time of the same loop (CUPTI through
  torch.profiler, same run): a launch-bound loop of 4000 tiny ops and an MLP training
  step, plain, under the per-op mode, and under an empty ``TorchDispatchMode`` (what
  any dispatch mode costs); the launch-bound loop again in a child process started
  with ``CUDA_LAUNCH_BLOCKING=1``, against a plain child.

    python benchmarks/bench_sync.py [--rounds 3] [--json results.jsonl]

Appends one JSON object per measurement to ``--json`` and prints a markdown table last.
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
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

SUITE_TESTS = 200
SUITE_CONFTEST = """
import json, os, time
import pytest
import torch

X = torch.randn(4096, device="cuda")
torch.cuda.synchronize()
SPENT = []


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item):
    # Outermost: setup, call, teardown, reporting and every plugin's hooks.
    start = time.perf_counter()
    try:
        return (yield)
    finally:
        SPENT.append(time.perf_counter() - start)


def pytest_sessionstart(session):
    guard = session.config.pluginmanager.get_plugin("cuda.poison")
    if os.environ.get("BENCH_NO_CHECK") and guard is not None:
        guard.check = lambda: None  # the plugin's hooks without the synchronize


def pytest_sessionfinish(session):
    with open("timing.json", "w") as out:
        json.dump(SPENT, out)
"""
WARMUP_TESTS = 10  # left out: the first tests load kernels and warm the caches
SUITE_TEST = """
def test_{i}():
    y = X
    for _ in range(10):
        y = y * 1.0001 + 0.0001
    assert y.sum().item() != 1e30
"""
SUITE_MODES = {
    "default": [],
    "plugin off": ["-p", "no:pytest_cuda.sync_plugin"],
    "hooks only (check swapped out)": ["--bench-no-check"],
    "per-op": ["--cuda-sync=per-op"],
    "launch-blocking": ["--cuda-sync=launch-blocking"],
}


def median_range(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


# ---------------------------------------------------------------------------
# The pytest suite


def write_suite(root: Path) -> None:
    (root / "conftest.py").write_text(SUITE_CONFTEST)
    tests = "from conftest import X\n" + "".join(SUITE_TEST.format(i=i) for i in range(SUITE_TESTS))
    (root / "test_small_ops.py").write_text(tests)


def run_suite(root: Path, args: list[str]) -> float:
    """Seconds per test (the whole test protocol, median) in one fresh pytest run."""
    env = dict(os.environ)
    env.pop("CUDA_LAUNCH_BLOCKING", None)
    if "--bench-no-check" in args:
        args = [a for a in args if a != "--bench-no-check"]
        env["BENCH_NO_CHECK"] = "1"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"suite run {args} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    spent = json.loads((root / "timing.json").read_text())
    if len(spent) != SUITE_TESTS:
        raise SystemExit(f"suite run {args}: {len(spent)} tests timed, expected {SUITE_TESTS}")
    return float(statistics.median(spent[WARMUP_TESTS:]))


def bench_suite(rounds: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp:
        root = Path(tmp)
        write_suite(root)
        run_suite(root, [])  # warm the file system and the kernel caches
        times: dict[str, list[float]] = {mode: [] for mode in SUITE_MODES}
        for _ in range(rounds):
            for mode, args in SUITE_MODES.items():
                times[mode].append(run_suite(root, args))
    return times


# ---------------------------------------------------------------------------
# In-process loops (this process, and children for launch blocking)

CHILD = """
import json, sys, time
import torch
sys.path.insert(0, {bench_dir!r})
from bench_sync import tiny_ops, best_of
x = torch.randn(1024, device="cuda")
torch.cuda.synchronize()
print(json.dumps({{"tiny_ops": best_of(lambda: tiny_ops(x), {repeats})}}))
"""


def tiny_ops(x: Any, n: int = 2000) -> None:
    import torch

    y = x
    for _ in range(n):
        y = y * 1.0001 + 0.0001
    torch.cuda.synchronize()


def best_of(run: Callable[[], object], repeats: int) -> list[float]:
    """Wall seconds of each repeat after two warm-up calls."""
    for _ in range(2):
        run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return samples


def mlp_step_factory() -> Callable[[], None]:
    import torch

    model = torch.nn.Sequential(
        torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)
    ).cuda()
    opt = torch.optim.Adam(model.parameters())
    batch = torch.randn(64, 512, device="cuda")

    def step() -> None:
        opt.zero_grad()
        model(batch).square().mean().backward()
        opt.step()
        torch.cuda.synchronize()

    return step


def kernel_ms(run: Callable[[], object]) -> float:
    """Total CUDA kernel time of one call (CUPTI, through torch.profiler)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    run()  # the profiler's first use is slow; the loop is warm already
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in kernels) / 1e3


def passthrough_mode() -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    return Passthrough()


def bench_loops(repeats: int) -> dict[str, Any]:
    import torch

    from gpumagic import cuda

    x = torch.randn(1024, device="cuda")
    mlp_step = mlp_step_factory()
    loops: dict[str, Callable[[], object]] = {
        "tiny ops (4000 launches)": lambda: tiny_ops(x),
        "MLP training step": mlp_step,
    }
    found: dict[str, Any] = {}
    for name, run in loops.items():

        def per_op(run: Callable[[], object] = run) -> None:
            with cuda.sync_after_each_op():
                run()

        def empty_mode(run: Callable[[], object] = run) -> None:
            with passthrough_mode():
                run()

        samples: dict[str, list[float]] = {"plain": [], "per-op": [], "empty dispatch mode": []}
        variants = {"plain": run, "per-op": per_op, "empty dispatch mode": empty_mode}
        for variant in variants.values():
            for _ in range(2):
                variant()
        for _ in range(repeats):  # interleaved
            for label, variant in variants.items():
                start = time.perf_counter()
                variant()
                samples[label].append(time.perf_counter() - start)
        found[name] = {"wall": samples, "kernel_ms": kernel_ms(run)}
    return found


def bench_launch_blocking(repeats: int) -> dict[str, list[float]]:
    code = CHILD.format(bench_dir=str(Path(__file__).parent), repeats=repeats)
    found: dict[str, list[float]] = {}
    for label, blocking in (("plain child", False), ("CUDA_LAUNCH_BLOCKING=1 child", True)):
        env = dict(os.environ)
        env.pop("CUDA_LAUNCH_BLOCKING", None)
        if blocking:
            env["CUDA_LAUNCH_BLOCKING"] = "1"
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        found[label] = json.loads(done.stdout.strip().splitlines()[-1])["tiny_ops"]
    return found


def bench_health_check(calls: int = 5000) -> dict[str, list[float]]:
    import torch

    from gpumagic import cuda

    torch.ones(1, device="cuda").sum().item()
    for _ in range(100):
        assert cuda.async_error() is None
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        cuda.async_error()
        samples.append(time.perf_counter() - start)
    code = (
        "import time, torch\nfrom gpumagic import cuda\n"
        "s=[]\nfor _ in range(5000):\n t=time.perf_counter(); cuda.async_error(); "
        "s.append(time.perf_counter()-t)\n"
        "import statistics, json; print(json.dumps(sorted(s)[len(s)//2]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {"idle GPU": samples, "no CUDA context": [float(done.stdout.strip())]}


# ---------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    import torch

    return {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "pytest": version("pytest"),
        "python": platform.python_version(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the pytest suite runs")
    parser.add_argument("--repeats", type=int, default=7, help="repeats of each in-process loop")
    parser.add_argument("--json", type=Path, default=None, help="append JSON lines here")
    options = parser.parse_args()

    from gpumagic import cuda

    cuda.require()
    env = environment()
    rows: list[dict[str, Any]] = []

    def record(case: str, variant: str, value: dict[str, float], unit: str, **extra: Any) -> None:
        rows.append(
            {
                "bench": "sync",
                "case": case,
                "variant": variant,
                "unit": unit,
                **value,
                **extra,
                **env,
            }
        )

    suite = bench_suite(options.rounds)
    anchor = statistics.median(suite["default"])
    for mode, seconds in suite.items():
        ms = [s * 1000 for s in seconds]
        record(
            f"pytest suite of {SUITE_TESTS} small-op tests, per test",
            mode,
            median_range(ms),
            "ms",
            ratio=statistics.median(seconds) / anchor,
        )
    per_test_ms = (anchor - statistics.median(suite["plugin off"])) * 1000
    record(
        "health check per test (default - plugin off)",
        "default",
        {"median": per_test_ms},
        "ms per test",
        target_ms=0.05,
    )
    hooks_ms = (
        statistics.median(suite["hooks only (check swapped out)"])
        - statistics.median(suite["plugin off"])
    ) * 1000
    record(
        "of which the plugin's hooks (hooks only - plugin off)",
        "default",
        {"median": hooks_ms},
        "ms per test",
    )

    check = bench_health_check()
    for label, seconds in check.items():
        record(
            "gpumagic.cuda.async_error() per call",
            label,
            median_range([s * 1e6 for s in seconds]),
            "us",
        )

    loops = bench_loops(options.repeats)
    for name, found in loops.items():
        plain = statistics.median(found["wall"]["plain"])
        for variant, seconds in found["wall"].items():
            record(
                name,
                variant,
                median_range([s * 1000 for s in seconds]),
                "ms",
                ratio=statistics.median(seconds) / plain,
                kernel_ms=found["kernel_ms"],
            )

    blocking = bench_launch_blocking(options.repeats)
    plain_child = statistics.median(blocking["plain child"])
    for label, seconds in blocking.items():
        record(
            "tiny ops (4000 launches)",
            label,
            median_range([s * 1000 for s in seconds]),
            "ms",
            ratio=statistics.median(seconds) / plain_child,
        )

    if options.json:
        with options.json.open("a") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")

    print(
        f"\n{env['device']}, torch {env['torch']} (CUDA {env['cuda']}), pytest {env['pytest']}, "
        f"Python {env['python']}, {env['date']}\n"
    )
    print("| case | variant | median | min - max | ratio | CUDA kernel time |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        spread = f"{row['min']:.3g} - {row['max']:.3g}" if "min" in row else ""
        ratio = f"{row['ratio']:.2f}x" if "ratio" in row else ""
        kernel = f"{row['kernel_ms']:.2f} ms" if "kernel_ms" in row else ""
        print(
            f"| {row['case']} | {row['variant']} | {row['median']:.4g} {row['unit']} | {spread} "
            f"| {ratio} | {kernel} |"
        )


if __name__ == "__main__":
    main()
