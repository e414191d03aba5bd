"""What ``%%gpumem --timeline`` costs, measured in a real InteractiveShell on the GPU.

* ``%%gpumem --timeline`` on a cell of 10,000 small ops (``y = x * 2``: a kernel and an
  allocation each), against the cell alone, plain ``%%gpumem`` and ``--trace``.
  Target: adds <= 25 %.
* The same cell under ``--timeline``'s recording alone, nothing read back: the part
  of the cost that is torch's stack capture.
* The same on the worst case, a bare loop of ``torch.empty(256)``, for reference.
* Where the time goes, once per run: the allocator events of the ops cell, the time of
  ``torch.cuda.memory._snapshot()`` with them, and of the replay
  (``memory_timeline.build_timeline``) and the SVG.
* For reference, torch's recording per ``torch.empty(256)`` (allocation + free): off,
  ``--trace``'s setting, ``--timeline``'s (``enabled="all"``, ``context="alloc"``,
  Python stacks, ``free_completed`` skipped) and torch's default.

Runs are interleaved (A, B, C, A, B, C, ...) so drift in machine load hits all sides
alike; each cell ends with ``torch.cuda.synchronize()`` so GPU work is inside the time.
Medians with the interquartile range.

    python benchmarks/bench_gpumem_timeline.py [--json results.jsonl]

Appends one JSON object per measurement to ``--json`` and prints a markdown table last.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from bench_gpumem import cell, interleaved, quantiles, recording_cost
from gpumagic import cuda
from gpumagic.gc_pause import paused_gc
from gpumagic.memory_svg import timeline_svg
from gpumagic.memory_timeline import TIMELINE_MAX_ENTRIES, build_timeline

if TYPE_CHECKING:
    from collections.abc import Callable

SETUP = "import torch\nx = torch.randn(4096, device='cuda')\ntorch.cuda.synchronize()\n"
LOOP_OPS = "for _ in range(10_000):\n    y = x * 2\ntorch.cuda.synchronize()\n"
LOOP_EMPTY = (
    "for _ in range(10_000):\n    t = torch.empty(256, device='cuda')\ntorch.cuda.synchronize()\n"
)


def recorded(shell: Any, source: str) -> Callable[[], object]:
    """The cell under ``--timeline``'s recording setting with nothing read back: what
    torch's stack capture alone costs (the floor of any timeline built on it)."""
    run = cell(shell, source)

    def run_recorded() -> object:
        cuda.start_memory_history(
            TIMELINE_MAX_ENTRIES, events=True, skip_actions=("free_completed",)
        )
        try:
            return run()
        finally:
            cuda.stop_memory_history()

    return run_recorded


#: The recording modes compared per allocation: off, ``--trace``'s, ``--timeline``'s and
#: torch's default (with Python stacks).
RECORDING_MODES: dict[str, dict[str, Any] | None] = {
    "off": None,
    "trace": {"enabled": "state", "context": "state", "stacks": "python"},
    "timeline": {
        "enabled": "all",
        "context": "alloc",
        "stacks": "python",
        "skip_actions": ["free_completed"],
    },
    "torch_default_python": {"enabled": "all", "context": "all", "stacks": "python"},
}


