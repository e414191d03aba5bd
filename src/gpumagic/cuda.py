"""The one module that talks to torch's CUDA API and to NVML.

Everything else in gpumagic and pytest_cuda goes through these functions, so readers
know where CUDA is touched and tests can swap it in one place.

Rules kept here:

* Nothing is imported at module import: torch on first CUDA use, pynvml on first
  discovery.
* Discovery (:func:`status`, :func:`devices`, :func:`device_count`) never creates a CUDA
  context: it asks NVML, maps the boards through ``CUDA_VISIBLE_DEVICES`` and reads
  torch's version file instead of importing torch.
* Without CUDA (torch missing, a CPU-only build, no driver, every device hidden) the
  functions answer with a reason (:class:`CudaUnavailable`) instead of raising deep
  inside torch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from gpumagic.devices import (
    CudaStatus,
    DeviceInfo,
    parse_visible_devices,
    select_visible,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator
    from types import ModuleType

    import torch

__all__ = [
    "AllocatorStats",
    "CudaUnavailable",
    "allocator_stats",
    "device_count",
    "devices",
    "elapsed_ms",
    "is_initialized",
    "new_event",
    "nvml_device_memory",
    "nvml_process_memory",
    "require",
    "reset_status_cache",
    "status",
    "synchronize",
    "torch_module",
    "visible_devices",
]


class CudaUnavailable(RuntimeError):
    """CUDA work was asked for where none is possible; the message says why."""


# ---------------------------------------------------------------------------
# Discovery: no CUDA context, no torch import.


def _torch_version_file() -> dict[str, str | None]:
    """``torch/version.py``'s ``__version__`` and ``cuda`` without importing torch."""
    if "torch" in sys.modules:
        module = sys.modules["torch"]
        version = getattr(module, "version", None)
        return {
            "torch": getattr(module, "__version__", None),
            "cuda": getattr(version, "cuda", None),
        }
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return {"torch": None, "cuda": None}
    path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        text = path.read_text()
    except OSError:
        return {"torch": "unknown", "cuda": None}
    found: dict[str, str | None] = {"torch": "unknown", "cuda": None}
    for key, name in (("torch", "__version__"), ("cuda", "cuda")):
        match = re.search(rf"^{name}\s*(?::\s*\S+\s*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
        if match:
            found[key] = match.group(1)
    return found


@functools.cache
def _nvml() -> ModuleType | None:
    """pynvml, initialised once; ``None`` when the library or the driver is missing."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    return cast("ModuleType", pynvml)


def _as_str(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _nvml_physical_devices(nvml: ModuleType) -> list[DeviceInfo]:
    found = []
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        try:
            capability = tuple(nvml.nvmlDeviceGetCudaComputeCapability(handle))
        except nvml.NVMLError:
            capability = (0, 0)
        found.append(
            DeviceInfo(
                index=i,
                name=_as_str(nvml.nvmlDeviceGetName(handle)),
                total_memory=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
                capability=(int(capability[0]), int(capability[1])),
                uuid=_as_str(nvml.nvmlDeviceGetUUID(handle)),
                physical_index=i,
            )
        )
        found.extend(_nvml_mig_devices(nvml, handle, found[-1]))
    return found


def _nvml_mig_devices(nvml: ModuleType, handle: Any, parent: DeviceInfo) -> list[DeviceInfo]:
    """MIG instances of one board, so ``CUDA_VISIBLE_DEVICES=MIG-…`` can be resolved."""
    try:
        count = nvml.nvmlDeviceGetMaxMigDeviceCount(handle)
    except nvml.NVMLError:
        return []
    migs = []
    for j in range(count):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
        except nvml.NVMLError:
            continue
        migs.append(
            DeviceInfo(
                index=-1,
                name=_as_str(nvml.nvmlDeviceGetName(mig)),
                total_memory=int(nvml.nvmlDeviceGetMemoryInfo(mig).total),
                capability=parent.capability,
                uuid=_as_str(nvml.nvmlDeviceGetUUID(mig)),
                physical_index=None,
            )
        )
    return migs


def _status_now() -> CudaStatus:
    versions = _torch_version_file()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    common: dict[str, Any] = {
        "torch_version": versions["torch"],
        "cuda_version": versions["cuda"],
        "visible_devices_env": env,
    }
    if versions["torch"] is None:
        return CudaStatus(False, "torch is not installed", **common)
    if versions["cuda"] is None:
        return CudaStatus(
            False, f"torch {versions['torch']} was built without CUDA (a CPU-only build)", **common
        )
    nvml = _nvml()
    if nvml is None:
        return _status_from_torch(common)
    driver = _as_str(nvml.nvmlSystemGetDriverVersion())
    common["driver_version"] = driver
    physical = _nvml_physical_devices(nvml)
    boards = [d for d in physical if d.physical_index is not None]
    if not boards:
        return CudaStatus(False, "the NVIDIA driver reports no GPU", **common)
    # With the variable set, MIG instances are candidates too (``MIG-…`` ids).
    visible = select_visible(physical if env is not None else boards, parse_visible_devices(env))
    if not visible:
        return CudaStatus(
            False,
            f"CUDA_VISIBLE_DEVICES={env!r} hides all {len(boards)} GPU(s) of this machine",
            **common,
        )
    return CudaStatus(True, "", devices=tuple(visible), **common)


def _status_from_torch(common: dict[str, Any]) -> CudaStatus:
    """NVML is missing: ask torch (``device_count`` creates no context) for a count."""
    torch = torch_module()
    count = torch.cuda.device_count()
    if count == 0:
        return CudaStatus(False, "no NVIDIA driver or GPU was found", **common)
    placeholders = tuple(
        DeviceInfo(index=i, name="unknown (NVML unavailable)", total_memory=0, capability=(0, 0))
        for i in range(count)
    )
    return CudaStatus(True, "", devices=placeholders, **common)


_STATUS: CudaStatus | None = None
_STATUS_KEY: str | None = None


def status() -> CudaStatus:
    """Whether CUDA is usable here, the versions, and the visible devices.

    Creates no CUDA context and does not import torch. Cached until
    ``CUDA_VISIBLE_DEVICES`` changes or :func:`reset_status_cache` is called.
    """
    global _STATUS, _STATUS_KEY
    key = os.environ.get("CUDA_VISIBLE_DEVICES", "\0unset")
    if _STATUS is None or key != _STATUS_KEY:
        _STATUS, _STATUS_KEY = _status_now(), key
    return _STATUS


def reset_status_cache() -> None:
    """Forget the cached :func:`status` (tests and ``--cuda-devices`` use it)."""
    global _STATUS, _STATUS_KEY
    _STATUS, _STATUS_KEY = None, None


def devices() -> tuple[DeviceInfo, ...]:
    """The visible devices (empty without CUDA); no context is created."""
    return status().devices


def device_count() -> int:
    """How many devices this process may use; no context is created."""
    return len(status().devices)


def require() -> CudaStatus:
    """The status when CUDA is usable, else :class:`CudaUnavailable` with the reason."""
    current = status()
    if not current.available:
        raise CudaUnavailable(current.reason)
    return current


def is_initialized() -> bool:
    """Whether torch has created its CUDA context in this process.

    Never imports torch: if torch is not imported yet, no context can exist.
    """
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "cuda"):
        return False
    return bool(torch.cuda.is_initialized())


def torch_module() -> ModuleType:
    """``import torch``, at the moment CUDA work is asked for."""
    import torch

    return torch


# ---------------------------------------------------------------------------
# Work on the device: these may create a context, and only run when asked to.


def _index(device: int | str | torch.device | None) -> int:
    torch = torch_module()
    if device is None:
        return int(torch.cuda.current_device())
    if isinstance(device, int):
        return device
    parsed = torch.device(device)
    if parsed.type != "cuda":
        raise ValueError(f"not a CUDA device: {device!r}")
    return int(parsed.index) if parsed.index is not None else int(torch.cuda.current_device())


def synchronize(devices: Iterable[int | str | torch.device] | int | None = None) -> None:
    """Wait for all work queued on ``devices`` (default: the current device)."""
    torch = torch_module()
    if devices is None or isinstance(devices, int):
        torch.cuda.synchronize(devices)
        return
    for device in devices:
        torch.cuda.synchronize(_index(device))


def new_event(*, timing: bool = True) -> torch.cuda.Event:
    """A CUDA event; with ``timing`` it can be used with :func:`elapsed_ms`."""
    event: torch.cuda.Event = torch_module().cuda.Event(enable_timing=timing)
    return event


def elapsed_ms(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
    """Milliseconds between two recorded events (synchronizes on ``end``)."""
    end.synchronize()
    return float(start.elapsed_time(end))


@dataclass(frozen=True)
class AllocatorStats:
    """The caching allocator's counters for one device, in bytes."""

    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int
    active: int = 0
    allocations: int = 0


def allocator_stats(device: int = 0) -> AllocatorStats:
    """Allocator counters through the nested C call (~8 µs, not the 45 µs dict flatten).

    Returns zeros without touching CUDA when torch has not initialised it.
    """
    if not is_initialized():
        return AllocatorStats(0, 0, 0, 0)
    torch = torch_module()
    stats = torch._C._cuda_memoryStats(device)

    def get(name: str, which: str = "current") -> int:
        return int(stats[name]["all"][which])

    return AllocatorStats(
        allocated=get("allocated_bytes"),
        reserved=get("reserved_bytes"),
        peak_allocated=get("allocated_bytes", "peak"),
        peak_reserved=get("reserved_bytes", "peak"),
        active=get("active_bytes"),
        allocations=get("allocation", "allocated") if "allocation" in stats else 0,
    )


# ---------------------------------------------------------------------------
# NVML figures (device-wide and per process); never create a context.


def _nvml_handle(device: DeviceInfo) -> Any:
    nvml = _require_nvml()
    if device.uuid:
        return nvml.nvmlDeviceGetHandleByUUID(device.uuid.encode())
    if device.physical_index is None:
        raise CudaUnavailable(f"cuda:{device.index} has no NVML identity")
    return nvml.nvmlDeviceGetHandleByIndex(device.physical_index)


def nvml_device_memory(device: DeviceInfo) -> tuple[int, int, int]:
    """``(used, free, total)`` bytes of the whole device, all processes included."""
    memory = _require_nvml().nvmlDeviceGetMemoryInfo(_nvml_handle(device))
    return int(memory.used), int(memory.free), int(memory.total)


def nvml_process_memory(device: DeviceInfo) -> dict[int, int]:
    """``{pid: bytes}`` of the compute processes on ``device``, as nvidia-smi shows them.

    Empty where the driver does not report processes (some containers, MIG).
    """
    nvml = _require_nvml()
    handle = _nvml_handle(device)
    result: dict[int, int] = {}
    with contextlib.suppress(nvml.NVMLError):
        for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
            used = proc.usedGpuMemory
            result[int(proc.pid)] = int(used) if used is not None else 0
    return result


def _require_nvml() -> ModuleType:
    nvml = _nvml()
    if nvml is None:
        raise CudaUnavailable("NVML is not available (no NVIDIA driver library)")
    return nvml


@contextlib.contextmanager
def visible_devices(value: str | None) -> Iterator[None]:
    """Set ``CUDA_VISIBLE_DEVICES`` for a block (``None`` unsets it), then put it back."""
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        if value is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = value
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


# ---------------------------------------------------------------------------
# %gpumem: allocator counters, peak resets, allocation stacks, NVML per
# process, and the facts of live tensors. None of these creates a CUDA context: the
# torch ones answer "nothing" until this process has initialised CUDA.


def allocator_counters(device: int) -> dict[str, int]:
    """The caching allocator's counters for ``device`` in bytes (one nested C call).

    Keys: ``allocated``, ``reserved``, ``peak_allocated``, ``peak_reserved``,
    ``requested`` (bytes the tensors asked for, before rounding to blocks),
    ``alloc_retries`` and ``ooms``. All zero, without touching CUDA, when torch has not
    initialised it.
    """
    names = (
        "allocated",
        "reserved",
        "peak_allocated",
        "peak_reserved",
        "requested",
        "alloc_retries",
        "ooms",
    )
    if not is_initialized():
        return dict.fromkeys(names, 0)
    stats = torch_module()._C._cuda_memoryStats(device)

    def get(name: str, which: str = "current") -> int:
        entry = stats.get(name)
        return int(entry["all"][which]) if entry else 0

    return {
        "allocated": get("allocated_bytes"),
        "reserved": get("reserved_bytes"),
        "peak_allocated": get("allocated_bytes", "peak"),
        "peak_reserved": get("reserved_bytes", "peak"),
        "requested": get("requested_bytes"),
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "ooms": int(stats.get("num_ooms", 0)),
    }


def reset_peak_memory_stats(device: int) -> None:
    """Reset every peak counter of ``device`` (torch's API is all-or-nothing per device).

    Callers must say so to the user: it changes what ``torch.cuda.max_memory_allocated``
    reports afterwards. Does nothing when CUDA is not initialised.
    """
    if is_initialized():
        torch_module().cuda.reset_peak_memory_stats(device)


def empty_cache() -> None:
    """Return torch's cached, unused blocks to the driver (only when CUDA is initialised)."""
    if is_initialized():
        torch_module().cuda.empty_cache()


def allocator_backend() -> str | None:
    """``"native"`` or ``"cudaMallocAsync"``; ``None`` when torch is not imported."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "cuda"):
        return None
    try:
        return str(torch.cuda.get_allocator_backend())
    except (AttributeError, RuntimeError):
        return None


def device_total_memory(device: int) -> int | None:
    """Total memory of ``device`` from torch's properties, only once CUDA is initialised
    (reading properties earlier would initialise it)."""
    if not is_initialized():
        return None
    return int(torch_module().cuda.get_device_properties(device).total_memory)


def nvml_memory_info(device: DeviceInfo) -> tuple[int, int, int, int | None]:
    """``(total, used, free, driver_reserved)`` bytes of the whole device.

    Uses NVML's v2 memory query where the driver has it (driver 515+): there ``used``
    excludes the memory the driver reserves for itself, as nvidia-smi shows it, and
    ``driver_reserved`` is that reservation; otherwise ``None`` (gpustat#141). Raises
    :class:`CudaUnavailable` when NVML is missing or the query fails.
    """
    nvml = _require_nvml()
    try:
        handle = _nvml_handle(device)
        version = getattr(nvml, "nvmlMemory_v2", None)
        if version is not None:
            with contextlib.suppress(nvml.NVMLError, TypeError, AttributeError):
                info = nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
                return int(info.total), int(info.used), int(info.free), int(info.reserved)
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
    except nvml.NVMLError as exc:
        raise CudaUnavailable(
            f"NVML could not read the memory of cuda:{device.index}: {exc}"
        ) from None
    return int(info.total), int(info.used), int(info.free), None


def nvml_processes(device: DeviceInfo) -> list[tuple[int, int | None]]:
    """``[(pid, bytes)]`` of the compute and graphics processes on ``device``.

    ``bytes`` is ``None`` where the driver does not say (MIG instances, Windows WDDM).
    Falls back to the v2 process query on drivers without v3 (gpustat#107). Raises
    :class:`CudaUnavailable` when NVML is missing or the driver refuses the query.
    """
    nvml = _require_nvml()
    found: dict[int, int | None] = {}
    try:
        handle = _nvml_handle(device)
        for kind in ("Compute", "Graphics"):
            query = getattr(nvml, f"nvmlDeviceGet{kind}RunningProcesses")
            try:
                procs = query(handle)
            except nvml.NVMLError_FunctionNotFound:
                procs = getattr(nvml, f"nvmlDeviceGet{kind}RunningProcesses_v2")(handle)
            for proc in procs:
                used = proc.usedGpuMemory
                value = int(used) if used is not None and used < 2**63 else None
                old = found.get(int(proc.pid))
                found[int(proc.pid)] = value if old is None else max(old, value or 0)
    except nvml.NVMLError as exc:
        raise CudaUnavailable(
            f"NVML could not list the processes on cuda:{device.index}: {exc}"
        ) from None
    return sorted(found.items())


@dataclass(frozen=True)
class TensorFacts:
    """What a live tensor holds: its storage (shared by views), size and where."""

    storage: tuple[str, int]
    nbytes: int
    device: str
    shape: tuple[int, ...]
    dtype: str
    grad: object | None = None
    view: bool = False


def tensor_facts(obj: object) -> TensorFacts | None:
    """The facts of ``obj`` when it is a torch tensor (any device), else ``None``.

    Reads only host-side metadata: no synchronisation, no CUDA context. Views of one
    storage get the same ``storage`` key; ``grad`` is read only from leaf tensors (a
    non-leaf's ``.grad`` warns).
    """
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor):
        return None
    import warnings

    device = str(obj.device)
    try:
        storage = obj.untyped_storage()
        key = (device, int(storage.data_ptr()))
        nbytes = int(storage.nbytes())
    except (RuntimeError, NotImplementedError, TypeError):
        # Sparse, nested or fake tensors: no single storage to share.
        key = ("object", id(obj))
        nbytes = int(obj.element_size() * obj.numel()) if obj.layout == torch.strided else 0
    if key[1] == 0:
        key = ("object", id(obj))
    grad = None
    if obj.is_leaf:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            grad = obj.grad
    return TensorFacts(
        storage=key,
        nbytes=nbytes,
        device=device,
        shape=tuple(int(n) for n in obj.shape),
        dtype=str(obj.dtype).removeprefix("torch."),
        grad=grad,
        view=bool(obj._is_view()),
    )


def memory_history_enabled() -> bool:
    """Whether torch's allocator is recording allocation stacks (the user's or ours)."""
    if not is_initialized():
        return False
    probe = getattr(torch_module()._C, "_cuda_isHistoryEnabled", None)
    return bool(probe()) if probe is not None else False


def start_memory_history(max_entries: int) -> bool:
    """Record the Python stack of every allocation from now on; ``True`` if we turned it on.

    Records allocation stacks for live blocks (``enabled="state"``, ``context="state"``,
    Python frames only: one stack capture per allocation, none per free); the event ring
    buffer is bounded by ``max_entries``. When recording is already on (the user's own
    ``_record_memory_history``), their settings are kept and ``False`` is returned.
    Initialises CUDA when it is not yet (recording needs the allocator).
    """
    torch = torch_module()
    if not is_initialized():
        torch.cuda.init()
    if memory_history_enabled():
        return False
    torch.cuda.memory._record_memory_history(
        "state", context="state", stacks="python", max_entries=max_entries
    )
    return True


def stop_memory_history() -> None:
    """Switch allocation-stack recording off (only after :func:`start_memory_history`
    returned ``True``)."""
    torch_module().cuda.memory._record_memory_history(None)


def memory_snapshot_segments() -> list[dict[str, Any]]:
    """The allocator's segments and blocks with their allocation stacks (all devices)."""
    snapshot = torch_module().cuda.memory._snapshot()
    return list(snapshot.get("segments", []))


# ---------------------------------------------------------------------------
# %lprun: what the line profiler calls at every line boundary. These run
# thousands of times per profile, so they call torch's C functions directly, and none
# of them creates a CUDA context.

#: The text torch warns with, in ``set_sync_debug_mode("warn")``, when an operation
#: makes the host wait for the GPU (``.item()``, ``.cpu()``, ``nonzero()``...).
SYNC_WARNING_MESSAGE = "called a synchronizing CUDA operation"


def devices_with_context() -> tuple[int, ...]:
    """Indices of the devices on which this process has a CUDA context; ``()`` before
    torch has initialised CUDA. Never creates a context."""
    if not is_initialized():
        return ()
    torch = torch_module()
    has_context = torch._C._cuda_hasPrimaryContext
    return tuple(i for i in range(torch.cuda.device_count()) if has_context(i))


def visible_device_total() -> int:
    """How many devices torch sees (``0`` before torch has initialised CUDA)."""
    if not is_initialized():
        return 0
    return int(torch_module().cuda.device_count())


def synchronize_each(devices: tuple[int, ...]) -> None:
    """Wait for all streams of each device in ``devices`` (a device sync per device:
    ``torch.cuda.synchronize()`` covers the current device only). Only call it once
    torch has initialised CUDA."""
    torch = sys.modules["torch"]
    native = torch._C
    if len(devices) == 1 and devices[0] == native._cuda_getDevice():
        native._cuda_synchronize()
        return
    for index in devices:
        with torch.cuda.device(index):
            native._cuda_synchronize()


def stream_is_capturing() -> bool:
    """Whether the current stream is capturing a CUDA graph (a synchronize would break
    the capture). ``False`` without a context (torch's call creates none)."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch._C._cuda_isCurrentStreamCapturing())


def record_timing_event() -> Any:
    """A new timing event, recorded on the current stream of the current device."""
    event = torch_module().cuda.Event(enable_timing=True)
    event.record()
    return event


def event_completed(event: Any) -> bool:
    """Whether the GPU has passed ``event`` (never blocks)."""
    return bool(event.query())


def event_span_ms(start: Any, end: Any) -> float:
    """Milliseconds between two completed events of one device."""
    return float(start.elapsed_time(end))


def allocation_marks(device: int) -> tuple[int, int, int, int]:
    """``(allocated, peak allocated, bytes allocated ever, bytes freed ever)`` of the
    caching allocator on ``device``: one nested C call, no dict flattening."""
    stat = torch_module()._C._cuda_memoryStats(device)["allocated_bytes"]["all"]
    return int(stat["current"]), int(stat["peak"]), int(stat["allocated"]), int(stat["freed"])


def get_sync_debug_mode() -> int:
    """torch's sync debug mode (0 off, 1 warn, 2 error); 0 before CUDA is initialised."""
    if not is_initialized():
        return 0
    return int(torch_module()._C._cuda_get_sync_debug_mode())


def set_sync_debug_mode(mode: int) -> None:
    """Set torch's sync debug mode; only call it once CUDA is initialised. torch's
    "prototype feature" warning on switching it is not shown."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        torch_module()._C._cuda_set_sync_debug_mode(mode)


# ---------------------------------------------------------------------------
# %cudatime (gpumagic.timing): events on each device's current stream, the spin kernel
# that keeps launch latency out of the events, the L2 flush, CUDA graph capture, CUPTI
# kernel time through torch.profiler, and hidden-sync detection.

#: ``record_function`` label around the L2 flush, so CUPTI figures can leave it out.
FLUSH_LABEL = "gpumagic.l2_flush"

# Dense bf16 tensor-core peaks (FLOP/s) from NVIDIA's data sheets, matched against the
# device name in this order (more specific names first).
_DENSE_BF16_PEAKS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.4e12),
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100 NVL", 835.0e12),
    ("H100", 989.4e12),
    ("H800", 989.4e12),
    ("B200", 2250.0e12),
    ("A100", 312.0e12),
    ("A800", 312.0e12),
    ("L40S", 362.05e12),
    ("L4", 121.0e12),
    ("RTX 4090", 165.2e12),
)


@dataclass(frozen=True)
class DevicePeaks:
    """What the timing report needs to know about one device."""

    name: str
    dram_bytes_per_s: float | None
    tensor_flops: float | None
    flops_basis: str


def context_devices(also: int | None = None) -> list[int]:
    """The current device and every device with a CUDA context in this process.

    Work can only have been queued on devices with a context, so these are the ones a
    timed body can have used. Call it only once CUDA is initialised.
    """
    torch = torch_module()
    found = {int(torch.cuda.current_device())}
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has_context is not None:
        found.update(i for i in range(torch.cuda.device_count()) if has_context(i))
    if also is not None:
        found.add(also)
    return sorted(found)


def current_device() -> int:
    """The index of torch's current CUDA device."""
    return int(torch_module().cuda.current_device())


def use_device(index: int) -> contextlib.AbstractContextManager[Any]:
    """Make ``index`` the current device for a block, then put the old one back."""
    return cast("contextlib.AbstractContextManager[Any]", torch_module().cuda.device(index))


def record_event(device: int) -> torch.cuda.Event:
    """A timing event recorded now on ``device``'s current stream."""
    tm = torch_module()
    event: torch.cuda.Event = tm.cuda.Event(enable_timing=True)
    event.record(tm.cuda.current_stream(device))
    return event


def current_streams(devices: Iterable[int]) -> list[Any]:
    """The current stream of each device (to put back with :func:`restore_streams`)."""
    torch = torch_module()
    return [torch.cuda.current_stream(d) for d in devices]


def restore_streams(streams: Iterable[Any]) -> None:
    """Make each stream current again on its device."""
    torch = torch_module()
    for stream in streams:
        if torch.cuda.current_stream(stream.device) != stream:
            torch.cuda.set_stream(stream)


@functools.cache
def _cycles_per_us(device: int) -> float:
    rate = getattr(torch_module().cuda.get_device_properties(device), "clock_rate", 0)
    return rate / 1e3 if rate else 2000.0  # clock_rate is in kHz


def spin(device: int, microseconds: float) -> None:
    """Queue a kernel that spins for about ``microseconds`` on ``device``'s current stream.

    Queued ahead of a start event it keeps the GPU busy while the host enqueues the event
    and the first launches, so the interval starts when the GPU reaches the work, not
    when the host did (the idle-queue pitfall); NVBench's blocking kernel does the same.
    """
    torch = torch_module()
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return
    with torch.cuda.device(device):
        sleep(int(microseconds * _cycles_per_us(device)))


def device_peaks(device: int) -> DevicePeaks:
    """Name, L2 size, and the DRAM and dense bf16 peaks of ``device`` where known."""
    props = torch_module().cuda.get_device_properties(device)
    name = str(props.name)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    dram = clock_khz * 1e3 * bus_bits * 2 / 8 if clock_khz and bus_bits else None
    if dram is None:
        dram = _nvml_dram_peak(device)
    flops = next((peak for key, peak in _DENSE_BF16_PEAKS if key in name), None)
    return DevicePeaks(
        name=name,
        dram_bytes_per_s=dram,
        tensor_flops=flops,
        flops_basis="dense bf16 tensor-core peak" if flops else "",
    )


def _nvml_dram_peak(device: int) -> float | None:
    nvml = _nvml()
    visible = devices()
    if nvml is None or device >= len(visible):
        return None
    try:
        handle = _nvml_handle(visible[device])
        clock_mhz = nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_MEM)
        bus_bits = nvml.nvmlDeviceGetMemoryBusWidth(handle)
    except (nvml.NVMLError, CudaUnavailable, AttributeError):
        return None
    return float(clock_mhz) * 1e6 * float(bus_bits) * 2 / 8


def l2_flush_buffer(device: int) -> torch.Tensor:
    """A buffer twice the size of ``device``'s L2 cache (at least 64 MiB) to flush it."""
    tm = torch_module()
    l2 = int(getattr(tm.cuda.get_device_properties(device), "L2_cache_size", 0))
    size = max(2 * l2, 64 << 20)
    buffer: torch.Tensor = tm.empty(size // 4, dtype=tm.int32, device=device)
    return buffer


def flush_l2(buffer: torch.Tensor) -> None:
    """Overwrite the flush buffer on the current stream (labelled for CUPTI)."""
    torch = torch_module()
    with torch.profiler.record_function(FLUSH_LABEL):
        buffer.zero_()


class GraphCaptureError(RuntimeError):
    """The body could not be captured in a CUDA graph; the message says why."""


def capture_graph(run: Callable[[int], object], iterations: int, device: int) -> Callable[[], None]:
    """Capture ``run(iterations)`` in a CUDA graph on ``device``; returns its replay.

    Warms up on a side stream first, as torch asks; the garbage collector is off during
    capture (a finalizer must not free memory the graph is using). An exception raised
    by ``run`` during the warm-up is the body's own and propagates unchanged; a failure
    during capture becomes :class:`GraphCaptureError` with the reason.
    """
    import gc
    import warnings

    torch = torch_module()
    with torch.cuda.device(device):
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            run(2)
        current.wait_stream(side)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with torch.cuda.graph(graph):
                    run(iterations)
        except Exception as exc:
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(device)
            _reset_capture_state(device)
            raise GraphCaptureError(_capture_reason(exc)) from exc
        finally:
            if gc_was_enabled:
                gc.enable()
        if any("empty" in str(w.message).lower() for w in caught):
            raise GraphCaptureError(
                "the body launched no GPU work while it was captured (CPU tensors?), "
                "so replaying the graph would time nothing"
            )
        graph.replay()
        torch.cuda.synchronize(device)
    replay: Callable[[], None] = graph.replay
    return replay


def _reset_capture_state(device: int) -> None:
    """Undo what a failed capture leaves behind.

    When ending a capture fails, torch's ``CUDAGraph::capture_end`` throws before its
    generators' capture epilogue runs, so the CUDA RNG stays in capture mode and every
    later random op fails ("Offset increment outside graph capture encountered
    unexpectedly"). A trivial capture that succeeds runs the epilogue and puts it back.
    """
    torch = torch_module()
    scratch = torch.cuda.CUDAGraph()
    with contextlib.suppress(Exception), torch.cuda.graph(scratch):
        torch.ones(1, device=device)
    del scratch


def _capture_reason(exc: BaseException) -> str:
    chain = [exc]
    while chain[-1].__context__ is not None and len(chain) < 10:
        chain.append(chain[-1].__context__)
    texts = " ".join(str(e) for e in chain)
    root = chain[-1]
    first = (str(root).strip().splitlines() or [""])[0]
    if "capturing" in texts or "StreamCapture" in texts or "capture" in first.lower():
        return (
            f"the body synchronizes with the host or leaves the GPU during capture ({first}); "
            "CUDA graphs cannot hold that: look for .item(), .cpu(), printing a CUDA "
            "tensor, nonzero() or data-dependent shapes (--sync-check names them)"
        )
    return f"{type(root).__name__}: {first}"


@dataclass(frozen=True)
class KernelProfile:
    """CUPTI's record of a profiled stretch of iterations (times in µs)."""

    busy_us: float
    span_us: float | None
    kernels: tuple[tuple[str, int, float], ...]
    flushes_removed: int


def profile_kernels(
    warm: Callable[[], object], run: Callable[[], object], devices: Iterable[int], flushes: int = 0
) -> KernelProfile:
    """Kernel, copy and memset time of ``run()`` from CUPTI (torch.profiler).

    ``warm()`` runs during the profiler's warm-up step, whose records are dropped (a fresh
    profiler session can lose the first activities). With ``flushes`` > 0, kernels launched
    inside :func:`flush_l2` are taken out of the figures.
    """
    import warnings

    torch = torch_module()
    from torch.profiler import ProfilerActivity, profile, schedule

    devices = list(devices)
    activities = [ProfilerActivity.CUDA]
    if flushes:
        activities.append(ProfilerActivity.CPU)

    def record() -> Any:
        with profile(
            activities=activities, schedule=schedule(wait=0, warmup=1, active=1, repeat=1)
        ) as prof:
            warm()
            synchronize(devices)
            prof.step()
            run()
            synchronize(devices)
            prof.step()
        return prof

    with warnings.catch_warnings():
        # One cycle only: torch's note that later cycles drop this one's events does not
        # concern us.
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        prof = record()
    return _kernel_profile(prof.events(), torch.autograd.DeviceType, flushes)


def _kernel_profile(events: Any, device_type: Any, flushes: int) -> KernelProfile:
    annotations = {FLUSH_LABEL} | {
        e.name
        for e in events
        if e.device_type == device_type.CPU and getattr(e, "is_user_annotation", False)
    }
    on_device = [
        e
        for e in events
        if e.device_type == device_type.CUDA
        and not getattr(e, "is_user_annotation", False)
        and e.name not in annotations
        and not e.name.startswith("ProfilerStep")
    ]
    totals: dict[str, list[float]] = {}
    for e in on_device:
        entry = totals.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.end - e.time_range.start
    removed = 0
    if flushes:
        ranges = [
            (e.time_range.start, e.time_range.end)
            for e in events
            if e.name == FLUSH_LABEL and e.device_type == device_type.CPU
        ]
        for e in events:
            if e.device_type != device_type.CPU or getattr(e, "is_user_annotation", False):
                continue
            if not any(lo <= e.time_range.start <= hi for lo, hi in ranges):
                continue
            for kernel in getattr(e, "kernels", ()):
                found = totals.get(kernel.name)
                if found is not None and found[0] > 0:
                    found[0] -= 1
                    found[1] -= kernel.duration
                    removed += 1
    kernels = tuple(
        sorted(
            ((name, int(c), float(us)) for name, (c, us) in totals.items() if c > 0),
            key=lambda k: -k[2],
        )
    )
    span = None
    if on_device and not flushes:
        span = max(e.time_range.end for e in on_device) - min(e.time_range.start for e in on_device)
    return KernelProfile(
        busy_us=sum(k[2] for k in kernels), span_us=span, kernels=kernels, flushes_removed=removed
    )


@dataclass(frozen=True)
class SyncEvent:
    """One host synchronization caught by :func:`catch_syncs`."""

    op: str
    filename: str
    lineno: int


_SYNC_TEXT = "called a synchronizing CUDA operation"  # torch's warning under "warn"
_DUNDER_OPS = {
    "__bool__": "bool(tensor)",
    "__int__": "int(tensor)",
    "__float__": "float(tensor)",
    "__index__": "using a tensor as an index",
    "__format__": "formatting a tensor",
    "__repr__": "printing a tensor",
    "__str__": "printing a tensor",
    "__array__": "tensor to numpy",
    "__iter__": "iterating over a tensor",
}


def _op_name(func: Any) -> str:
    name = str(getattr(func, "__name__", func))
    if name in _DUNDER_OPS:
        return _DUNDER_OPS[name]
    qualname = str(getattr(func, "__qualname__", name))
    if qualname.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + name
    module = str(getattr(func, "__module__", "") or "torch")
    return f"{module}.{name}" if not qualname.startswith(module) else qualname


@functools.cache
def _sync_mode_class() -> type:
    torch = torch_module()
    library_dirs = tuple(
        str(Path(m.__file__).parent) for m in (torch, sys.modules[__name__]) if m.__file__
    )

    base: Any = torch.overrides.TorchFunctionMode

    class SyncSites(base):  # type: ignore[misc]
        """Attributes each sync warning to the torch call that raised it and its caller."""

        def __init__(self, caught: list[Any], code_files: frozenset[str]) -> None:
            super().__init__()
            self.caught = caught
            self.code_files = code_files
            self.events: list[SyncEvent] = []
            self.seen: set[int] = set()

        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            before = len(self.caught)
            try:
                return func(*args, **(kwargs or {}))
            finally:
                for w in self.caught[before:]:
                    if _SYNC_TEXT in str(w.message) and id(w) not in self.seen:
                        self.seen.add(id(w))
                        filename, lineno = self._caller()
                        self.events.append(SyncEvent(_op_name(func), filename, lineno))

        def _caller(self) -> tuple[str, int]:
            frame: Any = sys._getframe(2)
            fallback: tuple[str, int] | None = None
            while frame is not None:
                name = frame.f_code.co_filename
                if name in self.code_files:
                    return name, frame.f_lineno
                if fallback is None and not name.startswith(library_dirs):
                    fallback = (name, frame.f_lineno)
                frame = frame.f_back
            return fallback or ("<unknown>", 0)

    return SyncSites


def catch_syncs(run: Callable[[], object], code_files: Iterable[str] = ()) -> list[SyncEvent]:
    """Run ``run()`` under ``torch.cuda.set_sync_debug_mode("warn")`` and return each host
    synchronization it caused, named by op and source line. The previous mode is put back.
    """
    import warnings

    torch = torch_module()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mode = _sync_mode_class()(caught, frozenset(code_files))
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with mode:
                run()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    events: list[SyncEvent] = list(mode.events)
    for w in caught:
        if _SYNC_TEXT in str(w.message) and id(w) not in mode.seen:
            events.append(SyncEvent("a torch internal call", w.filename, w.lineno))
    return events


_STICKY = (
    "device-side assert",
    "illegal memory access",
    "misaligned address",
    "unspecified launch failure",
    "illegal instruction",
    "an illegal",
)


def cuda_error_hint(exc: BaseException) -> str | None:
    """What to do about a CUDA error raised by user code (``None`` if it is not one)."""
    text = str(exc)
    if "out of memory" in text and "CUDA" in text:
        return (
            "The body ran out of GPU memory: free tensors you no longer need (del them, "
            "then torch.cuda.empty_cache()) or time a smaller problem."
        )
    if "CUDA error" not in text and "CUDA kernel errors" not in text:
        return None
    hint = (
        "This CUDA error came from the timed body. Kernel errors surface at a later call, "
        "so the line shown may not be the culprit: set CUDA_LAUNCH_BLOCKING=1 before CUDA "
        "starts (restart the kernel) to see the launching line."
    )
    if any(s in text for s in _STICKY):
        hint += (
            " This kind of error is sticky: the CUDA context cannot be used any more in "
            "this process; restart the kernel."
        )
    return hint


# ---------------------------------------------------------------------------
# Leak checks (pytest_cuda.leaks): releasing the memory that libraries keep by
# design, so that only code's own leftovers remain in the allocator. None of these
# creates a CUDA context: each does nothing before torch has initialised CUDA.


def release_blas_workspaces() -> bool:
    """Free torch's cuBLAS and cuBLASLt workspaces (32 MiB per handle and stream on
    Hopper); the next matmul takes new ones from the caching allocator.

    ``False`` when there is nothing to call (CUDA not initialised, or a torch without
    ``torch._C._cuda_clearCublasWorkspaces``).
    """
    if not is_initialized():
        return False
    clear = getattr(torch_module()._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return False
    clear()
    return True


def clear_fft_plan_caches(devices: Iterable[int]) -> bool:
    """Empty the cuFFT plan cache of each of ``devices`` that holds plans; ``True`` if
    one did."""
    if not is_initialized():
        return False
    torch = torch_module()
    size = getattr(torch, "_cufft_get_plan_cache_size", None)
    clear = getattr(torch, "_cufft_clear_plan_cache", None)
    if size is None or clear is None:
        return False
    cleared = False
    for device in devices:
        if size(device):
            clear(device)
            cleared = True
    return cleared


def release_cached_blocks(devices: Iterable[int]) -> None:
    """Wait for all work on ``devices``, then return cached blocks to the driver.

    ``empty_cache`` also completes the frees that waited for other streams
    (``Tensor.record_stream``), which the allocated-bytes counter still holds. Only pass
    devices that hold allocations: synchronising a device creates its context.
    """
    if not is_initialized():
        return
    torch = torch_module()
    for device in devices:
        torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def reset_compile_caches() -> bool:
    """``torch._dynamo.reset()`` when torch.compile has been used in this process: it
    drops compiled graphs and the constants they hold (later calls compile again).
    ``False`` when torch._dynamo was never imported."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return False
    dynamo.reset()
    return True


def on_cuda_init(callback: Callable[[], object]) -> bool:
    """Run ``callback`` as soon as torch initialises CUDA (at once if it has).

    ``callback`` runs inside torch's lazy initialisation, where an exception would fail
    the user's first CUDA call: it must not raise. ``False`` when torch is not imported
    (nothing can be queued; this never imports it).
    """
    torch = sys.modules.get("torch")
    lazy_call = getattr(getattr(torch, "cuda", None), "_lazy_call", None)
    if lazy_call is None:
        return False
    lazy_call(callback)
    return True


def start_allocation_history(max_entries: int) -> bool:
    """Record the Python stack and the time of every allocation, unless recording is on.

    ``_record_memory_history("all", context="alloc", stacks="python")``: a stack capture
    per allocation (none per free) and a ring of the last ``max_entries`` allocator
    events with their times, which tell a leak check which live blocks are new.
    ``True`` when this call turned recording on (its caller turns it off with
    :func:`stop_memory_history`); ``False`` when it was on already (the user's settings
    are kept). Only call it once CUDA is initialised, or from :func:`on_cuda_init`.
    """
    torch = torch_module()
    if torch._C._cuda_isHistoryEnabled():
        return False
    torch.cuda.memory._record_memory_history(
        "all", context="alloc", stacks="python", max_entries=max_entries
    )
    return True


def memory_snapshot() -> dict[str, Any]:
    """``torch.cuda.memory._snapshot()``: segments with their blocks (and allocation
    stacks when recording), and each device's ring of allocator events."""
    return dict(torch_module().cuda.memory._snapshot())


# ---------------------------------------------------------------------------
# Debugging asynchronous CUDA errors (pytest_cuda.sync_plugin): the post-test
# check for an error left in the context, a dispatch mode that synchronizes after every
# op, and torch's sync debug mode with restore. Only forbid_implicit_sync creates a
# context (the user asked for CUDA checking); the others do nothing until torch has one.


@dataclass(frozen=True)
class AsyncCudaError:
    """A CUDA error that surfaced when synchronizing, after the work that caused it."""

    message: str
    #: The context stayed unusable: a second synchronize failed as well (device-side
    #: assert, illegal address...), so every later CUDA call in the process fails.
    sticky: bool


def _synchronize_error() -> str | None:
    try:
        synchronize_each(devices_with_context())
    except RuntimeError as error:  # torch.AcceleratorError (torch >= 2.8) is one
        return str(error)
    return None


def async_error() -> AsyncCudaError | None:
    """Synchronize every device this process uses; the error that surfaces, if any.

    The post-test health check. Returns ``None`` at once (no torch import, no CUDA
    call) when torch has not initialised CUDA; else costs one device synchronize per
    device with a context. A failing synchronize is tried once more: a sticky error
    fails again, because it leaves the context unusable.
    """
    if not is_initialized():
        return None
    first = _synchronize_error()
    if first is None:
        return None
    return AsyncCudaError(first, sticky=_synchronize_error() is not None)


def torch_package_dir() -> Path | None:
    """Where the imported torch lives (to tell its frames from the user's); no import."""
    module = sys.modules.get("torch")
    location = getattr(module, "__file__", None)
    return Path(location).parent if location else None


def _first_cuda_device(torch: Any, values: tuple[Any, ...]) -> int | None:
    """The device index of the first CUDA tensor among ``values`` (one level of lists)."""
    for value in values:
        first = (value[0] if value else None) if isinstance(value, list | tuple) else value
        if isinstance(first, torch.Tensor) and first.is_cuda:
            return int(first.device.index)
    return None


@functools.cache
def _sync_after_each_op_mode() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    torch = torch_module()

    class SyncAfterEachOp(TorchDispatchMode):  # type: ignore[no-untyped-call]
        """Synchronize the device after every op that touched a CUDA tensor."""

        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
        ) -> Any:
            __tracebackhide__ = True
            out = func(*args, **(kwargs or {}))
            device = _first_cuda_device(torch, (out, *args))
            if device is None or torch._C._cuda_isCurrentStreamCapturing():
                return out
            try:
                synchronize_each((device,))
            except RuntimeError as error:
                error.add_note(
                    f"pytest_cuda: raised by the synchronize right after {func} "
                    "(per-op sync): this op queued the kernel that failed"
                )
                # The error belongs to the line that called the op, not to synchronize().
                raise error.with_traceback(None) from None
            return out

    return SyncAfterEachOp


def sync_after_each_op() -> contextlib.AbstractContextManager[Any]:
    """A ``TorchDispatchMode``: synchronize after every torch op on a CUDA tensor.

    An asynchronous error is then raised by the op that queued the failing kernel, at
    its line, without restarting the process. Ops on CPU tensors are not synchronized,
    nor ops inside a CUDA graph capture. Kernels launched outside torch's dispatcher
    (Triton launched directly, CuPy, custom extensions called without an op) are not
    seen.
    """
    mode: contextlib.AbstractContextManager[Any] = _sync_after_each_op_mode()()
    return mode


class ImplicitSyncError(RuntimeError):
    """An implicit host-device synchronization inside :func:`forbid_implicit_sync`."""

    def __init__(self, op: str | None, message: str) -> None:
        super().__init__(message)
        #: The torch op that synchronized (``aten._local_scalar_dense.default``), when
        #: it went through torch's dispatcher.
        self.op = op


@functools.cache
def _name_implicit_sync_mode() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    class NameImplicitSync(TorchDispatchMode):  # type: ignore[no-untyped-call]
        """Turn torch's "called a synchronizing CUDA operation" into an error naming the op."""

        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
        ) -> Any:
            __tracebackhide__ = True
            try:
                return func(*args, **(kwargs or {}))
            except RuntimeError as error:
                message = str(error)
                if SYNC_WARNING_MESSAGE not in message:
                    raise
                raise ImplicitSyncError(str(func), message.splitlines()[0]) from None

    return NameImplicitSync


@contextlib.contextmanager
def forbid_implicit_sync() -> Iterator[None]:
    """Raise :class:`ImplicitSyncError` when code in the block makes the host wait.

    ``torch.cuda.set_sync_debug_mode("error")`` plus a dispatch mode that names the op;
    the previous mode is put back afterwards. Creates a CUDA context; raises
    :class:`CudaUnavailable` without CUDA. It cannot see explicit synchronization
    (``torch.cuda.synchronize()``, ``Event/Stream.synchronize()``) nor syncs outside
    torch's kernels (CuPy, extensions), and torch documents the mode as a prototype
    that misses some ops (``torch.distributed``, ``torch.sparse``). The mode is
    process-wide: other threads are affected while the block runs.
    """
    import warnings

    require()
    torch = torch_module()
    torch.cuda.init()
    previous = get_sync_debug_mode()
    with warnings.catch_warnings():
        # torch warns once that the mode is a prototype; the docs say so instead.
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        set_sync_debug_mode(2)
    try:
        with _name_implicit_sync_mode()():
            yield
    finally:
        set_sync_debug_mode(previous)
