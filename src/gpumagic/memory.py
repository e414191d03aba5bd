"""Where the GPU memory went: the core of ``%gpumem`` and ``%%gpumem``.

No IPython here. This module reads the figures through :mod:`gpumagic.cuda` (which
never creates a CUDA context for them), and holds the logic that makes them mean
something:

* a per-device ladder that explains the gap between torch's numbers and nvidia-smi's:
  allocated by tensors + cached by torch's allocator (= reserved) + CUDA context and
  libraries (= this process, as NVML counts it) + other processes + memory no process
  is charged with (= device used);
* who holds the memory: a walk from the user's names to the live CUDA tensors they
  reach (``x``, ``model.layer1.weight.grad``, ``opt.state[model.fc.weight]['exp_avg']``),
  counting each storage once, and the total that no name reaches;
* per-cell change: allocated delta, the exact peak from the allocator's own counter
  (reset only when the user's earlier peak would hide the cell's, and then said so),
  reserved growth;
* the lines that allocated what is still alive after a cell, from the allocator's
  recorded allocation stacks;
* aligned text for terminals (HTML lives in :mod:`gpumagic.memory_result`).
"""

from __future__ import annotations

import collections
import gc
import os
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpumagic import cuda

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence

    from gpumagic.devices import DeviceInfo

__all__ = [
    "CellDeviceChange",
    "CellMemoryReport",
    "CellMeter",
    "Counters",
    "DeviceMemory",
    "Holder",
    "HolderScan",
    "MemoryReport",
    "PeakReset",
    "ProcessMemory",
    "Released",
    "TraceLine",
    "cell_peak",
    "find_holders",
    "group_live_blocks",
    "namespace_roots",
    "read_devices",
    "read_report",
    "select_devices",
]

# Every allocation stack recorded by ``%%gpumem --trace`` costs host memory; the
# allocator's event ring buffer is kept this small.
TRACE_MAX_ENTRIES = 10_000
# The namespace walk stops after this many objects and says so.
WALK_MAX_OBJECTS = 200_000
WALK_MAX_DEPTH = 24
CONTEXT_NOTE = "a CUDA context takes about 0.5 GiB per device"


# ---------------------------------------------------------------------------
# Figures


@dataclass(frozen=True)
class Counters:
    """The caching allocator's counters of one device at one moment, in bytes."""

    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    requested: int = 0

    @classmethod
    def read(cls, device: int) -> Counters:
        """Read them through the seam (zeros, without a context, before CUDA is used)."""
        raw = cuda.allocator_counters(device)
        return cls(
            allocated=raw["allocated"],
            reserved=raw["reserved"],
            peak_allocated=raw["peak_allocated"],
            peak_reserved=raw["peak_reserved"],
            requested=raw["requested"],
        )


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
class Holder:
    """One live storage and the names that reach it (views of it included)."""

    names: tuple[str, ...]
    nbytes: int
    device: str
    shape: tuple[int, ...]
    dtype: str
    tensors: int = 1
    more_names: int = 0


@dataclass(frozen=True)
class HolderScan:
    """The result of walking the user's names: storages, largest first."""

    holders: tuple[Holder, ...]
    visited: int
    truncated: bool

    def reachable(self, device: str) -> int:
        """Bytes of the storages on ``device`` that some name reaches."""
        return sum(h.nbytes for h in self.holders if h.device == device)


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


def select_devices(devices: Sequence[DeviceInfo], spec: str | None) -> tuple[DeviceInfo, ...]:
    """The devices ``--device`` names (``1``, ``cuda:1``, ``0,1``, ``all``; default all).

    Raises :class:`ValueError` naming the visible devices when ``spec`` names another.
    """
    if spec is None or spec.strip().lower() in ("", "all"):
        return tuple(devices)
    visible = ", ".join(f"cuda:{d.index}" for d in devices) or "none"
    chosen: list[DeviceInfo] = []
    for token in spec.split(","):
        text = token.strip().lower().removeprefix("cuda:")
        if not text.isdigit():
            raise ValueError(
                f"--device {spec!r}: use an index such as 0 or cuda:0 (visible: {visible})"
            )
        index = int(text)
        found = next((d for d in devices if d.index == index), None)
        if found is None:
            raise ValueError(
                f"--device {spec!r}: there is no cuda:{index} here (visible: {visible})"
            )
        if found not in chosen:
            chosen.append(found)
    return tuple(chosen)


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
            counters = Counters.read(device.index)
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
            total, used, free, driver_reserved = cuda.nvml_memory_info(device)
            fields.update(device_used=used, device_free=free, driver_reserved=driver_reserved)
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


