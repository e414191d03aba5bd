"""A stand-in for the GPU seam as the ``%cudatime`` engine uses it, whose "events" read
the host clock (logic tests only; the real GPU runs are ``test_timing*_gpu.py``).

It replaces ``gpumagic.cuda`` only in the engine's modules (:meth:`FakeSeam.install`,
the ``seam`` fixture of ``conftest.py``). The SM clock it reports comes from
``clocks``: none means NVML is not there.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpumagic import cuda, timing, timing_passes, timing_runs
from gpumagic.devices import CudaStatus, DeviceInfo

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    import pytest


def sleeper(seconds: float) -> Callable[[], None]:
    def body() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    return body


@dataclass
class FakeEvent:
    t: float


@dataclass
class FakeBuffer:
    def numel(self) -> int:
        return 32 << 20

    def element_size(self) -> int:
        return 4


@dataclass
class FakeSeam:
    """The functions of ``gpumagic.cuda`` the engine uses, with host-clock events."""

    initialized: bool = True
    side_delay: float = 0.0
    pending: float = 0.0
    capture_error: str | None = None
    busy_us: float = 100.0
    syncs_per_call: int = 0
    code_files: tuple[str, ...] = ()
    log: list[str] = field(default_factory=list)

    GraphCaptureError = cuda.GraphCaptureError

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeSeam:
        """Stand in for ``gpumagic.cuda`` where the engine's modules use it."""
        for module in (timing, timing_runs, timing_passes):  # the entry point, runs, passes
            monkeypatch.setattr(module, "cuda", self)
        return self

    def status(self) -> CudaStatus:
        device = DeviceInfo(0, "Fake GPU", 80 << 30, (9, 0))
        return CudaStatus(True, "", devices=(device,), torch_version="2.x", cuda_version="13.0")

    def is_initialized(self) -> bool:
        return self.initialized

    def devices_with_context(self) -> tuple[int, ...]:
        return (0,)

    def current_device(self) -> int:
        return 0

    def use_device(self, index: int) -> contextlib.AbstractContextManager[None]:
        self.log.append(f"device {index}")
        return contextlib.nullcontext()

    def synchronize(self, devices: Iterable[int] | None = None) -> None:
        # Work left on another stream: the device sync waits for it, after the current
        # stream's end event has passed.
        if self.pending:
            self.wait(self.pending)
            self.pending = 0.0
        self.log.append("sync")

    def event_completed(self, event: FakeEvent) -> bool:
        return True

    def spin(self, device: int, microseconds: float) -> None:
        self.log.append("spin")

    def side_work(self, seconds: float) -> None:
        self.pending = seconds

    def record_event(self, device: int | None = None) -> FakeEvent:
        if self.fixed_span:  # a steady GPU: every interval is the same
            slow = self.slow_after and self.calls > self.slow_after
            self.ticks += self.fixed_span * (1.2 if slow else 1.0)
            return FakeEvent(self.ticks)
        self.log.append("record")
        return FakeEvent(self.clock())

    def elapsed_ms(self, start: FakeEvent, end: FakeEvent, *, wait: bool = True) -> float:
        return (end.t - start.t) * 1e3

    def current_streams(self, devices: Iterable[int]) -> list[str]:
        return ["stream"]

    def restore_streams(self, streams: Iterable[Any]) -> None:
        self.log.append("restore streams")

    def device_peaks(self, device: int) -> cuda.DevicePeaks:
        return cuda.DevicePeaks("Fake GPU", 3.35e12)

    def l2_flush_buffer(self, device: int) -> FakeBuffer:
        return FakeBuffer()

    def flush_l2(self, buffer: FakeBuffer) -> None:
        self.log.append("flush")
        self.flushed = True  # the next call finds its data out of L2 (see cold_body)

    def capture_graph(self, run: Callable[[int], object], unroll: int, device: int) -> Any:
        if self.capture_error:
            raise cuda.GraphCaptureError(self.capture_error)
        run(unroll)
        self.log.append(f"captured {unroll}")
        return lambda: run(unroll)

    def profile_kernels(
        self,
        warm: Callable[[], object],
        run: Callable[[], object],
        devices: Any,
        flushes: int = 0,
        steps: int = 1,
    ) -> cuda.KernelProfile:
        warm()
        self.log.append("profile")
        self.log_len_before = len(self.log)
        for _ in range(steps):
            run()
        removed = flushes
        busy = self.busy_us * steps
        runs = (self.busy_us,) * steps if steps > 1 and self.split_runs else ()
        return cuda.KernelProfile(busy, None, (("kernel", steps, busy),), removed, runs)

    def sm_clock(self, device: int) -> cuda.SmClock | None:
        """The next of ``clocks`` (``None``: no NVML here), the last one once they run out."""
        if not self.clocks:
            return None
        self.clock_reads += 1
        mhz, reasons = self.clocks[min(self.clock_reads, len(self.clocks)) - 1]
        return cuda.SmClock(mhz, reasons, self.default_mhz)

    def catch_syncs(
        self, run: Callable[[], object], code_files: Iterable[str], *, is_user: Any
    ) -> list[Any]:
        self.log.append("sync check")
        calls_before = self.calls
        run()
        files = list(code_files) or ["<f>"]
        n = (self.calls - calls_before) * self.syncs_per_call
        return [cuda.SyncEvent("Tensor.item", files[0], 3)] * n

    clock: Callable[[], float] = time.perf_counter  # what events and waits go by
    wait: Callable[[float], None] = time.sleep
    calls: int = 0
    fixed_span: float = 0.0
    slow_after: int = 0  # with fixed_span: 20 % slower once the body ran this often
    ticks: float = 0.0
    split_runs: bool = True  # CUPTI's record splits into the profiled runs
    clocks: list[tuple[int, int | None]] = field(default_factory=list)  # (MHz, reasons)
    clock_reads: int = 0
    default_mhz: int | None = 1980
    flushed: bool = False


def counting(seam: FakeSeam, seconds: float) -> Callable[[int], None]:
    body = sleeper(seconds)

    def run(n: int) -> None:
        for _ in range(n):
            seam.calls += 1
            body()

    return run


def cold_body(seam: FakeSeam, seconds: float, cold: float) -> Callable[[int], None]:
    """A body of ``seconds`` a call, ``cold`` right after an L2 flush."""

    def run(n: int) -> None:
        for _ in range(n):
            seam.calls += 1
            sleeper(cold if seam.flushed else seconds)()
            seam.flushed = False

    return run
