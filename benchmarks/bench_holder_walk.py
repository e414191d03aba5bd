"""The leak check's holder walk on a real suite's leaking tests, on the CPU.

The walk (:func:`pytest_cuda.leaks.walk.holders.find_leak_holders`) is pure Python over the
objects a test left: the device of their tensors changes nothing it does. This replays
leaking tests of a real third-party suite in this process, as the checker sees them:
the heap that existed before the test frozen (:class:`~pytest_cuda.leaks.heap.TestHeap`),
the test run (its CPU variant), the young garbage collected, and the tensors the test
left alive taken as the leak. Then it times the walk two ways, each with the checker's
0.3 s limit and without one (``--cuda-leak-trace``), on a fresh run of the test each:

* ``thawed first``: the heap thawed before the walk, every step up scanning the whole
  heap (the anchor: the walk as it was);
* ``young first``: the walk's first steps among the test's own objects, the heap thawed
  once, for the objects that something older (or C++) holds too.

Rounds are interleaved (odd rounds in reverse order); the median counts. The default
cases are gpytorch 1.15's three tests whose CUDA variants leak under
``--cuda-leak-check`` (``docs/performance.md`` says how to get the suite)::

    python benchmarks/bench_holder_walk.py --suite PATH/TO/gpytorch [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import statistics
import sys
import time
import unittest
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpumagic import cuda
from pytest_cuda.leaks.walk.holders import find_leak_holders

CASES = (
    "examples.test_simple_gp_regression:TestSimpleGPRegression.test_fantasy_updates",
    "examples.test_fixed_noise_fanatasy_updates:TestFixedNoiseFantasies."
    "test_fixed_noise_fantasy_updates",
    "examples.test_svgp_gp_regression:TestSVGPRegression.test_regression_error",
)
MODES = ("thawed first", "young first")
BUDGETS = (0.3, None)


def _leftovers(case: str) -> tuple[list[object], dict[tuple[str, int], int], bool]:
    """Run ``case`` with the older heap frozen: the young objects after a young
    collection, the storages of the tensors among them, whether it passed."""
    import torch

    module, _, name = case.partition(":")
    cls_name, _, method = name.partition(".")
    test_class = getattr(importlib.import_module(module), cls_name)
    gc.collect()
    gc.freeze()
    result = unittest.TestResult()
    test_class(method).run(result)
    gc.collect()  # the older heap frozen: the young generations
    young = gc.get_objects()
    storages = {}
    for obj in young:
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
                storages[("cpu", storage.data_ptr())] = storage.nbytes()
            except Exception:
                continue
    return young, storages, result.wasSuccessful()


def walk_once(case: str, mode: str, budget: float | None) -> dict[str, Any]:
    import torch

    young, storages, passed = _leftovers(case)

    def facts(obj: object) -> tuple[tuple[str, int], int, str] | None:
        if not isinstance(obj, torch.Tensor):
            return None
        try:
            key = ("cpu", obj.untyped_storage().data_ptr())
        except Exception:
            return None
        return (key, storages[key], "cpu") if key in storages else None

    thaw = None if mode == "thawed first" else gc.unfreeze
    if thaw is None:
        gc.unfreeze()
    started = time.perf_counter()
    # As the checker calls it: the tensors among the young objects.
    tensors = cuda.tensors_among(young)
    young_objects = len(young)
    del young
    scan = find_leak_holders(tensors, facts, budget_s=budget, thaw=thaw)
    seconds = time.perf_counter() - started
    del tensors
    gc.unfreeze()
    row = {
        "case": case.partition(":")[2],
        "mode": mode,
        "budget_s": budget,
        "seconds": seconds,
        "complete": scan.complete,
        "passed": passed,
        "young_objects": young_objects,
        "leaked_storages": len(storages),
        "holders": [h.describe() for h in scan.holders[:3]],
        "notes": list(scan.notes),
    }
    del scan
    gc.collect()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", type=Path, required=True, help="the suite's checkout")
    parser.add_argument("--case", action="append", help="module:Class.method (repeatable)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="append the results as JSON lines")
    args = parser.parse_args()
    suite = args.suite.resolve()
    out = args.json.resolve() if args.json is not None else None
    os.chdir(suite)
    sys.path[:0] = [str(suite / "test"), str(suite)]
    warnings.simplefilter("ignore")
    cases = args.case or list(CASES)
    for case in cases:  # imports and first-call caches out of the timed runs
        walk_once(case, "young first", 0.0)
    heap = len(gc.get_objects())
    started = time.perf_counter()
    gc.collect()
    full_collect = time.perf_counter() - started
    rows: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for case in cases:
            for mode in MODES[:: -1 if round_ % 2 else 1]:
                for budget in BUDGETS:
                    rows.append(walk_once(case, mode, budget) | {"round": round_})
    summary = []
    for case in cases:
        name = case.partition(":")[2]
        for budget in BUDGETS:
            times = {
                mode: statistics.median(
                    r["seconds"]
                    for r in rows
                    if r["case"] == name and r["mode"] == mode and r["budget_s"] == budget
                )
                for mode in MODES
            }
            last = {
                mode: next(
                    r
                    for r in reversed(rows)
                    if r["case"] == name and r["mode"] == mode and r["budget_s"] == budget
                )
                for mode in MODES
            }
            summary.append(
                {
                    "case": name,
                    "budget_s": budget,
                    "thawed_s": times["thawed first"],
                    "young_s": times["young first"],
                    "ratio_to_thawed": times["young first"] / times["thawed first"],
                    "complete": {m: last[m]["complete"] for m in MODES},
                    "holders": {m: last[m]["holders"] for m in MODES},
                    "young_objects": last["young first"]["young_objects"],
                    "leaked_storages": last["young first"]["leaked_storages"],
                }
            )
    print(f"heap: {heap:,} objects; a full collection: {full_collect * 1e3:.0f} ms")
    print("| test | limit | thawed first | young first | ratio | complete (thawed, young) |")
    print("|---|---|---:|---:|---:|---|")
    for s in summary:
        limit = "none" if s["budget_s"] is None else f"{s['budget_s']} s"
        done = ", ".join(str(s["complete"][m]) for m in MODES)
        print(
            f"| {s['case']} | {limit} | {s['thawed_s']:.3f} s | {s['young_s']:.3f} s | "
            f"{s['ratio_to_thawed']:.3f} | {done} |"
        )
    for s in summary:
        for mode in MODES:
            print(f"  {s['case']} [{s['budget_s']}] {mode}: {s['holders'][mode][:1]}")
    if out is not None:
        import torch

        env = {
            "bench": "holder_walk",
            "kind": "environment",
            "date": datetime.now(UTC).strftime("%Y-%m-%d"),
            "device": f"CPU only ({platform.machine()}, {os.cpu_count()} cores)",
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "suite": f"gpytorch {importlib.import_module('gpytorch').__version__}",
            "heap_objects": heap,
            "full_collect_ms": full_collect * 1e3,
            "rounds": args.rounds,
        }
        with out.open("a") as file:
            file.write(json.dumps(env) + "\n")
            for s in summary:
                file.write(json.dumps({"bench": "holder_walk", "kind": "summary", **s}) + "\n")


if __name__ == "__main__":
    main()