# ---------------------------------------------------------------------------
# Who holds it: from the user's names to the live tensors


class _KeyRef:
    """A dict key that is an object (an optimizer's state is keyed by parameters):
    rendered with that object's own name once the walk is done."""

    __slots__ = ("fallback", "oid")

    def __init__(self, oid: int, fallback: str) -> None:
        self.oid = oid
        self.fallback = fallback


_Step = str | _KeyRef
_ATOMIC = (str, bytes, bytearray, int, float, complex, bool, type(None), range, memoryview)
_OPAQUE = (
    types.ModuleType,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.CodeType,
    types.FrameType,
    types.GeneratorType,
    types.CoroutineType,
    property,
    staticmethod,
    classmethod,
)
_SKIPPED: tuple[type, ...] = (*_ATOMIC, *_OPAQUE)
# nn.Module bookkeeping that is walked specially or holds no tensors.
_MODULE_SPECIAL = frozenset({"_parameters", "_buffers", "_modules", "training"})


def _instance_dict(obj: object) -> dict[str, Any] | None:
    try:
        found = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return None
    return found if isinstance(found, dict) else None


def _attr_step(name: str) -> str:
    if name.isidentifier():
        return f".{name}"
    if name.isdigit():
        return f"[{name}]"
    return f"[{name!r}]"


def _key_step(key: object, facts: Callable[[object], cuda.TensorFacts | None]) -> _Step:
    if isinstance(key, str | int | float | bool | type(None)):
        return f"[{key!r}]"
    if isinstance(key, tuple) and all(isinstance(k, str | int | float | bool) for k in key):
        text = repr(key)
        return f"[{text}]" if len(text) <= 40 else "[(...)]"
    if facts(key) is not None:
        return _KeyRef(id(key), f"<{type(key).__name__}>")
    return f"[<{type(key).__name__}>]"


def _children(
    obj: object, facts: Callable[[object], cuda.TensorFacts | None]
) -> Iterable[tuple[_Step, object, bool]]:
    """``(step, child, low_priority)`` for the places a tensor can hide in ``obj``."""
    if isinstance(obj, dict):
        for key, value in list(obj.items()):
            yield _key_step(key, facts), value, False
        return
    if isinstance(obj, list | tuple | collections.deque):
        fields = getattr(type(obj), "_fields", None)
        if isinstance(obj, tuple) and isinstance(fields, tuple):
            for name, value in zip(fields, obj, strict=False):
                yield f".{name}", value, False
            return
        for i, value in enumerate(list(obj)):
            yield f"[{i}]", value, False
        return
    attrs = _instance_dict(obj)
    if attrs is None:
        return
    parameters, modules = attrs.get("_parameters"), attrs.get("_modules")
    if isinstance(parameters, dict) and isinstance(modules, dict):
        # A torch.nn.Module: parameters, buffers and submodules under their
        # attribute paths (model.layer1.weight, model[0].bias), like named_parameters().
        for group in ("_parameters", "_buffers", "_modules"):
            members = attrs.get(group)
            if isinstance(members, dict):
                for name, value in list(members.items()):
                    if value is not None:
                        yield _attr_step(str(name)), value, False
        for name, value in list(attrs.items()):
            if name not in _MODULE_SPECIAL and "hook" not in name:
                yield _attr_step(name), value, False
        return
    optimizer = isinstance(attrs.get("state"), dict) and isinstance(attrs.get("param_groups"), list)
    for name, value in list(attrs.items()):
        # An optimizer's param_groups list the parameters again; their names should
        # come from the model, so that path is taken last.
        yield _attr_step(name), value, optimizer and name == "param_groups"


