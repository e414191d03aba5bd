"""Where ``%lprun --gpu``'s cost goes on bench_lprun.py's launch-bound loop: the
profiler alone (CUDA only; CPU ops on, then switched off as --gpu does), the line hook
alone, both, and --gpu with its per-boundary autograd sequence-number read replaced by
a constant; each without a synchronize at line boundaries (--no-sync) and with one (the
default). ms per call, median of 7 trials, the order rotated each trial. Needs a GPU.

    python benchmarks/lprun_parts.py
"""

import statistics
import sys

import torch
from torch.autograd.profiler import profile
from torch.profiler import ProfilerActivity

sys.path.insert(0, "benchmarks")
from bench_lprun import fresh, launchy, ms_per_call
from gpumagic import lineprof_kernels
from gpumagic.lineprof import GpuLineProfiler

small = torch.ones(1024, device="cuda")
CALLS = 200


def prof_ctx(cpu, toggle_off=False):
    p = profile(
        use_cpu=cpu,
        use_device="cuda",
        use_kineto=True,
        record_shapes=False,
        with_stack=False,
        profile_memory=False,
    )

    class C:
        def __enter__(self):
            p.__enter__()
            if toggle_off:
                torch._C._autograd._toggle_collection_dynamic(False, {ProfilerActivity.CPU})

        def __exit__(self, *a):
            p.__exit__(None, None, None)

    return C()


class Both:
    def __init__(self, *cs):
        self.cs = cs

    def __enter__(self):
        for c in self.cs:
            c.__enter__()

    def __exit__(self, *a):
        for c in reversed(self.cs):
            c.__exit__(None, None, None)


def run(kind):
    f = fresh(launchy)
    ctx = None
    if kind == "unprofiled":
        ctx = None
    elif kind == "cuda-only profiler":
        ctx = prof_ctx(False)
    elif kind == "cpu+cuda profiler, cpu toggled off":
        ctx = prof_ctx(True, True)
    elif kind == "cpu+cuda profiler":
        ctx = prof_ctx(True)
    else:
        gpu = "--gpu" in kind
        p = GpuLineProfiler(sync="--no-sync" not in kind, gpu=gpu)
        p.add_target(f)
        ctx = p.session()
        if "+ cuda-only profiler" in kind:
            ctx = Both(prof_ctx(False), ctx)
    return ms_per_call(f, (small,), CALLS, ctx)


kinds = [
    "unprofiled",
    "cuda-only profiler",
    "cpu+cuda profiler, cpu toggled off",
    "cpu+cuda profiler",
    "hook --no-sync",
    "hook --no-sync + cuda-only profiler",
    "--gpu --no-sync",
    "--gpu --no-sync, seq read off",
    "hook",
    "hook + cuda-only profiler",
    "--gpu",
    "--gpu, seq read off",
]
res = {k: [] for k in kinds}
orig = lineprof_kernels.cuda.sequence_counter
for trial in range(7):
    for k in kinds[trial % len(kinds) :] + kinds[: trial % len(kinds)]:
        if k.endswith("seq read off"):
            lineprof_kernels.cuda.sequence_counter = lambda: lambda: 0
            try:
                res[k].append(run(k.removesuffix(", seq read off")))
            finally:
                lineprof_kernels.cuda.sequence_counter = orig
        else:
            res[k].append(run(k))
base = statistics.median(res["unprofiled"])
print(torch.cuda.get_device_name(0))
for k in kinds:
    m = statistics.median(res[k])
    print(f"{k:45s} {m:.3f} ms  {m / base:.2f}x  min {min(res[k]):.3f}")
