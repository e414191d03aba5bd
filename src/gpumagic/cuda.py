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
    from collections.abc import Iterable, Iterator
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
    num_ooms: int = 0


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
        num_ooms=int(stats.get("num_ooms", 0)),
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
# %gpumem (issue 5): allocator counters, peak resets, allocation stacks, NVML per
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