def namespace_roots(
    namespace: Mapping[str, object], hidden: Iterable[str] = ()
) -> list[tuple[str, object, bool]]:
    """The roots of the walk: ``(name, object, low_priority)`` for the user's names.

    IPython's own names (``hidden``) and dunders are left out, except the output
    history ``Out`` (it keeps displayed tensors alive); it and ``_``-prefixed names are
    walked last, so that ``x`` wins over ``Out[3]`` and ``_3``.
    """
    skip = set(hidden) - {"Out"}
    roots = []
    for name, value in list(namespace.items()):
        if name in skip or (name.startswith("__") and name.endswith("__")):
            continue
        roots.append((name, value, name.startswith("_") or name == "Out"))
    return roots


def find_holders(
    roots: Iterable[tuple[str, object, bool]],
    *,
    keep: Callable[[cuda.TensorFacts], bool],
    facts: Callable[[object], cuda.TensorFacts | None] | None = None,
    max_objects: int = WALK_MAX_OBJECTS,
    max_names: int = 4,
) -> HolderScan:
    """Walk breadth-first from ``roots`` to every tensor they reach; group by storage.

    Each object is named by the first (shortest) path that reaches it, low-priority
    roots and edges last. Attributes, dict items (keys of any hashable type; a tensor
    key by its own name), list/tuple items, nn.Module parameters, buffers and
    submodules, and a tensor's ``.grad`` are followed; functions, classes and modules
    are not (what only they reach counts as unreachable). ``facts`` tells tensors
    apart (default: :func:`gpumagic.cuda.tensor_facts`).
    """
    walk = _Walk(facts or cuda.tensor_facts, max_names)
    walk.run(roots, max_objects)
    return walk.scan(keep)


class _Walk:
    """The state of one :func:`find_holders` walk."""

    def __init__(self, facts: Callable[[object], cuda.TensorFacts | None], max_names: int) -> None:
        self.facts = facts
        self.max_names = max_names
        self.first: dict[int, tuple[int | None, _Step]] = {}
        self.aliases: dict[int, list[tuple[int | None, _Step, bool]]] = {}
        self.low: set[int] = set()  # objects first reached by a low-priority path
        self.alive: list[object] = []  # keeps every id() valid until names are rendered
        self.tensors: dict[int, cuda.TensorFacts] = {}
        self.queues: tuple[collections.deque[tuple[object, int]], ...] = (
            collections.deque(),
            collections.deque(),
        )
        self.visited = 0
        self.truncated = False
        self.names: dict[int, str] = {}
        self.pending: set[int] = set()

    def discover(self, obj: object, parent: int | None, step: _Step, depth: int, low: bool) -> None:
        oid = id(obj)
        if oid in self.first:
            others = self.aliases.setdefault(oid, [])
            if len(others) < self.max_names * 2:
                others.append((parent, step, low))
            return
        if isinstance(obj, _SKIPPED):
            return
        self.first[oid] = (parent, step)
        if low:
            self.low.add(oid)
        self.alive.append(obj)
        self.queues[1 if low else 0].append((obj, depth))

    def run(self, roots: Iterable[tuple[str, object, bool]], max_objects: int) -> None:
        ordered = sorted(roots, key=lambda r: r[2])  # a name the user typed names first
        for root, obj, low in ordered:
            self.discover(obj, None, root, 0, low)
        while self.queues[0] or self.queues[1]:
            low = not self.queues[0]
            obj, depth = self.queues[1 if low else 0].popleft()
            if self.visited >= max_objects:
                self.truncated = True
                return
            self.visited += 1
            found = self.facts(obj)
            if found is not None:
                self.tensors[id(obj)] = found
                if found.grad is not None:
                    self.discover(found.grad, id(obj), ".grad", depth + 1, low)
                continue
            if depth >= WALK_MAX_DEPTH:
                continue
            try:
                children = list(_children(obj, self.facts))
            except Exception:  # a user object whose introspection fails
                continue
            for step, child, low_edge in children:
                self.discover(child, id(obj), step, depth + 1, low or low_edge)

    def path(self, parent: int | None, step: _Step) -> str:
        prefix = "" if parent is None else self.name(parent)
        if isinstance(step, _KeyRef):
            known = step.oid in self.first and step.oid not in self.pending
            return f"{prefix}[{self.name(step.oid) if known else step.fallback}]"
        return prefix + step

    def name(self, oid: int) -> str:
        if oid not in self.names:
            self.pending.add(oid)
            self.names[oid] = self.path(*self.first[oid])
            self.pending.discard(oid)
        return self.names[oid]

    def scan(self, keep: Callable[[cuda.TensorFacts], bool]) -> HolderScan:
        by_storage: dict[tuple[str, int], list[int]] = {}
        for oid, found in self.tensors.items():
            if keep(found) and found.nbytes > 0:
                by_storage.setdefault(found.storage, []).append(oid)
        holders = [self.holder(oids) for oids in by_storage.values()]
        holders.sort(key=lambda h: (-h.nbytes, _name_rank(h.names[0])))
        self.alive.clear()
        return HolderScan(holders=tuple(holders), visited=self.visited, truncated=self.truncated)

    def holder(self, oids: list[int]) -> Holder:
        # The tensor with the most elements (the base, not a view) leads the row.
        oids.sort(
            key=lambda o: (
                -_numel(self.tensors[o].shape),
                self.tensors[o].view,
                o in self.low,
                _name_rank(self.name(o)),
            )
        )
        # Names through the output history or an optimizer's param_groups are shown
        # only when nothing the user named reaches the storage.
        found = [(self.name(oid), oid in self.low) for oid in oids]
        found += [(self.path(p, s), low) for oid in oids for p, s, low in self.aliases.get(oid, ())]
        wanted = any(not low for _, low in found)
        names = list(dict.fromkeys(name for name, low in found if not (wanted and low)))
        if wanted:  # the first (shortest) path the user named leads
            unique = [names[0], *sorted(names[1:], key=_name_rank)]
        else:
            unique = sorted(names, key=_name_rank)
        facts = self.tensors[oids[0]]
        return Holder(
            names=tuple(unique[: self.max_names]),
            nbytes=facts.nbytes,
            device=facts.device,
            shape=facts.shape,
            dtype=facts.dtype,
            tensors=len(oids),
            more_names=max(0, len(unique) - self.max_names),
        )


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def _name_rank(name: str) -> tuple[int, int, str]:
    """Names people typed first, then ``Out[N]``, then ``_``-names; short before long."""
    group = 2 if name.startswith("_") else 1 if name.startswith("Out[") else 0
    return (group, len(name), name)


