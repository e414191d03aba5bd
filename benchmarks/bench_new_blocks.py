"""What the leak check's block attribution costs per leaking test, on the CPU.

When a test leaks, the check reads torch's memory snapshot and keeps the live blocks
allocated since the test began (:func:`gpumagic.stacks.blocks_allocated_since`), then
groups them by allocating stack (:func:`gpumagic.stacks.group_by_stack`). Both are pure
Python over the snapshot; this times them on a synthetic snapshot of the size a real
suite's process gives (gpytorch's: the allocator's ring of 50,000 events full, a few
thousand live blocks, each with its recorded Python stack), so no GPU is needed.
torch's own ``_snapshot()`` call (about 35 ms on an H100 there) is not in it.

Two cases: ``ring holds the start`` (the ring reaches back to the test's start: new
blocks are told by their ``alloc`` event), and ``ring wrapped`` (the test allocated
more than the ring holds: every live block's stack decides). Medians of ``--rounds``::

    python benchmarks/bench_new_blocks.py [--events 50000] [--since 20000] [--blocks 4000]
        [--new 300] [--frames 30] [--rounds 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpumagic.stacks import FrameFilter, blocks_allocated_since, group_by_stack

TEST_FILE = "/suite/test/examples/test_model.py"
TEST_FUNCTION = "test_fit"
START_US = 1_700_000_000_000_000


def _frames(i: int, depth: int, library: str) -> list[dict[str, Any]]:
    """A recorded stack, innermost first, as torch gives it: torch's frames, the
    suite's library, the test function, then pytest's and unittest's."""
    inner = [
        {"filename": f"{library}/torch/nn/functional.py", "line": 100 + i % 7, "name": "linear"},
        {"filename": f"{library}/gpytorch/kernels/kernel.py", "line": 400 + i % 13, "name": "fwd"},
    ]
    middle = [
        {"filename": f"{library}/gpytorch/models/m{k}.py", "line": 10 + (i + k) % 5, "name": "f"}
        for k in range(max(0, depth - 12))
    ]
    test = [{"filename": TEST_FILE, "line": 40 + i % 3, "name": TEST_FUNCTION}]
    outer = [
        {"filename": f"{library}/_pytest/python.py", "line": 150 + k, "name": "call"}
        for k in range(9)
    ]
    return inner + middle + test + outer


def synthetic_snapshot(
    events: int, since: int, blocks: int, new: int, depth: int
) -> dict[str, Any]:
    """One device: ``blocks`` live blocks (``new`` of them allocated after
    :data:`START_US`), in segments of eight blocks with a free one between, and a ring of
    ``events`` allocator events (allocations only, as the check records them), the last
    ``since`` of them after the start."""
    library = f"{sys.prefix}/lib/python3/site-packages"
    segments = []
    address = 0x7F0000000000
    live: list[dict[str, Any]] = []
    for i in range(blocks):
        size = 512 * (1 + i % 64)
        block: dict[str, Any] = {
            "address": address,
            "size": size,
            "requested_size": size - 3,
            "state": "active_allocated",
            "frames": _frames(i, depth, library),
        }
        live.append(block)
        address += size + 512
    for first in range(0, blocks, 8):
        members: list[dict[str, Any]] = []
        for block in live[first : first + 8]:
            members += [block, {"address": block["address"] + block["size"], "size": 512}]
        segments.append({"device": 0, "address": members[0]["address"], "blocks": members})
    ring = []
    newest = live[-new:] if new else []
    for i in range(events):
        after = i >= events - since
        time_us = START_US + (i - (events - since)) + (1 if after else -1)
        if after and i >= events - len(newest):
            addr = newest[i - (events - len(newest))]["address"]
        else:
            addr = 0x100000000 + 512 * i  # a block freed since
        ring.append({"action": "alloc", "addr": addr, "size": 512, "time_us": time_us})
    return {"segments": segments, "device_traces": [ring]}


def _time(case: str, snapshot: dict[str, Any], start_us: int, rounds: int) -> dict[str, Any]:
    outermost = (TEST_FILE, TEST_FUNCTION)
    is_user = FrameFilter.default().is_user
    since_s: list[float] = []
    group_s: list[float] = []
    found = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        found = blocks_allocated_since(snapshot, start_us, outermost)
        t1 = time.perf_counter()
        group_by_stack(found, is_user, outermost=outermost)
        t2 = time.perf_counter()
        since_s.append(t1 - t0)
        group_s.append(t2 - t1)
    return {
        "case": case,
        "blocks_found": len(found),
        "blocks_allocated_since_ms": statistics.median(since_s) * 1e3,
        "group_by_stack_ms": statistics.median(group_s) * 1e3,
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--since", type=int, default=20_000)
    parser.add_argument("--blocks", type=int, default=4_000)
    parser.add_argument("--new", type=int, default=300)
    parser.add_argument("--frames", type=int, default=30, help="frames per recorded stack")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path, help="append the results as JSON lines")
    args = parser.parse_args()
    snapshot = synthetic_snapshot(args.events, args.since, args.blocks, args.new, args.frames)
    wrapped = {**snapshot, "device_traces": [snapshot["device_traces"][0][-args.since :]]}
    rows = [
        _time("ring holds the start", snapshot, START_US, args.rounds),
        _time("ring wrapped", wrapped, START_US, args.rounds),
    ]
    shape = {k: getattr(args, k) for k in ("events", "since", "blocks", "new", "frames")}
    for row in rows:
        print(
            f"{row['case']:<22} {row['blocks_found']:>5} blocks  "
            f"blocks_allocated_since {row['blocks_allocated_since_ms']:7.2f} ms  "
            f"group_by_stack {row['group_by_stack_ms']:6.2f} ms"
        )
    if args.json is not None:
        environment = {
            "kind": "environment",
            "bench": "new_blocks",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "python": platform.python_version(),
            "machine": platform.processor() or platform.machine(),
            **shape,
        }
        with args.json.open("a") as out:
            for row in (environment, *({"bench": "new_blocks", **shape, **r} for r in rows)):
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
