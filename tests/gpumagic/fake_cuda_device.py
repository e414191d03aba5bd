"""A pretend asynchronous GPU for the %lprun logic tests: the seam's runtime, faked.

``launch(seconds)`` queues work and returns at once, like a kernel launch; ``synchronize``
and ``item`` wait in real time until it is done. Events carry the real time the pretend
GPU reaches them and its own clock, which advances only by the work launched, so spans
between events are what the GPU worked however late a loaded host records them.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fake_cuda import install
from gpumagic import cuda

if TYPE_CHECKING:
    import pytest


@dataclass(frozen=True)
class FakeEvent:
    at: float  # perf_counter seconds at which the pretend GPU passes this event
    gpu: float  # the pretend GPU's clock there: seconds of work launched before it


class FakeDevice:
    def __init__(self) -> None:
        self.free_at = 0.0
        self.launched = 0.0  # seconds of work launched so far: the pretend GPU's clock
        self.capturing = False
        self.debug_mode = 0
        self.allocated = 0
        self.peak = 0
        self.total_allocated = 0
        self.total_freed = 0
        self.syncs = 0
        self.sync_error: Exception | None = None
        self.debug_modes_set: list[int] = []

    # -- what user code does ---------------------------------------------------------

    def launch(self, seconds: float) -> None:
        """Queue ``seconds`` of GPU work; returns at once."""
        now = time.perf_counter()
        self.free_at = max(self.free_at, now) + seconds
        self.launched += seconds

    def item(self) -> float:
        """A hidden synchronization, like ``tensor.item()``."""
        if self.debug_mode == 1:
            warnings.warn(cuda.SYNC_WARNING_MESSAGE, UserWarning, stacklevel=2)
        self._wait()
        return 0.0

    def alloc(self, size: int) -> None:
        self.allocated += size
        self.total_allocated += size
        self.peak = max(self.peak, self.allocated)

    def free(self, size: int) -> None:
        self.allocated -= size
        self.total_freed += size

    def _wait(self) -> None:
        remaining = self.free_at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    # -- the seam --------------------------------------------------------------------

    def synchronize(self, devices: tuple[int, ...]) -> None:
        if self.sync_error is not None:
            raise self.sync_error
        assert devices == (0,)
        self.syncs += 1
        self._wait()

    def record_event(self, device: int | None = None) -> FakeEvent:
        return FakeEvent(max(self.free_at, time.perf_counter()), self.launched)

    def event_completed(self, event: FakeEvent) -> bool:
        return time.perf_counter() >= event.at

    def elapsed_ms(self, start: FakeEvent, end: FakeEvent, *, wait: bool = True) -> float:
        return (end.gpu - start.gpu) * 1e3

    def allocation_marks(self, device: int) -> tuple[int, int, int, int]:
        return self.allocated, self.peak, self.total_allocated, self.total_freed

    def set_sync_debug_mode(self, mode: int) -> None:
        self.debug_modes_set.append(mode)
        self.debug_mode = mode

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeDevice:
        install(
            monkeypatch,
            self,
            devices_with_context=lambda: (0,),
            visible_device_total=lambda: 1,
            stream_is_capturing=lambda: self.capturing,
            get_sync_debug_mode=lambda: self.debug_mode,
        )
        return self