# ---------------------------------------------------------------------------
# One cell: delta, exact peak, reserved growth, and the lines behind what is left


def cell_peak(start: Counters, end: Counters, *, reset: bool) -> tuple[int | None, int | None]:
    """``(peak, upper_bound)`` of allocated memory during a cell.

    The allocator's peak counter is monotone since its last reset. It gives the cell's
    exact peak when it was reset at the cell's start, when it was not above the
    allocated memory then, or when the cell set a new high. Otherwise only an upper
    bound (the user's earlier peak) is known, and ``peak`` is ``None``.
    """
    if reset or start.peak_allocated <= start.allocated:
        return end.peak_allocated, None
    if end.peak_allocated > start.peak_allocated:
        return end.peak_allocated, None
    return None, start.peak_allocated


@dataclass(frozen=True)
class CellDeviceChange:
    """What one cell did to one device's memory."""

    index: int
    name: str
    start: Counters
    end: Counters
    peak: int | None
    peak_upper: int | None = None
    reset: PeakReset | None = None
    process_start: int | None = None
    process_end: int | None = None

    @property
    def label(self) -> str:
        """``"cuda:0"``."""
        return f"cuda:{self.index}"

    @property
    def allocated_delta(self) -> int:
        """Change in memory allocated by tensors."""
        return self.end.allocated - self.start.allocated

    @property
    def reserved_delta(self) -> int:
        """Growth of torch's cache (cudaMalloc'd segments)."""
        return self.end.reserved - self.start.reserved

    @property
    def peak_above_start(self) -> int | None:
        """How far the peak rose above the allocated memory at the start."""
        return None if self.peak is None else max(0, self.peak - self.start.allocated)

    @property
    def process_delta(self) -> int | None:
        """Change of this process's memory on the device per NVML."""
        if self.process_end is None:
            return None
        return self.process_end - (self.process_start or 0)

    @property
    def changed(self) -> bool:
        """Whether the cell did anything on this device."""
        return bool(
            self.allocated_delta
            or self.reserved_delta
            or (self.peak_above_start or 0)
            or (self.process_delta or 0)
        )


