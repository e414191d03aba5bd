"""What the leak check adds to the teardown of tests that grow, on the CPU.

The leak check's cost is in the teardown of the tests whose memory grew: settling, the
search for the leaked tensors, the holder walk, a collection of the whole heap. Those
steps are pure Python over the process's heap, so they can be timed without a GPU,
with the made-up allocator of the plugin's own tests (``tests/fake_cuda.py``) on a heap
of the size of a real suite's process (``--objects`` tracked objects made at import;
gpytorch's is about 320,000). The planted suite's tests, one of each path:

* ``test_clean``: allocates and frees (no growth);
* ``test_young_garbage``: a reference cycle holding a tensor, garbage at the end;
* ``test_promoted_garbage``: the same cycle, held while the test makes many objects,
  so the collector's automatic passes move it to the oldest generation first;
* ``test_leak_module_global``: a tensor appended to a module's list (a leak a root holds);
* ``test_leak_held_from_cpp``: a tensor in a young chain that only a reference from
  C++ keeps (no Python root: the walk ends without one, and the whole heap is collected).

Each test's whole protocol is timed (setup, call, teardown and reports: an outermost
hook wrapper). Configurations, each a fresh ``pytest`` process, rounds interleaved (odd
rounds in reverse order), the median of each test counts: ``plugin loaded`` (the anchor),
``--cuda-leak-check``, ``--cuda-leak-check --cuda-leak-trace``, and two that put back
an older behaviour for comparison in the same run: ``check, no boundary`` (the heap
that existed before each test is not frozen: what Python 3.12 got before the check
told its start-up freeze apart) and ``check, walk thawed first`` (every step of the
holder walk scans the whole heap)::

    python benchmarks/bench_leak_teardown.py [--objects 320000] [--rounds 3] [--json FILE]
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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TESTS = (
    "test_clean",
    "test_young_garbage",
    "test_promoted_garbage",
    "test_leak_module_global",
    "test_leak_held_from_cpp",
)
CONFIGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("plugin loaded", ()),
    ("--cuda-leak-check", ("--cuda-leak-check",)),
    ("--cuda-leak-check --cuda-leak-trace", ("--cuda-leak-check", "--cuda-leak-trace")),
    ("check, no boundary", ("--cuda-leak-check", "-p", "no_boundary")),
    ("check, walk thawed first", ("--cuda-leak-check", "-p", "walk_thawed_first")),
)

CONFTEST = """
import pytest

from fake_cuda import FakeAllocator

FAKE = FakeAllocator(1)
FAKE.install(pytest.MonkeyPatch())


def pytest_configure(config):
    config.option.cuda_leak_reruns = 0


@pytest.fixture(scope="session")
def fake_cuda():
    return FAKE
"""

SUITE = """
import ctypes

HEAP = [{{"i": i, "l": [i]}} for i in range({pairs})]  # two tracked objects each
KEEP = []


class Node:
    pass


def test_clean(fake_cuda):
    tensor = fake_cuda.tensor(4096)
    del tensor


def test_young_garbage(fake_cuda):
    a, b = Node(), Node()
    a.b, b.a = b, a
    a.tensor = fake_cuda.tensor(8192)


def test_promoted_garbage(fake_cuda):
    a, b = Node(), Node()
    a.b, b.a = b, a
    a.tensor = fake_cuda.tensor(8192)
    junk = [[j] for j in range(200_000)]  # automatic collections promote the cycle
    del junk


def test_leak_module_global(fake_cuda):
    KEEP.append(fake_cuda.tensor(512))


def test_leak_held_from_cpp(fake_cuda):
    top = {{"chain": [[[fake_cuda.tensor(2048)]]]}}
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(top))  # a reference from C++ only
"""

TIMING = """
import json
import os
import time

import pytest

TIMES = {}


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    started = time.perf_counter()
    yield
    TIMES[item.name] = time.perf_counter() - started


def pytest_unconfigure(config):
    with open(os.environ["BENCH_TEARDOWN_OUT"], "w") as out:
        json.dump(TIMES, out)
"""

NO_BOUNDARY = """
from pytest_cuda.leaks import heap as leak_heap

leak_heap.interpreter_frozen = lambda: -1  # every freeze found is someone else's
"""

WALK_THAWED_FIRST = """
from pytest_cuda.leaks.walk import state as walk_state

walk_state.counts_references = lambda: False
"""


def write_suite(folder: Path, objects: int) -> None:
    (folder / "fake_cuda.py").write_text((ROOT / "tests" / "fake_cuda.py").read_text())
    (folder / "conftest.py").write_text(CONFTEST)
    (folder / "test_growing.py").write_text(SUITE.format(pairs=objects // 2))
    (folder / "teardown_times.py").write_text(TIMING)
    (folder / "no_boundary.py").write_text(NO_BOUNDARY)
    (folder / "walk_thawed_first.py").write_text(WALK_THAWED_FIRST)


def run_config(folder: Path, options: tuple[str, ...]) -> dict[str, float]:
    out = folder / "times.json"
    env = os.environ | {"BENCH_TEARDOWN_OUT": str(out), "PYTHONPATH": str(folder)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += ["-p", "teardown_times", "-o", "cuda_leak_holder_search=0.3", *options]
    done = subprocess.run(command, check=False, cwd=folder, env=env, capture_output=True, text=True)
    if not out.exists():
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}{done.stderr}")
    times: dict[str, float] = json.loads(out.read_text())
    out.unlink()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=320_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="append the results as JSON lines")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {label: [] for label, _ in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_suite(folder, args.objects)
        run_config(folder, ())  # warm-up: imports, bytecode caches
        for round_ in range(args.rounds):
            for label, options in CONFIGS[:: -1 if round_ % 2 else 1]:
                runs[label].append(run_config(folder, options))
    rows = []
    anchor = {t: statistics.median(r[t] for r in runs["plugin loaded"]) for t in TESTS}
    for label, _ in CONFIGS:
        for test in TESTS:
            median = statistics.median(r[test] for r in runs[label])
            rows.append(
                {
                    "config": label,
                    "test": test,
                    "protocol_s": median,
                    "growth_s": median - anchor[test],
                }
            )
    print("| test | " + " | ".join(label for label, _ in CONFIGS) + " |")
    print("|---" * (len(CONFIGS) + 1) + "|")
    for test in TESTS:
        cells = [f"{r['protocol_s'] * 1e3:.1f} ms" for r in rows if r["test"] == test]
        print(f"| {test} | " + " | ".join(cells) + " |")
    if args.json is not None:
        from pytest_cuda.leaks.heap import interpreter_frozen

        env: dict[str, Any] = {
            "bench": "leak_teardown",
            "kind": "environment",
            "date": datetime.now(UTC).strftime("%Y-%m-%d"),
            "device": f"CPU only ({platform.machine()}, {os.cpu_count()} cores)",
            "python": sys.version.split()[0],
            "objects": args.objects,
            "rounds": args.rounds,
            "interpreter_frozen": interpreter_frozen(),
        }
        with args.json.open("a") as out:
            out.write(json.dumps(env) + "\n")
            for row in rows:
                out.write(json.dumps({"bench": "leak_teardown", "kind": "row", **row}) + "\n")


if __name__ == "__main__":
    main()
