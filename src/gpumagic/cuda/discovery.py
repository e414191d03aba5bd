"""Discovery: which CUDA devices this process can use, and why not when it cannot.

Never creates a CUDA context and never imports torch: NVML is asked for the boards
(the CUDA driver API where a driver has no NVML), ``CUDA_VISIBLE_DEVICES`` maps them
to indices, and torch's version file is read instead of importing torch.
Without CUDA (torch missing, a CPU-only build, no driver, every device hidden) the
answer carries a reason (:class:`CudaUnavailable`) instead of an error deep in torch.
Also NVML's readings of a device (its memory, its processes: one function each) and
the one place that imports torch (:func:`torch_module`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from gpumagic.devices import (
    CudaStatus,
    DeviceInfo,
    parse_visible_devices,
    select_visible,
)

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import ModuleType

__all__ = [
    "CudaUnavailable",
    "NvmlMemory",
    "devices",
    "is_initialized",
    "nvml_memory_info",
    "nvml_processes",
    "require",
    "reset_status_cache",
    "status",
    "torch_module",
    "visible_devices",
]


class CudaUnavailable(RuntimeError):
    """CUDA work was asked for where none is possible; the message says why."""


#: A test's made-up machine, ``(pynvml stand-in, torch's version file)``: discovery reads
#: it instead of NVML and ``torch/version.py``. The one hook for tests (``tests/fake_cuda.py``
#: sets it); ``None`` in real use.
_machine: tuple[Any, dict[str, str | None]] | None = None


def _torch_version_file() -> dict[str, str | None]:
    """``torch/version.py``'s ``__version__`` and ``cuda`` without importing torch."""
    if _machine is not None:
        return dict(_machine[1])
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
        match = re.search(rf"^{name}\s*(?::[^=\n]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
        if match:
            found[key] = match.group(1)
    return found


def _nvml() -> ModuleType | None:
    """pynvml, initialised once (a test's :data:`_machine` where one is set); ``None``
    when the library or the driver is missing."""
    return _load_nvml() if _machine is None else _machine[0]


@functools.cache
def _load_nvml() -> ModuleType | None:
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
        return _status_from_driver(common)
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


def _status_from_driver(common: dict[str, Any]) -> CudaStatus:
    """NVML is missing: ask the CUDA driver itself, else there is no driver.

    A driver without NVML is rare (Jetson boards); there the driver API lists the
    devices. Without either library there is no NVIDIA driver, which is the answer on
    every GPU-less machine with a CUDA build of torch, and torch is not imported for it.
    """
    lib = _cuda_driver()
    if lib is None:
        reason = "no NVIDIA driver was found (neither NVML nor libcuda loads)"
        return CudaStatus(False, reason, **common)
    code = lib.cuInit(0)  # reads CUDA_VISIBLE_DEVICES once per process, as torch does
    found = _driver_devices(lib) if code == 0 else []
    if code not in (0, _CUDA_ERROR_NO_DEVICE):
        return CudaStatus(False, f"the CUDA driver did not start (cuInit error {code})", **common)
    if not found:
        env = common["visible_devices_env"]
        hidden = "" if env is None else f" (CUDA_VISIBLE_DEVICES={env!r})"
        return CudaStatus(False, f"the CUDA driver reports no GPU{hidden}", **common)
    return CudaStatus(True, "", devices=tuple(found), **common)


@functools.cache
def _cuda_driver() -> Any:
    """The CUDA driver library (``libcuda``) through ctypes; ``None`` when it is missing."""
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


# From cuda.h: cuInit's answer without a visible device; cuDeviceGetAttribute's ids
# of the compute capability.
_CUDA_ERROR_NO_DEVICE = 100
_CAPABILITY_MAJOR, _CAPABILITY_MINOR = 75, 76


def _driver_devices(lib: Any) -> list[DeviceInfo]:
    """The visible devices as the CUDA driver API lists them, after ``cuInit`` (which
    creates no context); names, sizes and capabilities, no NVML identity."""
    count = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return []
    found = []
    for i in range(count.value):
        handle, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
        name = ctypes.create_string_buffer(256)
        total = ctypes.c_size_t(0)
        if lib.cuDeviceGet(ctypes.byref(handle), i) != 0:
            break
        lib.cuDeviceGetName(name, len(name), handle)
        lib.cuDeviceTotalMem_v2(ctypes.byref(total), handle)
        lib.cuDeviceGetAttribute(ctypes.byref(major), _CAPABILITY_MAJOR, handle)
        lib.cuDeviceGetAttribute(ctypes.byref(minor), _CAPABILITY_MINOR, handle)
        found.append(
            DeviceInfo(
                index=i,
                name=name.value.decode(errors="replace") or "unknown",
                total_memory=int(total.value),
                capability=(int(major.value), int(minor.value)),
            )
        )
    return found


_STATUS: CudaStatus | None = None


_STATUS_KEY: str | None = None


def status() -> CudaStatus:
    """Whether CUDA is usable here, the versions, and the visible devices.

    Creates no CUDA context and does not import torch, with or without a driver: NVML
    lists the boards, else the CUDA driver API (``libcuda`` through ctypes). Cached until
    ``CUDA_VISIBLE_DEVICES`` changes or :func:`reset_status_cache` is called.
    """
    global _STATUS, _STATUS_KEY
    key = os.environ.get("CUDA_VISIBLE_DEVICES", "\0unset")
    if _STATUS is None or key != _STATUS_KEY:
        _STATUS, _STATUS_KEY = _status_now(), key
    return _STATUS


def reset_status_cache() -> None:
    """Forget the cached :func:`status`, for a machine that changed under this process
    (a test's made-up GPUs); a change of ``CUDA_VISIBLE_DEVICES`` needs no reset."""
    global _STATUS, _STATUS_KEY
    _STATUS, _STATUS_KEY = None, None


def devices() -> tuple[DeviceInfo, ...]:
    """The visible devices (empty without CUDA); no context is created."""
    return status().devices


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


def _nvml_handle(device: DeviceInfo) -> Any:
    nvml = _require_nvml()
    if device.uuid:
        return nvml.nvmlDeviceGetHandleByUUID(device.uuid.encode())
    if device.physical_index is None:
        raise CudaUnavailable(f"cuda:{device.index} has no NVML identity")
    return nvml.nvmlDeviceGetHandleByIndex(device.physical_index)


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


class NvmlMemory(NamedTuple):
    """One device's memory as NVML reports it, in bytes, all processes included."""

    total: int
    #: As nvidia-smi shows it: without the driver's own reservation where the driver
    #: reports that reservation (NVML's v2 query, driver 515+).
    used: int
    free: int
    #: What the driver reserves for itself; ``None`` where the driver does not say.
    driver_reserved: int | None


def nvml_memory_info(device: DeviceInfo) -> NvmlMemory:
    """The whole device's memory (:class:`NvmlMemory`), every process included.

    Uses NVML's v2 memory query where the driver has it (driver 515+), else v1, whose
    ``used`` includes the driver's reservation (gpustat#141). Raises
    :class:`CudaUnavailable` when NVML is missing or the query fails.
    """
    nvml = _require_nvml()
    try:
        handle = _nvml_handle(device)
        version = getattr(nvml, "nvmlMemory_v2", None)
        if version is not None:
            with contextlib.suppress(nvml.NVMLError, TypeError, AttributeError):
                info = nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
                return NvmlMemory(
                    int(info.total), int(info.used), int(info.free), int(info.reserved)
                )
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
    except nvml.NVMLError as exc:
        raise CudaUnavailable(
            f"NVML could not read the memory of cuda:{device.index}: {exc}"
        ) from None
    return NvmlMemory(int(info.total), int(info.used), int(info.free), None)


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