@dataclass(frozen=True)
class TraceLine:
    """Memory still allocated after the cell, charged to the line that allocated it."""

    where: str
    filename: str
    line: int
    function: str
    source: str
    nbytes: int
    blocks: int
    devices: tuple[int, ...]
    via: str = ""


@dataclass(frozen=True)
class CellMemoryReport:
    """``%%gpumem`` and ``%gpumem watch``: one cell's effect on GPU memory."""

    label: str
    changes: tuple[CellDeviceChange, ...] = ()
    trace: tuple[TraceLine, ...] | None = None
    initialized_by_cell: bool = False
    notes: tuple[str, ...] = ()
    unavailable: str | None = None

    @property
    def shown(self) -> tuple[CellDeviceChange, ...]:
        """The devices the cell changed (the first device when it changed none)."""
        changed = tuple(c for c in self.changes if c.changed)
        return changed or self.changes[:1]


@dataclass
class CellMeter:
    """Measures one cell: call :meth:`start` before it runs and :meth:`finish` after.

    Peaks come from the allocator's counter. If the user's earlier peak is above the
    memory allocated at the cell's start it would hide the cell's peak, so the counter
    is reset then (the report says so and keeps the peak from before) unless
    ``keep_peak``, which reports an upper bound instead. With ``trace``, allocation
    stacks are recorded during the cell and switched off again afterwards (when the
    user was already recording, their settings are left alone).
    """

    devices: tuple[DeviceInfo, ...]
    label: str
    keep_peak: bool = False
    trace: bool = False
    pid: int = field(default_factory=os.getpid)
    _start: dict[int, Counters] = field(default_factory=dict)
    _process: dict[int, int | None] = field(default_factory=dict)
    _resets: dict[int, int] = field(default_factory=dict)  # device: peak before the reset
    _initialized: bool = False
    _recording: bool = False
    _user_recording: bool = False
    _notes: list[str] = field(default_factory=list)

    def start(self) -> None:
        """Read the counters (and reset peaks where needed) just before the cell."""
        self._initialized = cuda.is_initialized()
        if self.trace:
            self._start_trace()
        for device in self.devices:
            counters = Counters.read(device.index)
            self._process[device.index] = self._own_process(device)
            if not self.keep_peak and counters.peak_allocated > counters.allocated:
                cuda.reset_peak_memory_stats(device.index)
                self._resets[device.index] = counters.peak_allocated
            self._start[device.index] = counters

    def _start_trace(self) -> None:
        try:
            self._recording = cuda.start_memory_history(TRACE_MAX_ENTRIES)
        except (RuntimeError, cuda.CudaUnavailable) as exc:
            self.trace = False
            self._notes.append(f"--trace is unavailable here: {exc}")
            return
        self._user_recording = not self._recording
        if self._user_recording:
            self._notes.append(
                "allocation stacks were already being recorded; your "
                "_record_memory_history settings were kept"
            )
        if not self._initialized and cuda.is_initialized():
            self._initialized = True
            self._notes.append(
                "--trace initialised CUDA before the cell ran (recording needs torch's allocator)"
            )

    def _own_process(self, device: DeviceInfo) -> int | None:
        try:
            listed = cuda.nvml_processes(device)
        except cuda.CudaUnavailable:
            return None
        return next((used for pid, used in listed if pid == self.pid), None)

    def finish(
        self,
        *,
        cell_files: frozenset[str] = frozenset(),
        is_library: Callable[[str], bool] = lambda filename: False,
        where: Callable[[str, int], str] = lambda filename, line: f"{filename}:{line}",
        source: Callable[[str, int], str] = lambda filename, line: "",
    ) -> CellMemoryReport:
        """Read the counters after the cell; with ``trace`` group what is still
        allocated by line (``cell_files``: the cell's own source files)."""
        trace: tuple[TraceLine, ...] | None = None
        notes = list(self._notes)
        try:
            if self.trace:
                segments = cuda.memory_snapshot_segments()
                trace = group_live_blocks(
                    segments,
                    devices={d.index for d in self.devices},
                    cell_files=cell_files,
                    only_cell=self._user_recording,
                    is_library=is_library,
                    where=where,
                    source=source,
                )
        finally:
            if self._recording:
                cuda.stop_memory_history()
        changes = []
        for device in self.devices:
            start = self._start[device.index]
            end = Counters.read(device.index)
            before = self._resets.get(device.index)
            reset = None if before is None else PeakReset(device.index, self.label, before)
            peak, upper = cell_peak(start, end, reset=reset is not None)
            if peak is not None and peak < start.allocated:
                notes.append(
                    f"cuda:{device.index}: the peak counter was reset during the cell; "
                    "the peak covers the time since"
                )
            changes.append(
                CellDeviceChange(
                    index=device.index,
                    name=device.name,
                    start=start,
                    end=end,
                    peak=peak,
                    peak_upper=upper,
                    reset=reset,
                    process_start=self._process[device.index],
                    process_end=self._own_process(device),
                )
            )
        initialized_by_cell = not self._initialized and cuda.is_initialized()
        return CellMemoryReport(
            label=self.label,
            changes=tuple(changes),
            trace=trace,
            initialized_by_cell=initialized_by_cell,
            notes=tuple(notes),
        )

    @property
    def resets(self) -> tuple[PeakReset, ...]:
        """The peak resets :meth:`start` made."""
        return tuple(PeakReset(d, self.label, before) for d, before in self._resets.items())


