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

    #: The process id.
    pid: int
    #: Bytes NVML charges to the process on this device; ``None`` where the driver does not
    #: say.
    used: int | None
    #: Whether it is this process (the IPython kernel).
    is_self: bool = False


@dataclass(frozen=True)
class PeakReset:
    """gpumagic reset a device's peak counters (to measure a cell's peak exactly)."""

    #: The device's index.
    device: int
    #: The cell or call that reset the counters, as the output names it.
    label: str
    #: torch's peak allocated bytes on the device before the reset.
    peak_before: int


@dataclass(frozen=True)
class DeviceMemory:
    """Everything ``%gpumem`` knows about one device. ``None``: not known here."""

    #: The device's index among the visible devices (``cuda:<index>``).
    index: int
    #: The device's name, as NVML or torch gives it.
    name: str
    #: The device's memory in bytes.
    total: int | None
    #: Whether torch had initialised CUDA in this process (otherwise the allocator's figures
    #: are ``None`` and nothing was initialised to read them).
    torch_initialized: bool
    #: Bytes torch's caching allocator has handed to live tensors
    #: (``torch.cuda.memory_allocated``).
    allocated: int | None = None
    #: Bytes torch's caching allocator holds from the driver, in use or cached
    #: (``torch.cuda.memory_reserved``).
    reserved: int | None = None
    #: The highest ``allocated`` since the counters were last reset.
    peak_allocated: int | None = None
    #: The highest ``reserved`` since the counters were last reset.
    peak_reserved: int | None = None
    #: Bytes the live tensors asked for, before the allocator rounded each block up.
    requested: int | None = None
    #: Device-wide memory in use, every process included, per NVML.
    device_used: int | None = None
    #: Device-wide free memory per NVML.
    device_free: int | None = None
    #: Memory the driver keeps for itself per NVML, when it says.
    driver_reserved: int | None = None
    #: The processes NVML lists on the device; ``None`` where it cannot list them.
    processes: tuple[ProcessMemory, ...] | None = None
    #: This process's id (to find it in ``processes``).
    pid: int = 0
    #: What is approximate or missing for this device, and why (one sentence each).
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

    #: The device's index.
    index: int
    #: Bytes of tensors ``gc.collect()`` freed (``--gc``).
    gc_freed: int | None = None
    #: Bytes ``torch.cuda.empty_cache()`` gave back to the driver (``--empty-cache``).
    cache_released: int | None = None
    #: How much less this process holds on the device per NVML afterwards.
    process_released: int | None = None


@dataclass(frozen=True)
class MemoryReport:
    """``%gpumem``: the devices, optionally who holds the memory and what was released."""

    #: The one-line summary the output starts with.
    summary: str
    #: One entry per device shown.
    devices: tuple[DeviceMemory, ...] = ()
    #: With ``--top``: the live CUDA tensors and the names that reach them.
    scan: HolderScan | None = None
    #: How many of the largest holders to show (``--top``; 0: none).
    top: int = 0
    #: With ``--top``: per device, (index, bytes allocated that no name reaches: autograd
    #: graphs, closures, library workspaces, caches).
    unreachable: tuple[tuple[int, int], ...] = ()
    #: With ``--gc`` or ``--empty-cache``: what each device gave back.
    released: tuple[Released, ...] = ()
    #: With ``--gc``: how many objects ``gc.collect()`` collected.
    gc_objects: int | None = None
    #: The devices whose peak counters gpumagic reset, and when.
    peak_resets: tuple[PeakReset, ...] = ()
    #: What the report could not read, or reads approximately, and why.
    notes: tuple[str, ...] = ()
    #: Why no device could be read (no CUDA build, no driver), else ``None``.
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
