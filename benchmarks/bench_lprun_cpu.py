"""What ``%lprun --gpu --no-sync`` costs on the host, measured on a machine with no GPU.

A CPU proxy of ``bench_lprun.py``'s launch-bound loop: 50 x (``x = x * 1.0001``;
``x = x + 1``) on a 4-element CPU tensor, then ``.item()``; each torch op is a few µs of
host work, as a kernel launch is. Wall µs per call, unprofiled and under:

* ``line_profiler`` alone (``%lprun --no-sync`` without ``--gpu`` installs no hook:
  the same tracer);
* ``torch.profiler CPU ops``: torch's profiler alone around the loop, recording the CPU
  ops (no CUDA activity here: CUPTI's part is the GPU run's); ``--gpu`` records them
  only inside ``backward()``, and this loop has none;
* ``--gpu --no-sync (no profiler)``: gpumagic's boundary hook and line timeline with a
  recorder that records nothing (the hook's own cost);
* ``--gpu --no-sync``: the hook and torch's profiler, its CPU ops switched off as
  ``--gpu`` does outside ``backward()``, as on a GPU.

The CUDA seam is pointed at the CPU (a pretend CUDA context, no synchronize, torch's
profiler with the CPU activity only): the numbers are the host-side part of
``--gpu``'s cost; the GPU run adds CUPTI's. Runs are interleaved over trials; medians.

    python benchmarks/bench_lprun_cpu.py [--trials 7] [--calls 200]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import types
from typing import Any

KINDS = (
    "unprofiled",
    "line_profiler",
    "torch.profiler CPU ops",
    "--gpu --no-sync (no profiler)",
    "--gpu --no-sync",
)


def launchy(x: Any) -> float:
    for _ in range(50):
        x = x * 1.0001
        x = x + 1
    return float(x.sum().item())


class NoRecord:
    """A recorder that records nothing: the marks only (the hook's cost alone)."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, int]] = []
        self.collecting = True

    def collect_ops(self, on: bool) -> None:
        self.collecting = on

    def watch_backward(self, on_backward: Any) -> None:
        pass

    def unwatch_backward(self) -> None:
        pass

    def mark(self, label: str) -> tuple[int, int]:
        before = time.perf_counter_ns()
        self.marks.append((label, before))
        return before, time.perf_counter_ns()

    def stop(self) -> Any:
        from gpumagic.cuda.kernel_trace import HostOp, KernelTrace

        ops = (HostOp(i, label, 1, ns, ns + 1) for i, (label, ns) in enumerate(self.marks))
        return KernelTrace(ops=tuple(ops))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()

    import torch
    from line_profiler import LineProfiler
    from torch.autograd.profiler import profile

    from gpumagic import cuda
    from gpumagic.cuda.kernel_trace import KernelRecorder
    from gpumagic.lineprof import GpuLineProfiler

    debug_mode = [0]
    recorder: list[Any] = [None]
    seam = {
        "devices_with_context": lambda: (0,),
        "visible_device_total": lambda: 1,
        "synchronize": lambda devices=None: None,
        "stream_is_capturing": lambda: False,
        "get_sync_debug_mode": lambda: debug_mode[0],
        "set_sync_debug_mode": lambda mode: debug_mode.__setitem__(0, mode),
        "profiler_running": lambda: False,
        "start_kernel_trace": lambda cuda=True: recorder[0](),
        "spin": lambda device, microseconds: None,  # the warm-up launch: no GPU here
    }
    for name, value in seam.items():
        setattr(cuda, name, value)

    def cpu_recorder() -> KernelRecorder:
        return KernelRecorder(cuda=False)

    small = torch.ones(4)

    def run(kind: str) -> float:
        func = types.FunctionType(launchy.__code__, launchy.__globals__, "launchy")
        context: Any = None
        prof: GpuLineProfiler | None = None
        if kind == "line_profiler":
            context = LineProfiler(func)
        elif kind == "torch.profiler CPU ops":
            context = profile(
                use_cpu=True,
                use_kineto=True,
                record_shapes=False,
                with_stack=False,
                profile_memory=False,
            )
        elif kind != "unprofiled":
            recorder[0] = NoRecord if "no profiler" in kind else cpu_recorder
            prof = GpuLineProfiler(gpu=True, sync=False)
            prof.add_target(func)
            context = prof.session()
        func(small)
        if context is not None:
            context.__enter__()
        try:
            func(small)  # as in bench_lprun: the profiler starts at the first line
            t = time.perf_counter()
            for _ in range(args.calls):
                func(small)
            wall = time.perf_counter() - t
        finally:
            if context is not None:
                context.__exit__(None, None, None)
        if prof is not None:
            result = prof.result()
            if result.kernels is None:
                raise SystemExit(f"{kind}: no record ({result.kernels_failure})")
        return float(wall * 1e6 / args.calls)

    found: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for _ in range(args.trials):
        for kind in KINDS:
            found[kind].append(run(kind))
    base = statistics.median(found["unprofiled"])
    print(f"python {platform.python_version()}, torch {torch.__version__}, {args.calls} calls")
    print("| setting | µs per call | x unprofiled | min-max |")
    print("|---|---:|---:|---|")
    for kind in KINDS:
        values = found[kind]
        median = statistics.median(values)
        print(
            f"| {kind} | {median:.0f} | {median / base:.2f}x "
            f"| {min(values):.0f}-{max(values):.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
