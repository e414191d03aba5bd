"""What the leak check's heap boundary costs and saves (``pytest_cuda.leaks.heap``).

A check that settles a growing test collects garbage. A full collection walks every
object of the process; with the heap that existed before the test frozen
(``gc.freeze()`` at the baseline, ``gc.unfreeze()`` once the test is judged) it walks
only what the test made. This measures, on a heap of about 1.4 million tracked objects
(the size of a process with torch and a large suite loaded): one freeze and unfreeze,
a full collection, and a collection with the older heap frozen while a test's worth of
new objects (2,000 lists) is alive; and the search for a leaking test's tensors (one
type check per object) over the whole heap, against over what the test made, with
whether :class:`~pytest_cuda.leaks.heap.TestHeap` draws the boundary on this interpreter
(CPython 3.12 freezes objects of its own at start-up). No GPU is involved::

    python benchmarks/bench_gc_freeze.py [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from pytest_cuda.leaks.heap import TestHeap, interpreter_frozen


def _median_s(run: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return statistics.median(times)


class _Tensor:
    """Stands for a tensor: what the search keeps."""


def _search(objects: list[object]) -> list[object]:
    return [o for o in objects if type(o) is _Tensor]


def measure(objects: int = 700_000, repeat: int = 7) -> dict[str, float]:
    heap = [{"i": i, "l": [i]} for i in range(objects)]  # two tracked objects each
    gc.collect()
    boundary = TestHeap()
    boundary.begin()
    drawn = boundary.frozen
    boundary.thaw()

    def freeze_unfreeze() -> None:
        gc.freeze()
        gc.unfreeze()

    def frozen_collect() -> None:
        gc.freeze()
        young = [[j] for j in range(2000)]
        try:
            gc.collect()
        finally:
            del young
            gc.unfreeze()

    def search_young() -> None:
        gc.freeze()
        young = [_Tensor() for _ in range(100)] + [[j] for j in range(2000)]
        try:
            _search(gc.get_objects())
        finally:
            del young
            gc.unfreeze()

    def search_whole() -> None:
        young = [_Tensor() for _ in range(100)] + [[j] for j in range(2000)]
        _search(gc.get_objects())
        del young

    found = {
        "tracked_objects": float(len(gc.get_objects())),
        "interpreter_frozen": float(interpreter_frozen()),
        "boundary_drawn": float(drawn),
        "search_whole_ms": _median_s(search_whole, repeat) * 1e3,
        "search_young_ms": _median_s(search_young, repeat) * 1e3,
        "freeze_unfreeze_us": _median_s(freeze_unfreeze, 1000) * 1e6,
        "full_collect_ms": _median_s(gc.collect, repeat) * 1e3,
        "frozen_collect_ms": _median_s(frozen_collect, repeat) * 1e3,
    }
    del heap
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="append the results as JSON lines")
    args = parser.parse_args()
    found = measure()
    for key, value in found.items():
        print(f"{key}: {value:.3f}")
    if args.json is not None:
        env = {
            "bench": "gc_freeze",
            "kind": "environment",
            "date": datetime.now(UTC).strftime("%Y-%m-%d"),
            "device": f"CPU only ({platform.machine()}, {os.cpu_count()} cores)",
            "python": sys.version.split()[0],
        }
        with args.json.open("a") as out:
            out.write(json.dumps(env) + "\n")
            out.write(json.dumps({"bench": "gc_freeze", "kind": "summary", **found}) + "\n")


if __name__ == "__main__":
    main()