def _is_python_frame(frame: Mapping[str, Any]) -> bool:
    filename = str(frame.get("filename", ""))
    return filename.endswith((".py", ".pyw", ".ipy")) or (
        filename.startswith("<") and filename.endswith(">")
    )


def group_live_blocks(
    segments: Iterable[Mapping[str, Any]],
    *,
    devices: set[int] | None = None,
    cell_files: frozenset[str] = frozenset(),
    only_cell: bool = False,
    is_library: Callable[[str], bool] = lambda filename: False,
    where: Callable[[str, int], str] = lambda filename, line: f"{filename}:{line}",
    source: Callable[[str, int], str] = lambda filename, line: "",
) -> tuple[TraceLine, ...]:
    """Group the live blocks of an allocator snapshot by the line that allocated them.

    A block's stack (innermost frame first) is charged to its innermost frame outside
    library code (torch, IPython, the standard library, gpumagic): the user's line that
    called into torch. Blocks without a stack were allocated before recording started
    and are left out; with ``only_cell`` so are blocks whose stack does not pass
    through ``cell_files``. ``via`` names the cell line that led there when the
    allocating line is elsewhere (a function defined in another cell or a module).
    """
    groups: dict[tuple[str, int], dict[str, Any]] = {}
    for segment in segments:
        device = int(segment.get("device", 0))
        if devices is not None and device not in devices:
            continue
        for block in segment.get("blocks", ()):
            # C++ frames are there when the user records with stacks="all"; the
            # line to charge is a Python one.
            frames = [f for f in block.get("frames") or () if _is_python_frame(f)]
            if block.get("state") != "active_allocated" or not frames:
                continue
            files = [str(f.get("filename", "")) for f in frames]
            if only_cell and not cell_files.intersection(files):
                continue
            chosen = next((f for f in frames if not is_library(str(f.get("filename", "")))), None)
            if chosen is None:
                key = ("<library>", 0)
                via_frame = None
            else:
                key = (str(chosen["filename"]), int(chosen["line"]))
                via_frame = next(
                    (f for f in frames if str(f.get("filename", "")) in cell_files), None
                )
            entry = groups.setdefault(
                key,
                {
                    "function": str(chosen.get("name", "")) if chosen else "",
                    "nbytes": 0,
                    "blocks": 0,
                    "devices": set(),
                    "via": "",
                },
            )
            entry["nbytes"] += int(block.get("size", 0))
            entry["blocks"] += 1
            entry["devices"].add(device)
            if via_frame is not None and via_frame is not chosen and not entry["via"]:
                entry["via"] = where(str(via_frame["filename"]), int(via_frame["line"]))
    lines = []
    for (filename, line), entry in groups.items():
        library = filename == "<library>"
        lines.append(
            TraceLine(
                where="library code only" if library else where(filename, line),
                filename="" if library else filename,
                line=line,
                function=entry["function"],
                source="" if library else source(filename, line),
                nbytes=entry["nbytes"],
                blocks=entry["blocks"],
                devices=tuple(sorted(entry["devices"])),
                via=entry["via"],
            )
        )
    lines.sort(key=lambda t: (-t.nbytes, t.where))
    return tuple(lines)
