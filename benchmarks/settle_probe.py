"""A pytest plugin for ``bench_leaks.py --suite --probe``: the time each settle step of
pytest_cuda's leak check takes, summed over the run, printed at the end.

Load it with ``-p settle_probe`` (this folder on ``sys.path``); it wraps the steps of
:class:`pytest_cuda.leaks.settle.CudaMemory` and the reading, and changes nothing else.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace
from typing import Any

from pytest_cuda.leaks import settle as leaks

SPENT: dict[str, list[float]] = defaultdict(list)


def _timed(name: str, run: Any) -> Any:
    def step(devices: tuple[int, ...]) -> bool:
        started = time.perf_counter()
        try:
            return bool(run(devices))
        finally:
            SPENT[name].append(time.perf_counter() - started)

    return step


_steps = leaks.CudaMemory.settle_steps
_read = leaks.CudaMemory.read


def _settle_steps(self: leaks.CudaMemory) -> Any:
    return tuple(replace(s, run=_timed(s.name, s.run)) for s in _steps(self))


def _reading(self: leaks.CudaMemory) -> dict[int, int]:
    started = time.perf_counter()
    try:
        return _read(self)
    finally:
        SPENT["allocator reads"].append(time.perf_counter() - started)


leaks.CudaMemory.settle_steps = _settle_steps  # type: ignore[method-assign]
leaks.CudaMemory.read = _reading  # type: ignore[method-assign]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line("SETTLE PROBE: step | runs | total s | median ms")
    for name, times in sorted(SPENT.items(), key=lambda kv: -sum(kv[1])):
        times.sort()
        terminalreporter.write_line(
            f"SETTLE PROBE: {name} | {len(times)} | {sum(times):.2f} | "
            f"{times[len(times) // 2] * 1e3:.2f}"
        )


__all__ = ["pytest_terminal_summary"]
