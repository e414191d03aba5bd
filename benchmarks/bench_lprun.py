"""%lprun on the GPU: does each line get its GPU work, and what does that cost?

* Attribution. ``step(x, w)``: line A ``y = x @ w`` (8192² fp32 matmul, TF32 off,
  ~20 ms of GPU work), line B ``v = y.sum().item()``. The share of line A's kernel time
  (CUPTI, through torch.profiler, measured in the same run) that each profiler charges
  to line A: gpumagic (synchronized, the default) and line_profiler alone.
  Target: >= 98 % for gpumagic (line_profiler alone: ~0.2 %).
* GPU column. ``--gpu``'s GPU Time of line A (CUPTI's kernels matched to their line
  after the run, issue 41) against the same CUPTI kernel time measured apart,
  synchronized and with ``--no-sync``. Target: within 2 %.
* Overhead per line hit. A pure-Python loop (3 line hits per iteration) with CUDA in
  use and the GPU idle: wall time per hit unprofiled, under line_profiler, under
  gpumagic; against one idle synchronize measured in the same run (torch's
  ``torch.cuda.synchronize()`` and the raw call the hook makes).
  Target: gpumagic - unprofiled <= one synchronize + 1.5 µs.
* Launch-bound loop. 50 x (``x = x * 1.0001``; ``x = x + 1``) on 64 K elements, then
  ``.item()``: wall ms per call unprofiled and under each profiler setting. Per-line
  synchronization removes the CPU/GPU overlap, so this is where profiling slows code.
  Targets (issue 41): ``--gpu --no-sync`` <= 1.5x unprofiled; ``--gpu`` <= 1.1x the
  default. Also torch.profiler alone around the loop, with the CPU ops recorded and
  with CUDA activity only (as ``--gpu`` records a forward: torch ops only inside
  ``backward()``): what the record costs without the line hook.
* Training step. A small MLP (3 Linear layers of 2048, batch 2048): ``zero_grad``,
  forward, ``backward()``, ``step()``; ms per step under each setting, and for
  ``--gpu`` the share of the backward kernels' time charged to the forward lines
  (target >= 90 %) and the total GPU time against CUPTI's for the same step
  (target: within 2 %).

Runs are interleaved over trials; medians, with min-max over trials.

    python benchmarks/bench_lprun.py [--trials 5] [--json results.jsonl]

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
from importlib.metadata import version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

CALLS = 5  # calls of step() per profiled run
BUSY_N = 20_000  # iterations of the pure-Python loop (60,000 line hits)
LAUNCH_CALLS = 100  # calls per timed run (20 gave runs of 25-60 ms: too noisy for a 10 % target)
#: torch.profiler alone around the launch-bound loop (no line hook): with CPU ops or not
PROFILER_ALONE = {"torch.profiler CPU+CUDA": True, "torch.profiler CUDA only": False}
#: gpumagic's settings on the launch-bound loop and the training step
GPUMAGIC_OPTIONS: dict[str, dict[str, bool]] = {
    "gpumagic": {},
    "gpumagic --no-sync": {"sync": False},
    "gpumagic --gpu": {"gpu": True},
    "gpumagic --gpu --no-sync": {"gpu": True, "sync": False},
}
TRAIN_STEPS = 10


def step(x: Any, w: Any) -> float:
    y = x @ w
    v = y.sum().item()
    return float(v)


def busy(n: int) -> int:
    a = 0
    for i in range(n):
        a += i
        a ^= 3
    return a


def train_step(model: Any, opt: Any, data: Any, target: Any) -> None:
    import torch

    opt.zero_grad()
    h = model[0](data)
    h = model[1](h)
    h = model[2](h)
    h = model[3](h)
    out = model[4](h)
    loss = torch.nn.functional.cross_entropy(out, target)
    loss.backward()
    opt.step()


def launchy(x: Any) -> float:
    for _ in range(50):
        x = x * 1.0001
        x = x + 1
    return float(x.sum().item())


def fresh(func: Callable[..., Any]) -> Callable[..., Any]:
    """A new function object with the original code (profilers pad ``__code__``)."""
    import types

    return types.FunctionType(func.__code__, func.__globals__, func.__name__)


def profiling(kind: str, func: Callable[..., Any]) -> tuple[Any, Any]:
    """The context ``func`` runs under for ``kind`` (``None``: unprofiled), and the
    GpuLineProfiler behind it for gpumagic's kinds (else ``None``)."""
    if kind == "unprofiled":
        return None, None
    if kind in PROFILER_ALONE:
        # What a record costs by itself, no line hook: with torch's CPU ops, and with
        # CUPTI's launches only (what --gpu records outside backward()).
        from torch.autograd.profiler import profile as autograd_profile

        context = autograd_profile(
            use_cpu=PROFILER_ALONE[kind],
            use_device="cuda",
            use_kineto=True,
            record_shapes=False,
            with_stack=False,
            profile_memory=False,
        )
        return context, None
    if kind == "line_profiler":
        from line_profiler import LineProfiler

        return LineProfiler(func), None
    from gpumagic.lineprof import GpuLineProfiler

    prof = GpuLineProfiler(**GPUMAGIC_OPTIONS[kind])
    prof.add_target(func)
    return prof.session(), prof


