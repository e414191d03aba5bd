"""Whether ``%lprun --gpu``'s per-boundary autograd sequence-number read is what its cost
on bench_lprun.py's launch-bound loop is: ``torch._C._autograd._get_sequence_nr()`` timed
alone (ns a call: plain, under the running kernel recorder, with backward watched), then
the loop unprofiled, under ``--gpu --no-sync`` with the read and with it replaced by a
constant (in alternating order, trial by trial: which of two profiler sessions in a row
runs first moved ``lprun_parts.py``'s figures), the default (a synchronize at every
boundary) and ``--gpu`` with a synchronize, with and without the read. ms per call,
medians of 5 trials, each trial's figures listed. Needs a GPU.

    python benchmarks/lprun_seq_read.py
"""

import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from bench_lprun import fresh, launchy, ms_per_call
from gpumagic import lineprof_kernels
from gpumagic.cuda import kernel_trace
from gpumagic.lineprof import GpuLineProfiler

f = torch._C._autograd._get_sequence_nr


def t(fn, n=100000):
    s = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - s) / n * 1e9


print("seq plain ns", round(t(f)))
print("perf_counter_ns plain ns", round(t(time.perf_counter_ns)))
rec = kernel_trace.start_kernel_trace()
rec.collect_ops(False)
print("seq under KernelRecorder (ops off) ns", round(t(f)))
print("perf_counter_ns under KernelRecorder ns", round(t(time.perf_counter_ns)))
rec.watch_backward(lambda: None)
print("seq under KernelRecorder + watch ns", round(t(f)))
rec.stop()
print("seq after stop ns", round(t(f)))
small = torch.ones(1024, device="cuda")


def run(seq_off, sync=False, gpu=True, calls=200):
    fn = fresh(launchy)
    orig = lineprof_kernels.cuda.sequence_counter
    if seq_off:
        lineprof_kernels.cuda.sequence_counter = lambda: lambda: 0
    try:
        p = GpuLineProfiler(sync=sync, gpu=gpu)
        p.add_target(fn)
        return ms_per_call(fn, (small,), calls, p.session())
    finally:
        lineprof_kernels.cuda.sequence_counter = orig


def base(calls=200):
    return ms_per_call(fresh(launchy), (small,), calls, None)


res = {}
for trial in range(5):
    order = [("off", True), ("on", False)] if trial % 2 == 0 else [("on", False), ("off", True)]
    res.setdefault("base", []).append(base())
    for name, off in order:
        res.setdefault(f"gpu nosync seq {name}", []).append(run(off))
    res.setdefault("default sync", []).append(run(False, sync=True, gpu=False))
    res.setdefault("gpu sync seq on", []).append(run(False, sync=True, gpu=True))
    res.setdefault("gpu sync seq off", []).append(run(True, sync=True, gpu=True))
b = statistics.median(res["base"])
for k, v in res.items():
    m = statistics.median(v)
    print(f"{k:25s} {m:.3f} ms {m / b:.2f}x  {[round(x, 3) for x in v]}")
