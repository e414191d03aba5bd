"""The one way tests put a fake in the seam, and the fakes of its facilities.

:func:`install` replaces :mod:`gpumagic.cuda`'s functions until a ``pytest.MonkeyPatch``
is undone. :class:`FakeMachine` is a made-up machine's pynvml (boards, their memory,
processes and SM clocks) and torch's version file, put in the seam's one hook
(``discovery._machine``): discovery and NVML's readings run for real on it. Planted plugin
suites copy this file and call :func:`install_planted` at import (the machine in
``$PYTEST_CUDA_FAKE_GPUS``: ``{"torch": "2.11.0+cu130", "cuda": "13.0", "driver":
"580.95.05", "boards": [board(0), …]}``; ``"cuda": null`` is a CPU-only torch, ``"boards":
[]`` a driver without GPUs). :class:`FakeAllocator` is torch's caching allocator on such a
machine; a leak is one of its tensors kept alive, as on a GPU. The runtime's fake is
``tests/gpumagic/fake_runtime.py``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from gpumagic import cuda
from gpumagic.cuda import discovery

MiB = 2**20
GiB = GIB = 2**30
H200_TOTAL = 150_754_820_096  # what NVML reports for an H200 (140.4 GiB)
CPU_BUILD = {"boards": [], "cuda": None, "torch": "2.11.0+cpu"}
CPU_BUILD_REASON = "torch 2.11.0+cpu was built without CUDA (a CPU-only build)"


def install(monkeypatch: pytest.MonkeyPatch, fake: object = None, /, **functions: Any) -> None:
    """Each :mod:`gpumagic.cuda` function named as a public method of ``fake``'s class
    (or a base), or as a keyword, is replaced by it until ``monkeypatch`` is undone."""
    names = {n for c in type(fake).__mro__ for n in vars(c) if n[0] != "_" and hasattr(cuda, n)}
    for name, function in ({n: getattr(fake, n) for n in names} | functions).items():
        monkeypatch.setattr(cuda, name, function)


def board(i: int, name: str = "NVIDIA H200", *, total: int = H200_TOTAL, **more: Any) -> dict:
    """One made-up board, ``GPU-fake-<i>``; ``more``: ``free`` (when idle; default all but
    1 GiB), ``capability``, ``migs`` (boards), ``uuid``, ``reserved`` (by the driver)."""
    found = {"name": name, "uuid": f"GPU-fake-{i}", "total": total, "free": total - GIB}
    return found | {"capability": [9, 0], "migs": [], "reserved": None} | more


def h200s(count: int) -> list[dict[str, Any]]:
    return [board(i) for i in range(count)]


class NVMLError(Exception):
    """Raised where real NVML raises (no MIG mode, unknown handle, no clock)."""


def _known(value: Any) -> Any:
    """``value``, or NVML's error where it is ``None`` (NVML cannot say)."""
    if value is None:
        raise NVMLError("Not Supported")
    return value


