"""What pytest_cuda's leak checks cost per test, against no check and PyTorch's checker.

Generates two suites of clean tiny-op CUDA tests (``y = x * 2 + 1; y.sum()``): one on a
module-level tensor, one taking a function-scoped CUDA fixture. Runs them in this
process with ``pytest.main``, each configuration once per round, rounds interleaved so
drift hits every configuration alike, and times every test's whole protocol (setup,
call, teardown, reports) with an outermost hook wrapper:

* ``none``: the plugin loaded, no leak option (the anchor);
* ``check``: ``--cuda-leak-check``;
* ``trace``: ``--cuda-leak-check --cuda-leak-trace`` (allocation stacks recorded);
* ``torch``: PyTorch's ``CudaMemoryLeakCheck`` (``torch.testing._internal``) around each
  test's call, as PyTorch's own suites wrap their test methods (on the first
  ``--torch-tests`` tests only: it collects garbage after every test). Skipped, with the
  reason, when it cannot be imported (it needs the ``expecttest`` package).

The overhead of a configuration is the median over tests and rounds of its paired
difference with ``none`` (same test, same round).

    python benchmarks/bench_leaks.py [--tests 500] [--rounds 7] [--json results.jsonl]
    python benchmarks/bench_leaks.py --suite PATH [--files ...] [-k EXPR]  (a real suite)

Appends one JSON object to ``--json`` and prints a markdown table last.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gpumagic import cuda

if TYPE_CHECKING:
    from collections.abc import Generator

PER_FILE = 100

MODULE_SUITE = """
import torch

X = torch.ones(256, device="{device}")
"""
MODULE_TEST = """
def test_{i}():
    y = X * 2 + 1
    z = y.sum()
    assert z.numel() == 1
"""
FIXTURE_SUITE = """
import pytest
import torch


@pytest.fixture
def x():
    return torch.ones(256, device="{device}")
"""
FIXTURE_TEST = """
def test_{i}(x):
    y = x * 2 + 1
    z = y.sum()
    assert z.numel() == 1
"""


class ProtocolTimer:
    """Times each test's whole protocol, outermost, and synchronizes around the loop."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, object, object]:
        t0 = time.perf_counter()
        try:
            return (yield)
        finally:
            self.seconds[item.nodeid] = time.perf_counter() - t0

    @pytest.hookimpl(wrapper=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, object, object]:
        if cuda.is_initialized():
            cuda.synchronize()
        try:
            return (yield)
        finally:
            if cuda.is_initialized():
                cuda.synchronize()


class TorchChecker:
    """PyTorch's ``CudaMemoryLeakCheck`` around each test's call phase."""

    def __init__(self, checker: Any) -> None:
        self.checker = checker

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, object, object]:
        class Case:
            def id(self) -> str:
                return item.nodeid

            def before_cuda_memory_leak_check(self) -> None:
                pass

        with self.checker(Case()):
            return (yield)


def torch_checker() -> tuple[Any | None, str]:
    try:
        from torch.testing._internal.common_utils import CudaMemoryLeakCheck
    except Exception as exc:  # the testing module pulls in expecttest and more
        return None, f"not importable: {type(exc).__name__}: {exc}"
    return CudaMemoryLeakCheck, "torch.testing._internal.common_utils.CudaMemoryLeakCheck"