def breakdown(shell: Any, torch: Any) -> dict[str, float]:
    """The ops cell once under the timeline's recording: events, snapshot, replay, SVG."""
    cuda.start_memory_history(TIMELINE_MAX_ENTRIES, events=True, skip_actions=("free_completed",))
    try:
        start_requested = cuda.allocator_stats(0).requested
        shell.run_cell(LOOP_OPS)
        with paused_gc():  # as %%gpumem reads it
            began = time.perf_counter()
            snapshot = cuda.memory_snapshot()
            snapshot_ms = (time.perf_counter() - began) * 1e3
    finally:
        cuda.stop_memory_history()
    events = snapshot["device_traces"][0]
    with paused_gc():
        began = time.perf_counter()
        timeline = build_timeline(
            events,
            device=0,
            start_allocated=start_requested,
            start_reserved=cuda.allocator_stats(0).reserved,
            end_allocated=cuda.allocator_stats(0).requested,
        )
        replay_ms = (time.perf_counter() - began) * 1e3
    began = time.perf_counter()
    timeline_svg(timeline, "cuda:0")
    svg_ms = (time.perf_counter() - began) * 1e3
    return {
        "events": len(events),
        "complete": timeline.complete,
        "snapshot_ms": snapshot_ms,
        "replay_ms": replay_ms,
        "svg_ms": svg_ms,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="append one JSON object per measurement to this file")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    status = cuda.status()
    if not status.available:
        print(f"bench_gpumem_timeline: no CUDA here ({status.reason}); nothing to measure")
        return 0
    import torch
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "gpumagic")
    if not shell.run_cell(SETUP).success:
        raise SystemExit("benchmark setup failed")
    common = {
        "bench": "gpumem_timeline",
        "device": status.devices[0].name,
        "devices": len(status.devices),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": status.driver_version,
        "python": platform.python_version(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
    }
    records: list[dict[str, Any]] = []
    ratios: dict[str, float] = {}
    for label, body in (("ops", LOOP_OPS), ("empty", LOOP_EMPTY)):
        loop = interleaved(
            {
                f"loop_{label}": cell(shell, body),
                f"loop_{label}_gpumem": cell(shell, "%%gpumem\n" + body),
                f"loop_{label}_trace": cell(shell, "%%gpumem --trace\n" + body),
                f"loop_{label}_timeline": cell(shell, "%%gpumem --timeline\n" + body),
                f"loop_{label}_recording": recorded(shell, body),
            },
            repeats=args.repeats,
            warmup=2,
        )
        base = statistics.median(loop[f"loop_{label}"])
        for name, samples in loop.items():
            entry = {**common, "name": name, "unit": "ms", **quantiles(samples)}
            entry["ratio"] = statistics.median(samples) / base
            records.append(entry)
            ratios[name] = entry["ratio"]
    parts = breakdown(shell, torch)
    records.append({**common, "name": "timeline_breakdown_ops", **parts})
    per_alloc = recording_cost(torch, RECORDING_MODES)
    records.append({**common, "name": "recording_us_per_allocation", "unit": "us", **per_alloc})

    if args.json:
        with open(args.json, "a") as out:
            for entry in records:
                out.write(json.dumps(entry) + "\n")

    med = {r["name"]: r for r in records if "median" in r}

    def ms(name: str) -> str:
        r = med[name]
        return f"{r['median']:.3f} ({r['q1']:.3f}-{r['q3']:.3f})"

    print(
        f"\n{common['device']}, torch {common['torch']} (CUDA {common['cuda']}), driver "
        f"{common['driver']}, Python {common['python']}, {common['date']}; ms: median (IQR)\n"
    )
    print("| measurement | time | ratio to the cell alone | target | met |")
    print("|---|---|---|---|---|")
    for label, text in (("ops", "`y = x * 2` x10,000"), ("empty", "`torch.empty(256)` x10,000")):
        print(f"| cell alone: {text} | {ms(f'loop_{label}')} | 1 | | |")
        for option in ("gpumem", "trace", "timeline"):
            name = f"loop_{label}_{option}"
            flag = "" if option == "gpumem" else f" --{option}"
            target, met = "", ""
            if label == "ops" and option == "timeline":
                target, met = "≤ +25 %", "yes" if ratios[name] <= 1.25 else "no"
            print(f"| `%%gpumem{flag}` | {ms(name)} | {ratios[name]:.3f}x | {target} | {met} |")
        name = f"loop_{label}_recording"
        print(f"| `--timeline`'s recording alone | {ms(name)} | {ratios[name]:.3f}x | | |")
    print(
        f"| `--timeline` on the ops cell: {parts['events']} events "
        f"(complete: {parts['complete']}); snapshot / replay / SVG (ms) | "
        f"{parts['snapshot_ms']:.2f} / {parts['replay_ms']:.2f} / {parts['svg_ms']:.2f} "
        "| | | |"
    )
    print(
        "| recording per `torch.empty(256)` (µs): off / `--trace` / `--timeline` / torch "
        f"default (Python stacks) | {per_alloc['off']:.2f} / {per_alloc['trace']:.2f} / "
        f"{per_alloc['timeline']:.2f} / {per_alloc['torch_default_python']:.2f} | | | |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
