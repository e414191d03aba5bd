"""What %gpumem and %%gpumem cost, measured in a real InteractiveShell on the GPU.

* ``%gpumem`` per call (display included, output to a string), against torch's own
  reports measured in the same run: ``torch.cuda.memory_summary()`` and
  ``torch.cuda.list_gpu_processes()``. Target: <= 10 ms per call on 2 devices.
* ``%gpumem --top 10`` on a namespace holding a 24-layer MLP, its gradients and
  Adam state (the name walk), for reference.
* ``%%gpumem`` on a one-line cell: the time it adds to the cell, and against IPython's
  ``%%capture`` (the same nested-cell mechanism without any measurement). Target:
  adds <= 1 ms.
* ``%%gpumem --trace`` on cells making 10,000 small allocations: a loop of
  ``y = x * 2`` (a kernel and an allocation each) and the worst case, a bare loop of
  ``torch.empty``. Target: adds <= 25 %.
* For reference, torch's allocation-stack recording per allocation: off, the
  ``--trace`` setting (``enabled="state"``, Python frames) and torch's default
  (``enabled="all"``, Python frames).

Runs are interleaved (A, B, C, A, B, C, ...) so drift in machine load hits all sides
alike; each cell ends with ``torch.cuda.synchronize()`` so GPU work is inside the time.
Medians with the interquartile range.

    python benchmarks/bench_gpumem.py [--json results.jsonl]

Appends one JSON object per measurement to ``--json`` and prints a markdown table last.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from gpumagic import cuda

if TYPE_CHECKING:
    from collections.abc import Callable

MLP = """
import torch
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)]).cuda()
opt = torch.optim.Adam(model.parameters())
model(torch.randn(64, 1024, device="cuda")).sum().backward()
opt.step()
x = torch.randn(4096, device="cuda")
acts = [torch.empty(2**20, device="cuda") for _ in range(16)]
torch.cuda.synchronize()
"""

LOOP_OPS = "for _ in range(10_000):\n    y = x * 2\ntorch.cuda.synchronize()\n"
LOOP_EMPTY = (
    "for _ in range(10_000):\n    t = torch.empty(256, device='cuda')\ntorch.cuda.synchronize()\n"
)
SMALL_CELL = "y = x + 1\ntorch.cuda.synchronize()\n"


def quantiles(samples: list[float]) -> dict[str, float]:
    q1, median, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return {"median": median, "q1": q1, "q3": q3, "n": len(samples)}


def timed(run: Callable[[], object]) -> float:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        start = time.perf_counter()
        run()
        return time.perf_counter() - start


def interleaved(
    runs: dict[str, Callable[[], object]], repeats: int, warmup: int
) -> dict[str, list[float]]:
    for _ in range(warmup):
        for run in runs.values():
            timed(run)
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            samples[name].append(timed(run) * 1e3)
    return samples


def cell(shell: Any, source: str) -> Callable[[], object]:
    def run() -> object:
        result = shell.run_cell(source)
        if not result.success:
            raise RuntimeError(f"benchmark cell failed: {source!r}: {result.error_in_exec}")
        return result

    return run


#: The recording modes :func:`recording_cost` compares by default: off, ``--trace``'s
#: setting and torch's default (with Python stacks).
RECORDING_MODES: dict[str, dict[str, Any] | None] = {
    "off": None,
    "state_python": {"enabled": "state", "context": "state", "stacks": "python"},
    "all_python": {"enabled": "all", "context": "all", "stacks": "python"},
}


def recording_cost(
    torch: Any,
    modes: dict[str, dict[str, Any] | None] = RECORDING_MODES,
    allocations: int = 20_000,
) -> dict[str, float]:
    """Microseconds per ``torch.empty(256)`` (allocation + free) under each recording mode
    (``None``: recording off), interleaved, median of five rounds."""
    found: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(5):
        for name, mode in modes.items():
            if mode is not None:
                try:
                    torch.cuda.memory._record_memory_history(max_entries=100_000, **mode)
                except TypeError:  # a torch without skip_actions
                    older = {k: v for k, v in mode.items() if k != "skip_actions"}
                    torch.cuda.memory._record_memory_history(max_entries=100_000, **older)
            try:
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(allocations):
                    torch.empty(256, device="cuda")
                torch.cuda.synchronize()
                found[name].append((time.perf_counter() - start) / allocations * 1e6)
            finally:
                if mode is not None:
                    torch.cuda.memory._record_memory_history(None)
    return {name: statistics.median(values) for name, values in found.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="append one JSON object per measurement to this file")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()

    status = cuda.status()
    if not status.available:
        print(f"bench_gpumem: no CUDA here ({status.reason}); nothing to measure")
        return 0
    import torch
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "gpumagic")
    if not shell.run_cell(MLP).success:
        raise SystemExit("benchmark setup failed")
    devices = len(status.devices)
    common = {
        "bench": "gpumem",
        "device": status.devices[0].name,
        "devices": devices,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": status.driver_version,
        "python": platform.python_version(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
    }
    records: list[dict[str, Any]] = []

    def record(name: str, samples: list[float], **extra: Any) -> dict[str, Any]:
        entry = {**common, "name": name, "unit": "ms", **quantiles(samples), **extra}
        records.append(entry)
        return entry

    # %gpumem per call, against torch's own reports.
    line = interleaved(
        {
            "gpumem": lambda: shell.run_line_magic("gpumem", ""),
            "gpumem_o": lambda: shell.run_line_magic("gpumem", "-o"),
            "memory_summary": lambda: print(torch.cuda.memory_summary()),
            "list_gpu_processes": lambda: print(torch.cuda.list_gpu_processes()),
        },
        repeats=args.repeats,
        warmup=10,
    )
    for name, samples in line.items():
        record(name, samples)
    top = interleaved(
        {"gpumem_top": lambda: shell.run_line_magic("gpumem", "--top 10")},
        repeats=30,
        warmup=3,
    )
    scan = shell.run_line_magic("gpumem", "--top 10 -o").report.scan
    record("gpumem_top", top["gpumem_top"], objects_walked=scan.visited)

    # %%gpumem on a one-line cell.
    small = interleaved(
        {
            "cell": cell(shell, SMALL_CELL),
            "cell_gpumem": cell(shell, "%%gpumem\n" + SMALL_CELL),
            "cell_capture": cell(shell, "%%capture\n" + SMALL_CELL),
        },
        repeats=args.repeats,
        warmup=10,
    )
    for name, samples in small.items():
        record(name, samples)
    added = [g - c for g, c in zip(small["cell_gpumem"], small["cell"], strict=True)]
    beyond_capture = [
        g - c for g, c in zip(small["cell_gpumem"], small["cell_capture"], strict=True)
    ]
    record("cell_gpumem_added", added)
    record("cell_gpumem_beyond_capture", beyond_capture)

    # --trace on 10,000 small allocations.
    trace_ratios = {}
    for label, body in (("ops", LOOP_OPS), ("empty", LOOP_EMPTY)):
        loop = interleaved(
            {
                f"loop_{label}": cell(shell, body),
                f"loop_{label}_gpumem": cell(shell, "%%gpumem\n" + body),
                f"loop_{label}_trace": cell(shell, "%%gpumem --trace\n" + body),
            },
            repeats=15,
            warmup=2,
        )
        for name, samples in loop.items():
            record(name, samples)
        base = statistics.median(loop[f"loop_{label}"])
        trace_ratios[label] = statistics.median(loop[f"loop_{label}_trace"]) / base

    per_alloc = recording_cost(torch)
    records.append({**common, "name": "recording_us_per_allocation", "unit": "us", **per_alloc})

    if args.json:
        with open(args.json, "a") as out:
            for entry in records:
                out.write(json.dumps(entry) + "\n")

    med = {r["name"]: r for r in records if "median" in r}

    def ms(name: str) -> str:
        r = med[name]
        return f"{r['median']:.3f} ({r['q1']:.3f}-{r['q3']:.3f})"

    gpumem_ms = med["gpumem"]["median"]
    summary_ms = med["memory_summary"]["median"]
    added_ms = med["cell_gpumem_added"]["median"]
    rows = [
        (
            f"`%gpumem` per call ({devices} device{'s' if devices > 1 else ''})",
            ms("gpumem"),
            f"{gpumem_ms / summary_ms:.2f}x `memory_summary()` ({ms('memory_summary')})",
            "≤ 10 ms on 2 devices",
            "yes" if gpumem_ms <= 10 else "no",
        ),
        ("`%gpumem -o` (no display)", ms("gpumem_o"), "", "", ""),
        (
            "`torch.cuda.list_gpu_processes()`",
            ms("list_gpu_processes"),
            "anchor",
            "",
            "",
        ),
        (
            f"`%gpumem --top 10` ({med['gpumem_top']['objects_walked']} objects walked)",
            ms("gpumem_top"),
            "",
            "",
            "",
        ),
        (
            "`%%gpumem` added to a one-line cell",
            ms("cell_gpumem_added"),
            f"cell alone {ms('cell')}; `%%capture` adds "
            f"{med['cell_capture']['median'] - med['cell']['median']:.3f}",
            "≤ 1 ms",
            "yes" if added_ms <= 1.0 else "no",
        ),
    ]
    for label, text in (("ops", "`y = x * 2` x10,000"), ("empty", "`torch.empty(256)` x10,000")):
        ratio = trace_ratios[label]
        rows.append(
            (
                f"`%%gpumem --trace` on {text}",
                ms(f"loop_{label}_trace"),
                f"{ratio:.3f}x the cell alone ({ms(f'loop_{label}')}); plain `%%gpumem` "
                f"{med[f'loop_{label}_gpumem']['median'] / med[f'loop_{label}']['median']:.3f}x",
                "≤ +25 %",
                "yes" if ratio <= 1.25 else "no",
            )
        )
    rows.append(
        (
            "recording per `torch.empty(256)` (µs): off / `--trace` / torch default",
            f"{per_alloc['off']:.2f} / {per_alloc['state_python']:.2f} / "
            f"{per_alloc['all_python']:.2f}",
            "",
            "",
            "",
        )
    )
    print(
        f"\n{common['device']} x{devices}, torch {common['torch']} (CUDA {common['cuda']}), "
        f"driver {common['driver']}, Python {common['python']}, {common['date']}; "
        "ms: median (IQR)\n"
    )
    print("| measurement | time | anchor / ratio | target | met |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