def write_suite(
    root: Path, name: str, *, header: str, test: str, count: int, device: str
) -> list[str]:
    files = []
    for f in range(max(1, count // PER_FILE)):
        body = header.format(device=device) + "".join(test.format(i=i) for i in range(PER_FILE))
        path = root / f"test_{name}_{f:02d}.py"
        path.write_text(body)
        files.append(str(path))
    return files


def run(targets: list[str], options: list[str], plugins: list[object]) -> dict[str, float]:
    timer = ProtocolTimer()
    args = [*targets, "-q", "-p", "no:cacheprovider", *options]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = pytest.main(args, plugins=[timer, *plugins])
    if code != 0:
        raise SystemExit(f"pytest {' '.join(options)} exited {code}:\n{out.getvalue()[-3000:]}")
    gc.collect()
    return timer.seconds


def paired_overhead(runs: list[dict[str, float]], anchors: list[dict[str, float]]) -> list[float]:
    return [run[k] - anchor[k] for run, anchor in zip(runs, anchors, strict=True) for k in run]


def per_test(runs: list[dict[str, float]]) -> list[float]:
    return [t for run in runs for t in run.values()]


def quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


def iqr_us(values: list[float]) -> str:
    q1, q3 = quartiles(values)
    return f"{q1 * 1e6:.0f} to {q3 * 1e6:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=500, help="tests per suite (default 500)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds (default 7)")
    parser.add_argument("--torch-tests", type=int, default=40, help="tests under PyTorch's")
    parser.add_argument("--json", type=Path, help="append one JSON line with the results")
    parser.add_argument(
        "--smoke-cpu",
        action="store_true",
        help="run the harness on CPU tensors where there is no GPU (the checks then have "
        "nothing to measure; for testing this script)",
    )
    parser.add_argument(
        "--suite",
        type=Path,
        help="instead: a third-party suite's root, run under each configuration "
        "(bench_leaks_suite.py); with --files (its test files) and -k",
    )
    parser.add_argument("--files", nargs="*", default=[], help="with --suite: test files")
    parser.add_argument("-k", dest="keyword", help="with --suite: pytest's -k")
    parser.add_argument("--name", default="", help="with --suite: its name in the results")
    parser.add_argument(
        "--suite-rounds", type=int, default=2, help="with --suite: interleaved rounds (default 2)"
    )
    parser.add_argument(
        "--xdist", action="store_true", help="with --suite: also the check under -n 4, once"
    )
    parser.add_argument(
        "--no-trace",
        action="store_true",
        help="with --suite: leave out the --cuda-leak-trace configuration (more rounds fit)",
    )
    parser.add_argument(
        "--limit",
        action="store_true",
        help="with --suite: also --cuda-limit-memory=1TiB (a limit no test reaches)",
    )
    parser.add_argument(
        "--with-torch",
        action="store_true",
        help="with --suite: instead, compare PyTorch's CudaMemoryLeakCheck (on the first "
        "$TORCH_LEAK_CHECK_TESTS CUDA tests, default 200) and --cuda-leak-check",
    )
    args = parser.parse_args()
    if args.suite is not None:
        import bench_leaks_suite

        if args.with_torch:
            bench_leaks_suite.compare_with_torch(args.suite, args.files, args.keyword, args.json)
        else:
            bench_leaks_suite.main(
                args.suite,
                args.files,
                args.keyword,
                args.json,
                args.suite_rounds,
                name=args.name,
                xdist=args.xdist,
                trace=not args.no_trace,
                limit=args.limit,
            )
        return
    status = cuda.status()
    date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    device = "cuda" if status.available else "cpu"
    if not status.available and not args.smoke_cpu:
        result = {"benchmark": "leaks", "date": date, "skipped": status.reason}
        if args.json:
            with args.json.open("a") as out:
                out.write(json.dumps(result) + "\n")
        print("| benchmark | result |\n| --- | --- |")
        print(f"| leak checks | not run: CUDA unavailable ({status.reason}) |")
        return

    torch = cuda.torch_module()
    torch.ones(1, device=device)  # the context, before any timing
    checker, checker_name = torch_checker() if status.available else (None, "no GPU")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sys.path.insert(0, str(root))
        module_files = write_suite(
            root, "module", header=MODULE_SUITE, test=MODULE_TEST, count=args.tests, device=device
        )
        fixture_files = write_suite(
            root,
            "fixture",
            header=FIXTURE_SUITE,
            test=FIXTURE_TEST,
            count=args.tests,
            device=device,
        )
        first = [f"{module_files[0]}::test_{i}" for i in range(min(args.torch_tests, PER_FILE))]
        configs: dict[str, tuple[list[str], list[str], list[object]]] = {
            "none": (module_files, [], []),
            "check": (module_files, ["--cuda-leak-check"], []),
            "trace": (module_files, ["--cuda-leak-check", "--cuda-leak-trace"], []),
            "fixture none": (fixture_files, [], []),
            "fixture check": (fixture_files, ["--cuda-leak-check"], []),
        }
        if checker is not None:
            configs["torch none"] = (first, [], [])
            configs["torch"] = (first, [], [TorchChecker(checker)])
        for targets, options, plugins in configs.values():  # warm-up round
            run(targets, options, plugins)
        times: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
        for r in range(args.rounds):
            order = list(configs) if r % 2 == 0 else list(reversed(configs))
            for name in order:
                targets, options, plugins = configs[name]
                times[name].append(run(targets, options, plugins))

    def paired(name: str, anchor: str) -> list[float]:
        return paired_overhead(times[name], times[anchor])

    def overhead(name: str, anchor: str) -> float:
        return statistics.median(paired(name, anchor))

    medians = {name: statistics.median(per_test(runs)) for name, runs in times.items()}
    rows = [
        ("none", "plugin loaded, no leak option (anchor)", "none"),
        ("check", "`--cuda-leak-check`", "none"),
        ("trace", "`--cuda-leak-check --cuda-leak-trace`", "none"),
        ("fixture none", "fixture suite, no leak option (anchor)", "fixture none"),
        ("fixture check", "fixture suite, `--cuda-leak-check`", "fixture none"),
    ]
    if checker is not None:
        rows += [
            ("torch none", f"first {args.torch_tests} tests, no check (anchor)", "torch none"),
            (
                "torch",
                f"first {args.torch_tests} tests, PyTorch's CudaMemoryLeakCheck (call)",
                "torch none",
            ),
        ]
    result: dict[str, Any] = {
        "benchmark": "leaks",
        "date": date,
        "device": status.devices[0].name if status.available else "CPU smoke run",
        "driver": status.driver_version,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "pytest": pytest.__version__,
        "tests": args.tests,
        "rounds": args.rounds,
        "torch_checker": checker_name,
        "median_per_test_us": {n: round(m * 1e6, 1) for n, m in medians.items()},
        "overhead_per_test_us": {
            name: round(overhead(name, anchor) * 1e6, 1) for name, _, anchor in rows
        },
        # The spread the overheads come with: the interquartile range of the paired
        # differences (a cost smaller than it is noise, and the docs say so).
        "overhead_iqr_us": {
            name: [round(q * 1e6, 1) for q in quartiles(paired(name, anchor))]
            for name, _, anchor in rows
            if name != anchor
        },
        "trace_overhead_pct": round(100 * overhead("trace", "none") / medians["none"], 1),
        "check_overhead_pct": round(100 * overhead("check", "none") / medians["none"], 1),
    }
    if args.json:
        with args.json.open("a") as out:
            out.write(json.dumps(result) + "\n")

    print(
        f"leak-check cost per clean tiny-op test: {args.tests} tests x {args.rounds} rounds, "
        f"in-process; {result['device']}, torch {result['torch']}, pytest {pytest.__version__}"
    )
    if checker is None:
        print(f"PyTorch's CudaMemoryLeakCheck: {checker_name}")
    print(
        f"--cuda-leak-trace on the tiny-op suite: {result['trace_overhead_pct']:+.1f} % "
        f"(--cuda-leak-check alone {result['check_overhead_pct']:+.1f} %)\n"
    )
    print("| configuration | median per test (µs) | IQR (µs) | overhead vs anchor (µs) |")
    print("| --- | ---: | ---: | ---: |")
    for name, label, anchor in rows:
        extra = "" if name == anchor else f"{overhead(name, anchor) * 1e6:+.1f}"
        spread = iqr_us(per_test(times[name]))
        print(f"| {label} | {medians[name] * 1e6:.0f} | {spread} | {extra} |")


if __name__ == "__main__":
    main()
