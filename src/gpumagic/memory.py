"""Where the GPU memory went: the device figures behind ``%gpumem``.

No IPython here. This module reads the figures through :mod:`gpumagic.cuda` (which
never creates a CUDA context for them) and builds a per-device ladder that explains
the gap between torch's numbers and nvidia-smi's: allocated by tensors + cached by
torch's allocator (= reserved) + CUDA context and libraries (= this process, as NVML
counts it) + other processes + memory no process is charged with (= device used).

Beside it: who holds the memory (:mod:`gpumagic.memory_holders`), one cell's change
(:mod:`gpumagic.memory_cell`), and the rendering (:mod:`gpumagic.memory_text` for
terminals, :mod:`gpumagic.memory_result` for HTML).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpumagic import cuda
from gpumagic.memory_holders import HolderScan, find_holders

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from gpumagic.devices import DeviceInfo

__all__ = [
    "CONTEXT_NOTE",
    "DeviceMemory",
    "MemoryReport",
    "PeakReset",
    "ProcessMemory",
    "Released",
    "read_devices",
    "read_report",
]

CONTEXT_NOTE = "a CUDA context takes about 0.5 GiB per device"


# ---------------------------------------------------------------------------
# Figures


@dataclass(frozen=True)
class ProcessMemory:
    """One process on a device as NVML reports it; ``used`` is ``None`` where the
    driver does not say (MIG, Windows WDDM)."""

    pid: int
    used: int | None
    is_self: bool = False


@dataclass(frozen=True)
class PeakReset:
    """gpumagic reset a device's peak counters (to measure a cell's peak exactly)."""

    device: int
    label: str
    peak_before: int


@dataclass(frozen=True)
class DeviceMemory:
    """Everything ``%gpumem`` knows about one device. ``None``: not known here."""

    index: int
    name: str
    total: int | None
    torch_initialized: bool
    allocated: int | None = None
    reserved: int | None = None
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    requested: int | None = None
    device_used: int | None = None
    device_free: int | None = None
    driver_reserved: int | None = None
    processes: tuple[ProcessMemory, ...] | None = None
    pid: int = 0
    notes: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """``"cuda:0"``."""
        return f"cuda:{self.index}"

    @property
    def cached(self) -> int | None:
        """Reserved by torch's allocator but not used by any tensor."""
        if self.reserved is None or self.allocated is None:
            return None
        return max(0, self.reserved - self.allocated)

    @property
    def this_process(self) -> int | None:
        """This process's memory on the device per NVML (context included)."""
        if self.processes is None:
            return None
        own = [p.used for p in self.processes if p.is_self]
        return own[0] if own else None

    @property
    def self_listed(self) -> bool:
        """Whether NVML lists this process on the device at all."""
        return self.processes is not None and any(p.is_self for p in self.processes)

    @property
    def outside_allocator(self) -> int | None:
        """This process's memory beyond torch's reserved: CUDA context, cuBLAS/cuDNN
        workspaces, NCCL buffers, other libraries' allocations."""
        mine = self.this_process
        if mine is None:
            return None
        return max(0, mine - (self.reserved or 0))

    @property
    def others(self) -> tuple[ProcessMemory, ...]:
        """The other processes on the device."""
        return tuple(p for p in self.processes or () if not p.is_self)

    @property
    def others_used(self) -> int:
        """What the other processes hold, as far as the driver says."""
        return sum(p.used or 0 for p in self.others)

    @property
    def unattributed(self) -> int | None:
        """Device memory in use that NVML charges to no listed process."""
        if self.device_used is None or self.processes is None:
            return None
        return max(0, self.device_used - sum(p.used or 0 for p in self.processes))


@dataclass(frozen=True)
class Released:
    """What ``--gc`` / ``--empty-cache`` gave back on one device."""

    index: int
    gc_freed: int | None = None
    cache_released: int | None = None
    process_released: int | None = None


@dataclass(frozen=True)
class MemoryReport:
    """``%gpumem``: the devices, optionally who holds the memory and what was released."""

    summary: str
    devices: tuple[DeviceMemory, ...] = ()
    scan: HolderScan | None = None
    top: int = 0
    unreachable: tuple[tuple[int, int], ...] = ()
    released: tuple[Released, ...] = ()
    gc_objects: int | None = None
    peak_resets: tuple[PeakReset, ...] = ()
    notes: tuple[str, ...] = ()
    unavailable: str | None = None


# ---------------------------------------------------------------------------
# Reading the devices


def _processes(device: DeviceInfo, pid: int) -> tuple[tuple[ProcessMemory, ...] | None, str]:
    try:
        listed = cuda.nvml_processes(device)
    except cuda.CudaUnavailable as exc:
        return None, str(exc)
    return tuple(ProcessMemory(p, used, p == pid) for p, used in listed), ""