class FakeMachine:
    """pynvml as the seam calls it, answered from ``boards``: ``own(i)`` is this process's
    use of board ``i`` (``None``: no context), ``others`` other processes'; ``clocks`` the
    SM clock's ``(MHz, reasons)``, read in turn (the last once they run out; none: NVML
    cannot read it). Its functions are attributes: ``del`` one for older bindings."""

    NVMLError, NVML_CLOCK_SM, nvmlMemory_v2 = NVMLError, 0, 2

    def __init__(self, boards: list[dict], driver: str | None = "580.95.05", **versions: Any):
        self.boards = [self._handle(i, b) for i, b in enumerate(boards)]
        self.driver, self.nvml, self.list_self = driver, True, True
        self.versions = {"torch": "2.11.0+cu130", "cuda": "13.0"} | versions
        self.own: Any = lambda i: None
        self.others: dict[int, list[tuple[int, int | None]]] = {}  # [(pid, bytes)] by board
        self.clocks, self.clock_reads, self.default_mhz = [], 0, 1980
        by_uuid = {h.uuid.encode(): h for b in self.boards for h in (b, *b.migs)}
        vars(self).update(
            nvmlSystemGetDriverVersion=lambda: self.driver,
            nvmlDeviceGetCount=lambda: len(self.boards),
            nvmlDeviceGetHandleByIndex=lambda i: self.boards[i],
            nvmlDeviceGetHandleByUUID=lambda uuid: _known(by_uuid.get(uuid)),
            nvmlDeviceGetName=lambda h: h.name,
            nvmlDeviceGetUUID=lambda h: h.uuid.encode(),
            nvmlDeviceGetCudaComputeCapability=lambda h: tuple(h.capability),
            nvmlDeviceGetMaxMigDeviceCount=lambda h: _known(len(h.migs) or None),
            nvmlDeviceGetMigDeviceHandleByIndex=lambda h, j: h.migs[j],
            nvmlDeviceGetComputeRunningProcesses=self._processes,
            nvmlDeviceGetGraphicsRunningProcesses=lambda h: [],
            nvmlDeviceGetMemoryInfo=self._memory,
            nvmlDeviceGetClockInfo=self._clock,
            nvmlDeviceGetCurrentClocksEventReasons=self._clock,
            nvmlDeviceGetCurrentClocksThrottleReasons=self._clock,  # its name before NVML 12.2
            nvmlDeviceGetDefaultApplicationsClock=lambda h, kind: _known(self.default_mhz),
            nvmlDeviceGetMaxClockInfo=lambda h, kind: 1980,
        )

    def _handle(self, i: int, b: dict[str, Any]) -> SimpleNamespace:
        b = {"free": b["total"], "migs": [], "reserved": None} | b
        migs = [self._handle(-1, m) for m in b["migs"]]
        return SimpleNamespace(**b | {"index": i, "migs": migs})

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeMachine:
        monkeypatch.setattr(discovery, "_machine", (self, self.versions))
        if not self.nvml:  # a driver without NVML's library: no readings
            install(monkeypatch, nvml_memory_info=self._missing, nvml_processes=self._missing)
        cuda.reset_status_cache()
        return self

    def _missing(self, device: object) -> None:
        raise cuda.CudaUnavailable("NVML is not available (no NVIDIA driver library)")

    def _processes(self, handle: SimpleNamespace) -> list[Any]:
        procs = list(self.others.get(handle.index, []))
        if self.own(handle.index) is not None and self.list_self:
            procs.append((os.getpid(), self.own(handle.index)))
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in procs]

    def _memory(self, handle: SimpleNamespace, version: int = 1) -> SimpleNamespace:
        """v1: ``used`` counts the driver's reservation; v2 (where the board says what it
        reserves): ``used`` does not, and ``reserved`` says it."""
        if version == 2 and handle.reserved is None:
            raise TypeError("no v2 memory query here")
        reserved = handle.reserved or 0
        used = handle.total - handle.free - reserved + (self.own(handle.index) or 0)
        used += sum(u or 0 for _, u in self.others.get(handle.index, []))
        free = handle.total - used - reserved
        used += reserved if version == 1 else 0
        return SimpleNamespace(total=handle.total, used=used, free=free, reserved=reserved)

    def _clock(self, handle: SimpleNamespace, kind: int | None = None) -> int:
        """The next of ``clocks``' MHz (a clock ``kind`` given), else the reasons for it."""
        if not self.clocks:
            raise NVMLError("no clock here")
        self.clock_reads += kind is not None
        mhz, reasons = self.clocks[min(self.clock_reads, len(self.clocks)) - 1]
        return _known(mhz if kind is not None else reasons)


def install_planted() -> FakeMachine:
    """Put the machine in ``$PYTEST_CUDA_FAKE_GPUS`` in the seam for good (a planted
    suite's ``conftest.py``, at import: the outer test puts the seam back)."""
    spec = json.loads(os.environ["PYTEST_CUDA_FAKE_GPUS"])
    return FakeMachine(spec.pop("boards"), **spec).install(pytest.MonkeyPatch())


def install_torch_stand_in() -> None:
    """A stand-in for torch in ``sys.modules``, for planted runs about which devices each
    xdist worker gets (the real torch costs 1.6 s of CPU per process): their fixtures'
    devices are read as text, ``cuda:1`` (the real ones: test_plugin_gpu.py on a GPU)."""
    if "torch" not in sys.modules:
        torch = sys.modules["torch"] = ModuleType("torch")
        torch.device = lambda kind, index: f"{kind}:{index}"  # type: ignore[attr-defined]
        torch.cuda = SimpleNamespace(is_initialized=lambda: False)  # type: ignore[attr-defined]


class FakeTensor:
    """Holds one block; frees it when it dies."""

    def __init__(self, owner: FakeAllocator, device: int, address: int, size: int) -> None:
        self.owner, self.device, self.address, self.size = owner, device, address, size

    def __del__(self) -> None:
        self.owner.free(self.address)


