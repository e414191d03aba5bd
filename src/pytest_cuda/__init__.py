"""pytest_cuda: a pytest plugin for CUDA test suites.

The plugin itself is :mod:`pytest_cuda.plugin`, loaded through the ``pytest11`` entry
point (disable it with ``-p no:cuda``). Importing this package imports neither torch
nor NVML; the names below are loaded on first use.

* :func:`no_cuda_leak` — ``with no_cuda_leak(): ...`` fails when the block leaves CUDA
  memory allocated (:class:`CudaLeakError`, or :class:`CudaLeakWarning` in
  ``mode="warn"``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_cuda.leaks.block import CudaLeakError, CudaLeakWarning, no_cuda_leak

__all__ = ["CudaLeakError", "CudaLeakWarning", "no_cuda_leak"]

_LAZY = {
    "no_cuda_leak": "pytest_cuda.leaks.block",
    "CudaLeakError": "pytest_cuda.leaks.result",
    "CudaLeakWarning": "pytest_cuda.leaks.result",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pytest_cuda' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
