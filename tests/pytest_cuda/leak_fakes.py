"""A caching allocator in miniature, for the leak checks' tests on machines without a GPU.

:func:`install` puts a :class:`FakeAllocator` in place of the parts of
:mod:`gpumagic.cuda` the leak checks use: CUDA initialisation, the allocator's counters,
what libraries keep (cuBLAS workspaces, cuFFT plans, blocks waiting on a stream,
torch.compile caches), allocation-stack recording and snapshots. A planted suite's
``conftest.py`` calls it at import, so in-process runs, subprocesses and xdist workers
all get one; the plugin and :mod:`pytest_cuda.leaks` run for real on top of it.

Memory is held the way torch holds it: :meth:`FakeAllocator.tensor` returns a
:class:`FakeTensor` whose block is freed when the object dies (refcount or garbage
collection), so a leak is a tensor kept alive, exactly as on a GPU.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

from gpumagic import cuda
from gpumagic.devices import CudaStatus, DeviceInfo

MIB = 1024**2
#: What the fake's libraries keep, per device (cuBLAS: 32 MiB on Hopper, as on the H200).
WORKSPACE = 32 * MIB
FFT_PLAN = 2 * MIB
COMPILED = 4096

SEAM = (
    "is_initialized",
    "allocator_stats",
    "visible_device_total",
    "release_blas_workspaces",
    "clear_fft_plan_caches",
    "release_cached_blocks",
    "reset_compile_caches",
    "memory_history_enabled",
    "start_memory_history",
    "stop_memory_history",
    "memory_snapshot",
    "reset_peak_memory_stats",
    "on_cuda_init",
    "status",
    "async_error",
    "devices_with_context",
    "synchronize",
    "tensor_facts",
)


def _rounded(nbytes: int) -> int:
    # The caching allocator hands out multiples of 512 B (a 4-byte tensor takes 512 B).
    return max(512, -(-nbytes // 512) * 512)


class FakeTensor:
    """Holds one block; frees it when it dies."""

    def __init__(self, owner: FakeAllocator, device: int, address: int, size: int) -> None:
        self.owner = owner
        self.device = device
        self.address = address
        self.size = size

    def __del__(self) -> None:
        self.owner.free(self.address)


class FakeAllocator:
    """Per-device counters and blocks, the library caches, recording and snapshots."""

    def __init__(self, devices: int = 1) -> None:
        self.devices = devices
        self.initialized = False
        self.allocated = [0] * devices
        self.peak = [0] * devices
        self.count = [0] * devices
        self.blocks: dict[int, dict[str, Any]] = {}
        self.next_address = 0x7F00_0000_0000
        self.recording = False
        self.max_entries = 0
        self.skip_actions: tuple[str, ...] = ()
        self.events: list[list[dict[str, Any]]] = [[] for _ in range(devices)]
        self.workspaces: dict[int, FakeTensor] = {}
        self.fft_plans: dict[int, list[FakeTensor]] = {}
        self.compiled: list[FakeTensor] = []
        self.awaiting: list[FakeTensor] = []
        self.queued: list[Any] = []
        self.calls: list[str] = []

    # -- what test code does ---------------------------------------------------

    def init(self) -> None:
        if self.initialized:
            return
        self.initialized = True
        for callback in self.queued:
            callback()
        self.queued.clear()

    def tensor(self, nbytes: int, device: int = 0) -> FakeTensor:
        """Allocate ``nbytes`` (rounded up to a 512 B block) on ``device``."""
        self.init()
        size = _rounded(nbytes)
        address = self.next_address
        self.next_address += size + 512
        frames = []
        if self.recording:
            stack = [f for f in traceback.extract_stack() if f.filename != __file__]
            frames = [
                {"filename": f.filename, "line": f.lineno, "name": f.name} for f in reversed(stack)
            ]
        self.blocks[address] = {
            "device": device,
            "size": size,
            "requested": nbytes,
            "frames": frames,
        }
        self._event(device, "alloc", address, size, frames)
        self.allocated[device] += size
        self.count[device] += 1
        self.peak[device] = max(self.peak[device], self.allocated[device])
        return FakeTensor(self, device, address, size)

    def free(self, address: int) -> None:
        block = self.blocks.pop(address, None)
        if block is not None:
            self.allocated[block["device"]] -= block["size"]
            self._event(block["device"], "free_completed", address, block["size"], [])

    def _event(
        self, device: int, action: str, address: int, size: int, frames: list[dict[str, Any]]
    ) -> None:
        # The allocator's ring of events, with epoch microseconds as torch gives them.
        if not self.recording or action in self.skip_actions:
            return
        ring = self.events[device]
        ring.append(
            {
                "action": action,
                "addr": address,
                "size": size,
                "frames": frames,
                "time_us": time.time_ns() // 1000,
            }
        )
        del ring[: max(0, len(ring) - self.max_entries)]

    def matmul(self, device: int = 0) -> None:
        """A first matmul: cuBLAS keeps a workspace until it is cleared."""
        if device not in self.workspaces:
            self.workspaces[device] = self.tensor(WORKSPACE, device)

    def fft(self, device: int = 0) -> None:
        """An FFT: its plan stays in the plan cache."""
        self.fft_plans.setdefault(device, []).append(self.tensor(FFT_PLAN, device))

    def compile(self) -> None:
        """A first torch.compile call: the compiled graph keeps a constant."""
        self.compiled.append(self.tensor(COMPILED))

    def free_on_another_stream(self, tensor: FakeTensor) -> None:
        """``del`` after ``record_stream``: the block waits for the stream."""
        self.awaiting.append(tensor)

    # -- the seam ---------------------------------------------------------------

    def is_initialized(self) -> bool:
        return self.initialized

    def visible_device_total(self) -> int:
        return self.devices if self.initialized else 0

    def allocator_stats(self, device: int = 0) -> cuda.AllocatorStats:
        if not self.initialized:
            return cuda.AllocatorStats(0, 0, 0, 0)
        return cuda.AllocatorStats(
            allocated=self.allocated[device],
            reserved=self.allocated[device],
            peak_allocated=self.peak[device],
            peak_reserved=self.peak[device],
            allocations=self.count[device],
        )

    def reset_peak_memory_stats(self, device: int) -> None:
        self.peak[device] = self.allocated[device]

    def release_blas_workspaces(self) -> bool:
        self.calls.append("release_blas_workspaces")
        self.workspaces.clear()
        return self.initialized

    def clear_fft_plan_caches(self, devices: tuple[int, ...]) -> bool:
        self.calls.append("clear_fft_plan_caches")
        cleared = any(self.fft_plans.get(d) for d in devices)
        for device in devices:
            self.fft_plans.pop(device, None)
        return cleared

    def release_cached_blocks(self, devices: tuple[int, ...]) -> None:
        self.calls.append("release_cached_blocks")
        self.awaiting.clear()

    def reset_compile_caches(self) -> bool:
        self.calls.append("reset_compile_caches")
        had = bool(self.compiled)
        self.compiled.clear()
        return had

    def memory_history_enabled(self) -> bool:
        return self.recording

    def start_memory_history(
        self,
        max_entries: int,
        *,
        events: bool = False,
        event_stacks: bool = True,
        skip_actions: tuple[str, ...] = (),
    ) -> bool:
        self.calls.append(f"start_memory_history({max_entries}, events={events})")
        self.skip_actions = skip_actions
        if self.recording:
            return False
        self.recording = True
        self.max_entries = max_entries
        return True

    def stop_memory_history(self) -> None:
        self.calls.append("stop_memory_history")
        self.recording = False

    def memory_snapshot(self) -> dict[str, Any]:
        return {"segments": self._segments(), "device_traces": [list(r) for r in self.events]}

    def _segments(self) -> list[dict[str, Any]]:
        segments = []
        for address, block in sorted(self.blocks.items()):
            segments.append(
                {
                    "device": block["device"],
                    "address": address,
                    "blocks": [
                        {
                            "address": address,
                            "size": block["size"],
                            "requested_size": block["requested"],
                            "state": "active_allocated",
                            "frames": block["frames"],
                        },
                        {"address": address + block["size"], "size": 512, "state": "inactive"},
                    ],
                }
            )
        return segments

    def on_cuda_init(self, callback: Any) -> bool:
        if self.initialized:
            callback()
        else:
            self.queued.append(callback)
        return True

    def async_error(self) -> None:
        """The made-up GPU never has an asynchronous error (pytest_cuda's health check)."""
        return

    def devices_with_context(self) -> tuple[int, ...]:
        return tuple(range(self.devices)) if self.initialized else ()

    def tensor_facts(self, obj: object) -> cuda.TensorFacts | None:
        """A :class:`FakeTensor`'s facts, as the seam gives a CUDA tensor's. Tensors of
        an earlier planted run's allocator (pytester keeps its reports) are not this
        one's: on a GPU they would be another process's."""
        if type(obj) is not FakeTensor or obj.owner is not self:
            return None
        device = f"cuda:{obj.device}"
        return cuda.TensorFacts((device, obj.address), obj.size, device, (obj.size,), "uint8")

    def synchronize(self, devices: object = None) -> None:
        """Nothing is ever queued on the made-up GPU."""

    def status(self) -> CudaStatus:
        devices = tuple(
            DeviceInfo(i, "Fake GPU", 80 * 1024**3, (9, 0), uuid=f"GPU-fake-{i}")
            for i in range(self.devices)
        )
        return CudaStatus(
            True, "", torch_version="2.11.0+cu130", cuda_version="13.0", devices=devices
        )


def seam_names() -> list[str]:
    """The names of :data:`SEAM` this version of the seam has (the health check's
    functions come with pytest_cuda's sync module)."""
    return [name for name in SEAM if hasattr(cuda, name)]


def install(devices: int = 1) -> FakeAllocator:
    """A new :class:`FakeAllocator` in place of the seam's allocator functions."""
    fake = FakeAllocator(devices)
    for name in seam_names():
        setattr(cuda, name, getattr(fake, name))
    return fake
