"""The seam's allocator in miniature, and the one way tests put a fake in the seam.

:func:`install` replaces :mod:`gpumagic.cuda`'s functions until a ``pytest.MonkeyPatch``
is undone. :class:`FakeAllocator` is torch's caching allocator on made-up devices:
counters, library caches (cuBLAS, cuFFT, streams, torch.compile), stack recording with
the ring of events, snapshots, and NVML's view of this process and others. Its
:meth:`~FakeAllocator.tensor` frees its block when the object dies, so a leak is a tensor
kept alive, as on a GPU. gpumagic's memory magics and pytest_cuda's leak checks run for
real on top of it; planted suites copy this file and install one at import.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

from gpumagic import cuda
from gpumagic.devices import CudaStatus, DeviceInfo

if TYPE_CHECKING:
    import pytest

MiB = 2**20
GiB = 2**30


def install(monkeypatch: pytest.MonkeyPatch, fake: object = None, /, **functions: Any) -> None:
    """Each of :mod:`gpumagic.cuda`'s functions named as a public method of ``fake``'s
    class (its bases included), or as a keyword, is replaced by it until ``monkeypatch``
    is undone."""
    names = {n for c in type(fake).__mro__ for n in vars(c) if n[0] != "_" and hasattr(cuda, n)}
    for name, function in ({n: getattr(fake, n) for n in names} | functions).items():
        monkeypatch.setattr(cuda, name, function)


class FakeTensor:
    """Holds one block; frees it when it dies."""

    def __init__(self, owner: FakeAllocator, device: int, address: int, size: int) -> None:
        self.owner, self.device, self.address, self.size = owner, device, address, size

    def __del__(self) -> None:
        self.owner.free(self.address)


class FakeAllocator:
    """``n`` devices of 140 GiB; this process's context is 500 MiB on each device used."""

    def __init__(
        self,
        n: int = 1,
        *,
        initialized: bool = False,
        nvml: bool = True,
        others: dict[int, list[tuple[int, int | None]]] | None = None,
    ) -> None:
        self.devices = tuple(
            DeviceInfo(i, f"Fake H200 {i}", 140 * GiB, (9, 0), uuid=f"GPU-{i}", physical_index=i)
            for i in range(n)
        )
        self.initialized, self.nvml, self.list_self = initialized, nvml, True
        self.context, self.driver_reserved, self.unlisted = 500 * MiB, 512 * MiB, 64 * MiB
        self.others = others if others is not None else {0: [(4242, GiB)]}
        fields = cuda.AllocatorStats.__dataclass_fields__
        self.counters = [dict.fromkeys(fields, 0) for _ in self.devices]
        self.blocks: dict[int, dict[str, Any]] = {}
        self.next_address = 0x7F00_0000_0000
        self.touched: set[int] = set()  # devices with a context
        self.resets: list[int] = []
        self.calls: list[str] = []
        self.queued: list[Any] = []  # on_cuda_init callbacks
        self.recording = False  # gpumagic's or pytest_cuda's recording
        self.user_recording = self.user_events = False  # the user's, with events or not
        self.empty_cache_calls = self.history_starts = 0
        self.user_max_entries = 1_000_000
        self.history_settings: dict[str, Any] = {}
        self.events: list[list[dict[str, Any]]] = [[] for _ in self.devices]
        self.workspaces: dict[int, FakeTensor] = {}
        self.fft_plans: dict[int, list[FakeTensor]] = {}
        self.compiled: list[FakeTensor] = []
        self.awaiting: list[FakeTensor] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
        status = CudaStatus(
            True, "", torch_version="2.11", cuda_version="13.0", devices=self.devices
        )
        install(
            monkeypatch,
            self,
            status=lambda: status,
            is_initialized=lambda: self.initialized,
            visible_device_total=lambda: len(self.devices) if self.initialized else 0,
            devices_with_context=lambda: tuple(d.index for d in self.devices if self.initialized),
            allocator_backend=lambda: "native" if self.initialized else None,
            device_total_memory=lambda i: 140 * GiB if self.initialized else None,
            memory_history_enabled=lambda: self.recording or self.user_recording,
            async_error=lambda: None,  # the made-up GPU never has an asynchronous error
            synchronize=lambda devices=None: None,  # nothing is ever queued on it
        )
        return self

    # -- what test code does ---------------------------------------------------------

    def init(self) -> None:
        if not self.initialized:
            self.initialized = True
            for callback in self.queued:
                callback()
            self.queued.clear()

    def alloc(self, size: int, device: int = 0, requested: int | None = None) -> int:
        """Allocate a block of ``size`` bytes on ``device``; returns its address."""
        self.init()
        self.touched.add(device)
        requested = size if requested is None else requested
        c = self.counters[device]
        c["allocated"] += size
        c["requested"] += requested
        c["allocations"] += 1
        c["peak_allocated"] = max(c["peak_allocated"], c["allocated"])
        if c["allocated"] > c["reserved"]:
            self._event("segment_alloc", device, 0, c["allocated"] - c["reserved"], [])
            c["reserved"] = c["allocated"]
            c["peak_reserved"] = max(c["peak_reserved"], c["reserved"])
        address = self.next_address
        self.next_address += size + 512
        recording = self.recording or self.user_recording
        stack = traceback.walk_stack(sys._getframe()) if recording else ()
        frames = [  # innermost first, as torch gives them; none of this file's
            {"filename": f.f_code.co_filename, "line": line, "name": f.f_code.co_name}
            for f, line in stack
            if f.f_code.co_filename != __file__
        ]
        self.blocks[address] = {"device": device, "size": size, "requested": requested}
        self.blocks[address]["frames"] = frames
        self._event("alloc", device, address, size, frames)
        return address

    def free(self, address: int) -> None:
        block = self.blocks.pop(address, None)
        if block is not None:
            device, size = block["device"], block["size"]
            self.counters[device]["allocated"] -= size
            self.counters[device]["requested"] -= block["requested"]
            self._event("free_requested", device, address, size, block["frames"])
            self._event("free_completed", device, address, size, block["frames"])

    def tensor(self, nbytes: int, device: int = 0) -> FakeTensor:
        """``nbytes`` as torch allocates them: in a block of a multiple of 512 B."""
        size = max(512, -(-nbytes // 512) * 512)
        return FakeTensor(self, device, self.alloc(size, device, nbytes), size)

    def matmul(self, device: int = 0) -> None:
        """A first matmul: cuBLAS keeps a workspace until it is cleared."""
        if device not in self.workspaces:
            self.workspaces[device] = self.tensor(32 * MiB, device)  # as on Hopper

    def fft(self, device: int = 0) -> None:
        """An FFT: its plan stays in the plan cache."""
        self.fft_plans.setdefault(device, []).append(self.tensor(2 * MiB, device))

    def compile(self) -> None:
        """A first torch.compile call: the compiled graph keeps a constant."""
        self.compiled.append(self.tensor(4096))

    def free_on_another_stream(self, tensor: FakeTensor) -> None:
        """``del`` after ``record_stream``: the block waits for the stream."""
        self.awaiting.append(tensor)

    def _event(self, action: str, device: int, addr: int, size: int, frames: list[Any]) -> None:
        # The allocator's ring of events, with epoch microseconds as torch gives them.
        if self.recording:
            settings = self.history_settings
            if not settings["events"] or action in settings["skip_actions"]:
                return
            limit = settings["max_entries"]
        elif self.user_recording and self.user_events:
            limit = self.user_max_entries
        else:
            return
        now, ring = time.time_ns() // 1000, self.events[device]
        ring.append({"action": action, "addr": addr, "size": size, "frames": frames})
        ring[-1]["time_us"] = now
        del ring[:-limit]

    # -- the seam ----------------------------------------------------------------------

    def allocator_stats(self, device: int = 0) -> cuda.AllocatorStats:
        return cuda.AllocatorStats(**(self.counters[device] if self.initialized else {}))

    def reset_peak_memory_stats(self, device: int) -> None:
        self.resets.append(device)
        c = self.counters[device]
        c["peak_allocated"], c["peak_reserved"] = c["allocated"], c["reserved"]

    def empty_cache(self) -> None:
        self.empty_cache_calls += 1
        for c in self.counters:
            c["reserved"] = c["allocated"]

    def release_blas_workspaces(self) -> bool:
        self.calls.append("release_blas_workspaces")
        self.workspaces.clear()
        return self.initialized

    def clear_fft_plan_caches(self, devices: tuple[int, ...]) -> bool:
        self.calls.append("clear_fft_plan_caches")
        cleared = [self.fft_plans.pop(device, None) for device in devices]
        return any(cleared)

    def release_cached_blocks(self, devices: tuple[int, ...]) -> None:
        self.calls.append("release_cached_blocks")
        self.awaiting.clear()

    def reset_compile_caches(self) -> bool:
        self.calls.append("reset_compile_caches")
        had, self.compiled = bool(self.compiled), []
        return had

    def on_cuda_init(self, callback: Any) -> bool:
        if self.initialized:
            callback()
        else:
            self.queued.append(callback)
        return True

    def start_memory_history(
        self,
        max_entries: int,
        *,
        events: bool = False,
        event_stacks: bool = True,
        skip_actions: tuple[str, ...] = (),
    ) -> bool:
        self.calls.append(f"start_memory_history({max_entries}, events={events})")
        assert 0 < max_entries < 1_000_000, "the ring buffer must be bounded"
        self.init()
        if self.recording or self.user_recording:
            return False
        self.history_starts += 1
        self.history_settings = {"max_entries": max_entries, "events": events}
        self.history_settings["skip_actions"] = skip_actions
        self.recording = True
        return True

    def stop_memory_history(self) -> None:
        self.calls.append("stop_memory_history")
        assert self.recording, "stopped a recording nobody started"
        self.recording = False
        for ring in self.events:
            ring.clear()  # as torch does when recording stops

    def memory_snapshot(self) -> dict[str, Any]:
        segments = []
        for address, b in sorted(self.blocks.items()):
            active = {"address": address, "size": b["size"], "requested_size": b["requested"]}
            active |= {"state": "active_allocated", "frames": b["frames"]}
            rest = {"address": address + b["size"], "size": 512, "state": "inactive"}
            segments.append({"device": b["device"], "address": address, "blocks": [active, rest]})
        return {"segments": segments, "device_traces": [list(ring) for ring in self.events]}

    def tensor_facts(self, obj: object) -> cuda.TensorFacts | None:
        """A :class:`FakeTensor`'s facts, as the seam gives a CUDA tensor's; not those of an
        earlier planted run's allocator (on a GPU they would be another process's)."""
        if type(obj) is not FakeTensor or obj.owner is not self:
            return None
        device = f"cuda:{obj.device}"
        return cuda.TensorFacts((device, obj.address), obj.size, device, (obj.size,), "uint8")

    # -- NVML --------------------------------------------------------------------------

    def _own(self, device: int) -> int | None:
        if not self.nvml:
            raise cuda.CudaUnavailable("NVML is not available (no NVIDIA driver library)")
        if not self.initialized or device not in self.touched:
            return None
        return self.context + self.counters[device]["reserved"]

    def nvml_processes(self, device: DeviceInfo) -> list[tuple[int, int | None]]:
        own = self._own(device.index)
        procs = list(self.others.get(device.index, []))
        if own is not None and self.list_self:
            procs.append((os.getpid(), own))
        return sorted(procs)

    def nvml_memory_info(self, device: DeviceInfo) -> cuda.NvmlMemory:
        used = (self._own(device.index) or 0) + self.unlisted
        used += sum(u or 0 for _, u in self.others.get(device.index, []))
        free = device.total_memory - used - self.driver_reserved
        return cuda.NvmlMemory(device.total_memory, used, free, self.driver_reserved)
