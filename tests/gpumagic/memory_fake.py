"""A stand-in for the GPU seam's memory functions, for logic tests on machines without a GPU.

It keeps allocator counters the way torch's caching allocator does (allocated,
reserved, monotone peaks until reset), NVML figures derived from them (context +
reserved for this process, other processes, driver reservation), and, while
"recording", the Python stack of each allocation so ``--trace`` can be exercised with
real IPython cell files. With events on (``--timeline``, or a user's recording with
``user_events``) it keeps torch's ring of allocator events too. The real seam is
exercised by the ``cuda``-marked tests.

Only gpumagic's memory modules see the fake (their ``cuda`` attribute is replaced by a
:class:`Seam`); other plugins of the test session keep asking the real seam.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

from gpumagic import cuda, memory, memory_cell, memory_holders, memory_magics
from gpumagic.devices import CudaStatus, DeviceInfo

if TYPE_CHECKING:
    import pytest

MiB = 2**20
GiB = 2**30


class Seam:
    """``gpumagic.cuda`` with some of its functions replaced."""

    def __init__(self) -> None:
        self.overrides: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        if name in self.overrides:
            return self.overrides[name]
        return getattr(cuda, name)


class FakeGpu:
    """``n`` devices of 140 GiB; this process's context is 500 MiB once initialised."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        n: int = 2,
        *,
        initialized: bool = True,
        nvml: bool = True,
        others: dict[int, list[tuple[int, int | None]]] | None = None,
    ) -> None:
        self.devices = tuple(
            DeviceInfo(i, f"Fake H200 {i}", 140 * GiB, (9, 0), uuid=f"GPU-{i}", physical_index=i)
            for i in range(n)
        )
        self.initialized = initialized
        self.nvml = nvml
        self.context = 500 * MiB
        self.driver_reserved = 512 * MiB
        self.unlisted = 64 * MiB
        self.list_self = True
        self.others = others if others is not None else {0: [(4242, GiB)]}
        self.counters = {i: dict.fromkeys(_NAMES, 0) for i in range(n)}
        self.resets: list[int] = []
        self.empty_cache_calls = 0
        self.recording = False
        self.user_recording = False
        self.history_starts = 0
        self.history_settings: dict[str, Any] = {}
        self.user_events = False  # the user's recording keeps events (enabled="all")
        self.user_max_entries = 1_000_000
        self.events: dict[int, list[dict[str, Any]]] = {i: [] for i in range(n)}
        self.blocks: dict[int, tuple[int, int, list[dict[str, Any]]]] = {}
        self.touched: set[int] = set()  # devices with a context
        self._next_address = 1
        status = CudaStatus(
            True, "", torch_version="2.11", cuda_version="13.0", devices=self.devices
        )
        self.seam = Seam()
        self.seam.overrides.update(
            {
                "status": lambda: status,
                "is_initialized": lambda: self.initialized,
                "allocator_stats": self.allocator_stats,
                "reset_peak_memory_stats": self.reset_peak,
                "empty_cache": self.empty_cache,
                "allocator_backend": lambda: "native" if self.initialized else None,
                "device_total_memory": lambda i: 140 * GiB if self.initialized else None,
                "nvml_memory_info": self.nvml_memory_info,
                "nvml_processes": self.nvml_processes,
                "start_memory_history": self.start_history,
                "stop_memory_history": self.stop_history,
                "memory_history_enabled": lambda: self.recording or self.user_recording,
                "memory_snapshot": self.snapshot,
            }
        )
        for module in (memory, memory_cell, memory_holders, memory_magics):
            monkeypatch.setattr(module, "cuda", self.seam)

    # -- allocator -----------------------------------------------------------------

    def alloc(self, nbytes: int, device: int = 0) -> int:
        """Allocate like torch (segments grow as needed); returns the block's address."""
        self.initialized = True
        self.touched.add(device)
        c = self.counters[device]
        c["allocated"] += nbytes
        c["requested"] += nbytes
        c["peak_allocated"] = max(c["peak_allocated"], c["allocated"])
        if c["allocated"] > c["reserved"]:
            self._event("segment_alloc", device, 0, c["allocated"] - c["reserved"], [])
        c["reserved"] = max(c["reserved"], c["allocated"])
        c["peak_reserved"] = max(c["peak_reserved"], c["reserved"])
        address = self._next_address
        self._next_address += 1
        frames = []
        if self.recording or self.user_recording:
            frame = sys._getframe(1)
            while frame is not None:
                frames.append(
                    {
                        "filename": frame.f_code.co_filename,
                        "line": frame.f_lineno,
                        "name": frame.f_code.co_name,
                    }
                )
                frame = frame.f_back  # type: ignore[assignment]
        self.blocks[address] = (device, nbytes, frames)
        self._event("alloc", device, address, nbytes, frames)
        return address

    def free(self, address: int) -> None:
        device, nbytes, frames = self.blocks.pop(address)
        self.counters[device]["allocated"] -= nbytes
        self.counters[device]["requested"] -= nbytes
        self._event("free_requested", device, address, nbytes, frames)
        self._event("free_completed", device, address, nbytes, frames)

    def _event(
        self, action: str, device: int, address: int, nbytes: int, frames: list[dict[str, Any]]
    ) -> None:
        if self.recording:
            settings = self.history_settings
            if not settings["events"] or action in settings["skip_actions"]:
                return
            limit = settings["max_entries"]
        elif self.user_recording and self.user_events:
            limit = self.user_max_entries
        else:
            return
        ring = self.events[device]
        ring.append(
            {
                "action": action,
                "addr": address,
                "size": nbytes,
                "frames": frames,
                "time_us": time.time_ns() // 1000,
            }
        )
        del ring[:-limit]

    def allocator_stats(self, device: int) -> cuda.AllocatorStats:
        if not self.initialized:
            return cuda.AllocatorStats()
        return cuda.AllocatorStats(**self.counters[device])

    def reset_peak(self, device: int) -> None:
        self.resets.append(device)
        c = self.counters[device]
        c["peak_allocated"] = c["allocated"]
        c["peak_reserved"] = c["reserved"]

    def empty_cache(self) -> None:
        self.empty_cache_calls += 1
        for c in self.counters.values():
            c["reserved"] = c["allocated"]

    # -- NVML ------------------------------------------------------------------------

    def _own(self, device: int) -> int | None:
        if not self.initialized or device not in self.touched:
            return None
        return self.context + self.counters[device]["reserved"]

    def nvml_processes(self, device: DeviceInfo) -> list[tuple[int, int | None]]:
        if not self.nvml:
            raise cuda.CudaUnavailable("NVML is not available (no NVIDIA driver library)")
        procs = list(self.others.get(device.index, []))
        own = self._own(device.index)
        if own is not None and self.list_self:
            procs.append((os.getpid(), own))
        return sorted(procs)

    def nvml_memory_info(self, device: DeviceInfo) -> cuda.NvmlMemory:
        if not self.nvml:
            raise cuda.CudaUnavailable("NVML is not available (no NVIDIA driver library)")
        used = sum(u or 0 for _, u in self.others.get(device.index, []))
        used += (self._own(device.index) or 0) + self.unlisted
        total = device.total_memory
        free = total - used - self.driver_reserved
        return cuda.NvmlMemory(total, used, free, self.driver_reserved)

    # -- allocation stacks -------------------------------------------------------------

    def start_history(
        self, max_entries: int, *, events: bool = False, skip_actions: tuple[str, ...] = ()
    ) -> bool:
        assert 0 < max_entries < 1_000_000, "the ring buffer must be bounded"
        self.initialized = True
        if self.user_recording:
            return False
        self.history_starts += 1
        self.history_settings = {
            "max_entries": max_entries,
            "events": events,
            "skip_actions": skip_actions,
        }
        self.recording = True
        return True

    def stop_history(self) -> None:
        assert self.recording, "stopped a recording gpumagic did not start"
        self.recording = False
        for ring in self.events.values():
            ring.clear()  # as torch does when recording stops

    def snapshot(self) -> dict[str, Any]:
        segments = [
            {
                "device": device,
                "blocks": [{"size": nbytes, "state": "active_allocated", "frames": frames}],
            }
            for device, nbytes, frames in self.blocks.values()
        ]
        return {
            "segments": segments,
            "device_traces": [list(self.events[i]) for i in range(len(self.devices))],
        }


_NAMES = (
    "allocated",
    "reserved",
    "peak_allocated",
    "peak_reserved",
    "requested",
)
