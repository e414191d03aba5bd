"""Where a clean test's memory-limit work goes: each seam call timed alone, in µs per call
(median of 25 blocks of 200 calls). Needs a GPU; prints one line per call.

    python benchmarks/memory_limit_parts.py

Nothing records the allocator's events here, so ``LimitWatch begin+over`` reads the
allocator at both ends (under pytest the limit records them and reads once, at the end).
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

import torch

from gpumagic import cuda
from pytest_cuda.leaks.limit_watch import LimitWatch
from pytest_cuda.leaks.peaks import peaks_since, reset_peaks

if TYPE_CHECKING:
    from collections.abc import Callable


def per_call_us(call: Callable[[], object], calls: int = 200, blocks: int = 25) -> float:
    """The median over ``blocks`` of the mean time of ``calls`` calls, in µs."""
    call()
    found = []
    for _ in range(blocks):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            call()
        found.append((time.perf_counter_ns() - t0) / calls / 1000)
    return statistics.median(found)


def main() -> None:
    torch.empty(1, device="cuda")  # the context first
    start = reset_peaks()
    watch = LimitWatch(1 << 40, "--cuda-limit-memory")

    def watched() -> None:
        watch.begin()
        watch.over()

    c: Any = torch._C  # the private bindings the seam calls
    parts: dict[str, Callable[[], object]] = {
        "cuda.is_initialized": cuda.is_initialized,
        "torch.cuda.device_count": torch.cuda.device_count,
        "_cuda_hasPrimaryContext(0)": lambda: c._cuda_hasPrimaryContext(0),
        "cuda.devices_with_context": cuda.devices_with_context,
        "_cuda_resetPeakMemoryStats(0)": lambda: c._cuda_resetPeakMemoryStats(0),
        "_cuda_memoryStats(0)": lambda: c._cuda_memoryStats(0),
        "cuda.allocation_marks(0)": lambda: cuda.allocation_marks(0),
        "time.time_ns": time.time_ns,
        "reset_peaks()": reset_peaks,
        "peaks_since(start)": lambda: peaks_since(start),
        "LimitWatch begin+over": watched,
        "torch.cuda.memory_allocated(0)": lambda: torch.cuda.memory_allocated(0),
    }
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    for name, call in parts.items():
        print(f"{name:40s} {per_call_us(call):8.2f} us")


if __name__ == "__main__":
    main()
