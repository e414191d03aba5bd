"""Where the default ``%lprun``'s cost per line hit goes on an idle GPU: bench_lprun.py's
pure-Python loop (3 line hits per iteration), µs per hit, unprofiled, under line_profiler
and under gpumagic's default (a synchronize at every boundary) with parts of its boundary
swapped out: the seam's synchronize for torch's raw call, the CUDA-graph capture check
for a constant, both, and the synchronize as well (the hook's Python alone). First the
calls themselves, ns each. Median of 7 trials, the order rotated each trial. Needs a GPU.

    python benchmarks/lprun_sync_parts.py
"""

import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from line_profiler import LineProfiler

from bench_lprun import BUSY_N, busy, fresh, total_hits
from gpumagic import cuda
from gpumagic.cuda import runtime
from gpumagic.lineprof import GpuLineProfiler

torch.ones(1, device="cuda")
torch.cuda.synchronize()
native = torch._C


def t(fn, n=20000):
    for _ in range(200):
        fn()
    s = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - s) / n


print(
    "ns per call: native sync",
    round(t(native._cuda_synchronize)),
    "runtime.synchronize((0,))",
    round(t(lambda: runtime.synchronize((0,)))),
    "stream_is_capturing",
    round(t(runtime.stream_is_capturing)),
    "getDevice",
    round(t(native._cuda_getDevice)),
    "lambda",
    round(t(lambda: None)),
)
orig = {n: getattr(cuda, n) for n in ("synchronize", "stream_is_capturing")}
variants = {
    "gpumagic": {},
    "native sync": {"synchronize": lambda devices=None: native._cuda_synchronize()},
    "no capture check": {"stream_is_capturing": lambda: False},
    "both": {
        "synchronize": lambda devices=None: native._cuda_synchronize(),
        "stream_is_capturing": lambda: False,
    },
    "no sync call, no check": {
        "synchronize": lambda devices=None: None,
        "stream_is_capturing": lambda: False,
    },
}


def run(kind):
    f = fresh(busy)
    if kind == "unprofiled":
        s = time.perf_counter()
        f(BUSY_N)
        return (time.perf_counter() - s, 3 * BUSY_N + 2)
    if kind == "line_profiler":
        p = LineProfiler(f)
        with p:
            s = time.perf_counter()
            f(BUSY_N)
            w = time.perf_counter() - s
        return w, total_hits(p.get_stats())
    for n, v in variants[kind].items():
        setattr(cuda, n, v)
    try:
        p = GpuLineProfiler()
        p.add_target(f)
        with p.session():
            s = time.perf_counter()
            f(BUSY_N)
            w = time.perf_counter() - s
    finally:
        for n, v in orig.items():
            setattr(cuda, n, v)
    return w, total_hits(p.get_stats())


kinds = ["unprofiled", "line_profiler", *variants]
res = {k: [] for k in kinds}
for trial in range(7):
    for k in kinds[trial % len(kinds) :] + kinds[: trial % len(kinds)]:
        w, h = run(k)
        res[k].append(w / h * 1e6)
b = statistics.median(res["unprofiled"])
for k in kinds:
    m = statistics.median(res[k])
    print(f"{k:25s} {m:.2f} us/hit  +{m - b:.2f}  min {min(res[k]):.2f}")