class FakeAllocator:
    """``n`` devices of 140 GiB; this process's context is 500 MiB on each device used."""

    def __init__(self, n: int = 1, *, initialized: bool = False, nvml: bool = True) -> None:
        self.context, self.unlisted = 500 * MiB, 64 * MiB
        kept = {"free": 140 * GiB - self.unlisted - 512 * MiB, "reserved": 512 * MiB}
        boards = [
            board(i, f"Fake H200 {i}", total=140 * GiB, uuid=f"GPU-{i}") | kept for i in range(n)
        ]
        self.machine = FakeMachine(boards, None, torch="2.11")  # a driver without a version
        self.devices = tuple(discovery._nvml_physical_devices(self.machine))  # type: ignore[arg-type]
        self.machine.own, self.machine.nvml = self._own, nvml
        self.machine.others = {0: [(4242, GiB)]}  # another process's GiB on cuda:0
        self.initialized, self.next_address = initialized, 0x7F00_0000_0000
        fields = cuda.AllocatorStats.__dataclass_fields__
        self.counters = [dict.fromkeys(fields, 0) for _ in range(n)]
        self.freed, self.events = [0] * n, [[] for _ in range(n)]  # bytes freed ever; rings
        self.blocks, self.touched = {}, set()  # blocks by address; devices with a context
        self.resets, self.calls, self.queued = [], [], []  # peaks reset, calls, on_cuda_init's
        self.recording = False  # gpumagic's or pytest_cuda's recording
        self.user_recording = self.user_events = False  # the user's, with events or not
        self.empty_cache_calls = self.history_starts = 0
        self.user_max_entries, self.history_settings = 1_000_000, {}
        self.workspaces, self.fft_plans = {}, {}  # cuBLAS's and cuFFT's, by device
        self.compiled, self.awaiting = [], []  # torch.compile's; freed, awaiting a stream

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
        """The machine and this allocator, whatever ``CUDA_VISIBLE_DEVICES`` said."""
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        self.machine.install(monkeypatch)
        install(
            monkeypatch,
            self,
            is_initialized=lambda: self.initialized,
            visible_device_total=lambda: len(self.devices) if self.initialized else 0,
            devices_with_context=lambda: tuple(d.index for d in self.devices if self.initialized),
            allocator_backend=lambda: "native" if self.initialized else None,
            device_total_memory=lambda i: 140 * GiB if self.initialized else None,
            memory_history_enabled=lambda: self.recording or self.user_recording,
            async_error=lambda: None,  # the made-up GPU never has an asynchronous error
            synchronize=lambda devices=None: None,  # nothing is ever queued on it
            release_cached_blocks=lambda devices: self.awaiting.clear(),
            # The checker imports torch before the first test, for work queued on CUDA's
            # initialisation: this allocator queues it (on_cuda_init) without torch, and
            # a planted subprocess or xdist worker saves the 1.6 s of CPU torch costs.
            start_torch=lambda: None,
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
        address, self.next_address = self.next_address, self.next_address + size + 512
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
            self.freed[device] += size
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
        settings = self.history_settings
        if self.recording and settings["events"] and action not in settings["skip_actions"]:
            limit = settings["max_entries"]
        elif not self.recording and self.user_recording and self.user_events:
            limit = self.user_max_entries
        else:
            return
        ring = self.events[device]
        ring.append({"action": action, "addr": addr, "size": size, "frames": frames})
        ring[-1]["time_us"] = time.time_ns() // 1000
        del ring[:-limit]

    # -- the seam ----------------------------------------------------------------------

    def allocated_bytes(self) -> dict[int, int]:
        if not self.initialized:
            return {}
        return {d: self.counters[d]["allocated"] for d in range(len(self.devices))}

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
        self.workspaces.clear()
        return self.initialized

    def clear_fft_plan_caches(self, devices: tuple[int, ...]) -> bool:
        return bool([self.fft_plans.pop(d) for d in devices if d in self.fft_plans])

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
        self, max_entries: int, *, events: bool = False, event_stacks: bool = True, skip_actions=()
    ) -> bool:
        self.calls.append(f"start_memory_history({max_entries}, events={events})")
        assert 0 < max_entries < 1_000_000, "the ring buffer must be bounded"
        self.init()
        if self.recording or self.user_recording:
            return False
        self.history_starts += 1
        settings = {"max_entries": max_entries, "events": events, "skip_actions": skip_actions}
        self.history_settings, self.recording = settings, True
        return True

    def stop_memory_history(self) -> None:
        self.calls.append("stop_memory_history")
        assert self.recording, "stopped a recording nobody started"
        self.recording = False
        self.events = [[] for _ in self.events]  # emptied, as torch does when recording stops

    def memory_snapshot(self) -> dict[str, Any]:
        segments = []
        for address, b in sorted(self.blocks.items()):
            active = {"address": address, "size": b["size"], "requested_size": b["requested"]}
            active |= {"state": "active_allocated", "frames": b["frames"]}
            rest = {"address": address + b["size"], "size": 512, "state": "inactive"}
            segments.append({"device": b["device"], "address": address, "blocks": [active, rest]})
        return {"segments": segments, "device_traces": [list(ring) for ring in self.events]}

    def tensors_among(self, objects: Any) -> list[object]:
        return [o for o in objects if self.tensor_facts(o) is not None]

    def tensor_facts(self, obj: object) -> cuda.TensorFacts | None:
        """A FakeTensor's facts, but not an earlier planted run's (another process's)."""
        if type(obj) is not FakeTensor or obj.owner is not self:
            return None
        device = f"cuda:{obj.device}"
        return cuda.TensorFacts((device, obj.address), obj.size, device, (obj.size,), "uint8")

    def allocation_marks(self, device: int) -> tuple[int, int, int, int]:
        c, freed = self.counters[device], self.freed[device]
        return c["allocated"], c["peak_allocated"], c["allocated"] + freed, freed

    def _own(self, device: int) -> int | None:
        """This process's use of ``device`` as NVML sees it: context and reserved blocks."""
        if not self.initialized or device not in self.touched:
            return None
        return self.context + self.counters[device]["reserved"]