def read_devices(
    devices: Sequence[DeviceInfo], *, pid: int | None = None
) -> tuple[DeviceMemory, ...]:
    """Read each device: torch's counters (only once CUDA is initialised) and NVML's
    device-wide and per-process figures. Creates no CUDA context."""
    pid = os.getpid() if pid is None else pid
    initialized = cuda.is_initialized()
    backend = cuda.allocator_backend() if initialized else None
    found = []
    for device in devices:
        notes: list[str] = []
        fields: dict[str, Any] = {}
        if initialized:
            counters = cuda.allocator_stats(device.index)
            fields.update(
                allocated=counters.allocated,
                reserved=counters.reserved,
                peak_allocated=counters.peak_allocated,
                peak_reserved=counters.peak_reserved,
                requested=counters.requested,
            )
            if backend == "cudaMallocAsync":
                notes.append(
                    "torch uses the cudaMallocAsync allocator: its reserved and peak "
                    "figures are approximate"
                )
        total = device.total_memory or None
        try:
            nvml = cuda.nvml_memory_info(device)
            total = nvml.total
            fields.update(
                device_used=nvml.used, device_free=nvml.free, driver_reserved=nvml.driver_reserved
            )
        except cuda.CudaUnavailable as exc:
            notes.append(f"{exc}: no device-wide or per-process figures")
            if initialized:
                total = cuda.device_total_memory(device.index)
        else:
            processes, problem = _processes(device, pid)
            fields["processes"] = processes
            if processes is None:
                notes.append(f"{problem}: no per-process figures")
            elif any(p.used is None for p in processes):
                notes.append("the driver does not report per-process memory here (MIG or WDDM)")
            if processes is not None and initialized and not any(p.is_self for p in processes):
                notes.append(
                    f"NVML does not list this process (pid {pid}) on this device: inside a "
                    "container without --pid=host the driver knows it under another pid, "
                    "or this process has not touched this device yet"
                )
        found.append(
            DeviceMemory(
                index=device.index,
                name=device.name,
                total=total,
                torch_initialized=initialized,
                pid=pid,
                notes=tuple(notes),
                **fields,
            )
        )
    return tuple(found)


def read_report(
    devices: Sequence[DeviceInfo],
    *,
    summary: str,
    top: int = 0,
    roots: Iterable[tuple[str, object, bool]] = (),
    collect: bool = False,
    empty_cache: bool = False,
    peak_resets: Iterable[PeakReset] = (),
    pid: int | None = None,
) -> MemoryReport:
    """Everything ``%gpumem`` shows: optional ``gc.collect()`` and ``empty_cache()``
    (and what they released), the devices, and with ``top`` the largest holders."""
    released: list[Released] = []
    gc_objects = None
    notes: list[str] = []
    if collect or empty_cache:
        before = read_devices(devices, pid=pid)
        if collect:
            gc_objects = gc.collect()
        middle = read_devices(devices, pid=pid) if collect else before
        if empty_cache:
            if cuda.is_initialized():
                cuda.empty_cache()
            else:
                notes.append("--empty-cache: nothing to release, CUDA is not initialised")
        after = read_devices(devices, pid=pid)
        for b, m, a in zip(before, middle, after, strict=True):
            released.append(_released(b, m, a, collect=collect, empty_cache=empty_cache))
        states = after
    else:
        states = read_devices(devices, pid=pid)
    scan = None
    unreachable: list[tuple[int, int]] = []
    if top:
        wanted = {d.label for d in states}
        scan = find_holders(roots, keep=lambda f: f.device in wanted)
        for state in states:
            if state.allocated is None:
                continue
            counted = state.requested or state.allocated
            unreachable.append((state.index, max(0, counted - scan.reachable(state.label))))
    shown = {d.index for d in states}
    return MemoryReport(
        summary=summary,
        devices=states,
        scan=scan,
        top=top,
        unreachable=tuple(unreachable),
        released=tuple(released),
        gc_objects=gc_objects,
        peak_resets=tuple(r for r in peak_resets if r.device in shown),
        notes=tuple(notes),
    )


def _released(
    before: DeviceMemory,
    middle: DeviceMemory,
    after: DeviceMemory,
    *,
    collect: bool,
    empty_cache: bool,
) -> Released:
    def drop(a: int | None, b: int | None) -> int | None:
        return None if a is None or b is None else a - b

    return Released(
        index=after.index,
        gc_freed=drop(before.allocated, middle.allocated) if collect else None,
        cache_released=drop(middle.reserved, after.reserved) if empty_cache else None,
        process_released=drop(before.this_process, after.this_process),
    )