def ms_per_call(func: Callable[..., Any], args: tuple[Any, ...], calls: int, context: Any) -> float:
    """Wall ms per call of ``func(*args)`` over ``calls`` calls inside ``context`` (or
    none), the GPU's work waited for. One call comes before, outside the context, and
    one inside it before the clock starts: --gpu starts torch.profiler at the first
    profiled line (CUPTI's start-up is its cost, said in the notes, not per call)."""
    import torch

    func(*args)
    torch.cuda.synchronize()
    if context is not None:
        context.__enter__()
    try:
        func(*args)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            func(*args)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    finally:
        if context is not None:
            context.__exit__(None, None, None)
    return wall * 1e3 / calls


def line_seconds(stats: Any, func: Callable[..., Any], offset: int) -> tuple[float, int]:
    """(seconds, hits) line_profiler stats hold for ``func``'s line ``def + offset``."""
    first = func.__code__.co_firstlineno
    for (_, start, _), timings in stats.timings.items():
        if start == first:
            for line, hits, t in timings:
                if line == first + offset:
                    return t * stats.unit, hits
    return 0.0, 0


def total_hits(stats: Any) -> int:
    return sum(hits for timings in stats.timings.values() for _, hits, _ in timings)


def median_us(fn: Callable[[], object], n: int = 2000) -> float:
    for _ in range(50):
        fn()
    samples = []
    for _ in range(n):
        t = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t)
    return statistics.median(samples) / 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="append one JSON object per measurement to this file")
    parser.add_argument("--trials", type=int, default=5, help="interleaved trials (default 5)")
    args = parser.parse_args()

    import torch
    from line_profiler import LineProfiler
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from gpumagic import cuda
    from gpumagic.lineprof import GpuLineProfiler

    if not cuda.status().available:
        print(f"bench_lprun: no GPU ({cuda.status().reason})")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    records: list[dict[str, Any]] = []

    def emit(record: dict[str, Any]) -> None:
        record = {"bench": "lprun", **record}
        records.append(record)
        print(json.dumps(record), flush=True)

    emit(
        {
            "kind": "environment",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(0),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "line_profiler": version("line_profiler"),
            "gpumagic": version("gpumagic"),
            "driver": cuda.status().driver_version,
            "trials": args.trials,
        }
    )

    x = torch.randn(8192, 8192, device="cuda")
    w = torch.randn(8192, 8192, device="cuda")
    small = torch.randn(1 << 16, device="cuda")
    for _ in range(3):
        step(x, w)
        launchy(small)
    torch.cuda.synchronize()

    def cupti_matmul_ms() -> float:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(CALLS):
                x @ w
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        return sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / CALLS

    cupti_matmul_ms()  # the profiler's first use is slow

    def attribution(kind: str) -> dict[str, float]:
        func = fresh(step)
        if kind == "line_profiler":
            prof: Any = LineProfiler(func)
            with prof:
                for _ in range(CALLS):
                    func(x, w)
            stats = prof.get_stats()
            gpu_ms = float("nan")
        else:
            prof = GpuLineProfiler(sync=kind != "gpumagic --gpu --no-sync", gpu="--gpu" in kind)
            prof.add_target(func)
            with prof.session():
                for _ in range(CALLS):
                    func(x, w)
            stats = prof.get_stats()
            kernels = prof.result().kernels
            line_a = func.__code__.co_firstlineno + 1
            gpu_ms = float("nan")
            if kernels is not None:
                on_a = [lines[line_a] for lines in kernels.lines.values() if line_a in lines]
                gpu_ms = sum(f.total_ns for f in on_a) / 1e6 / CALLS
        a, _ = line_seconds(stats, func, 1)
        b, _ = line_seconds(stats, func, 2)
        return {"line_a_ms": a * 1e3 / CALLS, "line_b_ms": b * 1e3 / CALLS, "gpu_a_ms": gpu_ms}

    def overhead(kind: str) -> dict[str, float]:
        func = fresh(busy)
        if kind == "unprofiled":
            t = time.perf_counter()
            func(BUSY_N)
            return {"wall_s": time.perf_counter() - t, "hits": 3 * BUSY_N + 2}
        prof: Any = LineProfiler(func) if kind == "line_profiler" else GpuLineProfiler()
        if kind != "line_profiler":
            prof.add_target(func)
        context = prof if kind == "line_profiler" else prof.session()
        with context:
            t = time.perf_counter()
            func(BUSY_N)
            wall = time.perf_counter() - t
        stats = prof.get_stats()
        return {"wall_s": wall, "hits": total_hits(stats)}

    def launch_bound(kind: str) -> float:
        func = fresh(launchy)
        context, _ = profiling(kind, func)
        return ms_per_call(func, (small,), LAUNCH_CALLS, context)

    model = torch.nn.Sequential(
        torch.nn.Linear(2048, 2048),
        torch.nn.ReLU(),
        torch.nn.Linear(2048, 2048),
        torch.nn.ReLU(),
        torch.nn.Linear(2048, 10),
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(2048, 2048, device="cuda")
    target = torch.randint(0, 10, (2048,), device="cuda")
    for _ in range(3):
        train_step(model, opt, data, target)
    torch.cuda.synchronize()

    def cupti_step_ms() -> float:
        found = cuda.profile_kernels(
            lambda: train_step(model, opt, data, target),
            lambda: train_step(model, opt, data, target),
            (0,),
        )
        return found.busy_us / 1e3

    def training(kind: str) -> dict[str, float]:
        func = fresh(train_step)
        context, prof = profiling(kind, func)
        args = (model, opt, data, target)
        found: dict[str, float] = {"ms_per_step": ms_per_call(func, args, TRAIN_STEPS, context)}
        kernels = prof.result().kernels if prof is not None and prof.gpu else None
        if kernels is not None:
            # The session ran TRAIN_STEPS + 1 steps (the untimed first one included).
            found["gpu_ms_per_step"] = kernels.total_ns / 1e6 / (TRAIN_STEPS + 1)
            found["charged_share"] = kernels.charged_ns / max(1, kernels.total_ns)
            found["backward_to_forward_share"] = kernels.backward_to_forward_ns / max(
                1, kernels.backward_ns
            )
        return found

    attribution_kinds = ["line_profiler", "gpumagic", "gpumagic --gpu", "gpumagic --gpu --no-sync"]
    overhead_kinds = ["unprofiled", "line_profiler", "gpumagic"]
    launch_kinds = [
        "unprofiled",
        "line_profiler",
        "gpumagic",
        "gpumagic --no-sync",
        "gpumagic --gpu",
        "gpumagic --gpu --no-sync",
    ]
    # The launch-bound loop alone: where --gpu's cost goes.
    launch_only_kinds = [*launch_kinds, *PROFILER_ALONE]
    cupti: list[float] = []
    attr: dict[str, list[dict[str, float]]] = {k: [] for k in attribution_kinds}
    over: dict[str, list[dict[str, float]]] = {k: [] for k in overhead_kinds}
    launch: dict[str, list[float]] = {k: [] for k in launch_only_kinds}
    train: dict[str, list[dict[str, float]]] = {k: [] for k in launch_kinds}
    cupti_step: list[float] = []
    syncs: dict[str, list[float]] = {"torch.cuda.synchronize()": [], "seam synchronize": []}
    for trial in range(args.trials):
        kernel = cupti_matmul_ms()
        cupti.append(kernel)
        emit({"kind": "cupti", "trial": trial, "matmul_kernel_ms": kernel})
        for kind in attribution_kinds:
            found = attribution(kind)
            attr[kind].append(found)
            emit({"kind": "attribution", "trial": trial, "profiler": kind, **found})
        for kind in overhead_kinds:
            found = overhead(kind)
            over[kind].append(found)
            emit({"kind": "overhead", "trial": trial, "profiler": kind, **found})
        torch.cuda.synchronize()
        syncs["torch.cuda.synchronize()"].append(median_us(torch.cuda.synchronize))
        syncs["seam synchronize"].append(median_us(lambda: cuda.synchronize((0,))))
        emit({"kind": "idle_sync_us", "trial": trial, **{k: v[-1] for k, v in syncs.items()}})
        for kind in launch_only_kinds:
            ms = launch_bound(kind)
            launch[kind].append(ms)
            emit({"kind": "launch_bound", "trial": trial, "profiler": kind, "ms_per_call": ms})
        cupti_step.append(cupti_step_ms())
        emit({"kind": "cupti_train_step", "trial": trial, "kernel_ms": cupti_step[-1]})
        for kind in launch_kinds:
            found = training(kind)
            train[kind].append(found)
            emit({"kind": "train_step", "trial": trial, "profiler": kind, **found})

    kernel_ms = statistics.median(cupti)

    def med(values: list[float]) -> float:
        return statistics.median(values)

    def spread(values: list[float]) -> str:
        return f"{min(values):.3g} to {max(values):.3g}"

    lines = [
        "",
        f"Device: {records[0]['device']}; torch {torch.__version__}; "
        f"Python {platform.python_version()}; line_profiler {version('line_profiler')}; "
        f"{args.trials} trials; line A's kernel (CUPTI) {kernel_ms:.3f} ms",
        "",
        "| measurement | profiler | median | min to max | target |",
        "|---|---|---|---|---|",
    ]
    summary: dict[str, Any] = {"kind": "summary", "cupti_matmul_ms": kernel_ms}
    for kind in attribution_kinds:
        shares = [100 * r["line_a_ms"] / k for r, k in zip(attr[kind], cupti, strict=True)]
        target = ">= 98 %" if kind == "gpumagic" else ""
        lines.append(
            f"| host time on line A / CUPTI kernel time | {kind} | {med(shares):.1f} % "
            f"| {spread(shares)} % | {target} |"
        )
        summary[f"share_a_{kind}"] = med(shares)
        if kind.startswith("gpumagic --gpu"):
            ratio = [100 * r["gpu_a_ms"] / k for r, k in zip(attr[kind], cupti, strict=True)]
            lines.append(
                f"| GPU Time of line A / CUPTI kernel time | {kind} | {med(ratio):.2f} % "
                f"| {spread(ratio)} % | 98 to 102 % |"
            )
            summary[f"gpu_column_ratio_{kind}"] = med(ratio)
    per_hit = {kind: [r["wall_s"] / r["hits"] * 1e6 for r in over[kind]] for kind in overhead_kinds}
    base = per_hit["unprofiled"]
    sync_us = med(syncs["torch.cuda.synchronize()"])
    raw_sync_us = med(syncs["seam synchronize"])
    for kind in ("line_profiler", "gpumagic"):
        extra = [p - b for p, b in zip(per_hit[kind], base, strict=True)]
        target = f"<= {sync_us + 1.5:.2f} µs (one sync + 1.5)" if kind == "gpumagic" else ""
        lines.append(
            f"| overhead per line hit (idle GPU) | {kind} | {med(extra):.2f} µs "
            f"| {spread(extra)} µs | {target} |"
        )
        summary[f"overhead_us_{kind}"] = med(extra)
    lines.append(
        f"| idle synchronize | torch.cuda.synchronize() | {sync_us:.2f} µs "
        f"| {spread(syncs['torch.cuda.synchronize()'])} µs | |"
    )
    lines.append(
        f"| idle synchronize | the hook's raw call | {raw_sync_us:.2f} µs "
        f"| {spread(syncs['seam synchronize'])} µs | |"
    )
    summary["idle_sync_us"] = sync_us
    summary["idle_sync_raw_us"] = raw_sync_us
    summary["overhead_beyond_sync_us"] = summary["overhead_us_gpumagic"] - sync_us
    unprofiled = med(launch["unprofiled"])
    for kind in launch_only_kinds:
        ms = med(launch[kind])
        lines.append(
            f"| launch-bound loop, ms per call (x unprofiled) | {kind} | {ms:.3f} ms "
            f"({ms / unprofiled:.2f}x) | {spread(launch[kind])} ms | |"
        )
        summary[f"launch_ms_{kind}"] = ms
    step_unprofiled = med([r["ms_per_step"] for r in train["unprofiled"]])
    step_cupti = med(cupti_step)
    summary["cupti_train_step_ms"] = step_cupti
    for kind in launch_kinds:
        ms = med([r["ms_per_step"] for r in train[kind]])
        lines.append(
            f"| training step, ms per step (x unprofiled) | {kind} | {ms:.3f} ms "
            f"({ms / step_unprofiled:.2f}x) | {spread([r['ms_per_step'] for r in train[kind]])} "
            "ms | |"
        )
        summary[f"train_ms_{kind}"] = ms
        if "--gpu" in kind:
            back = [100 * r["backward_to_forward_share"] for r in train[kind]]
            ratio = [100 * r["gpu_ms_per_step"] / step_cupti for r in train[kind]]
            lines.append(
                f"| backward kernel time on forward lines | {kind} | {med(back):.1f} % "
                f"| {spread(back)} % | >= 90 % |"
            )
            lines.append(
                f"| GPU time per step / CUPTI | {kind} | {med(ratio):.2f} % "
                f"| {spread(ratio)} % | 98 to 102 % |"
            )
            summary[f"train_backward_share_{kind}"] = med(back)
            summary[f"train_gpu_ratio_{kind}"] = med(ratio)
    emit(summary)
    if args.json:
        with open(args.json, "a", encoding="utf-8") as out:
            for record in records:
                out.write(json.dumps(record) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
