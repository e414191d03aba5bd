"""gpumagic: IPython magics that time and profile GPU work correctly.

Load it in IPython or Jupyter with ``%load_ext gpumagic``. Importing this package is
free: torch is imported on the first CUDA use and IPython when the extension loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

__version__ = "0.1.0.dev0"
__all__ = ["__version__", "compare", "load_ipython_extension", "unload_ipython_extension"]

# Each entry: a module holding IPython glue, with ``register(shell)`` that registers
# its Magics class. Imported only when the extension loads.
_MAGIC_MODULES: tuple[str, ...] = (
    "gpumagic.memory_magics",
    "gpumagic.timing_magics",
    "gpumagic.lprun_magics",
)


def load_ipython_extension(ipython: InteractiveShell) -> None:
    """Register gpumagic's magics on ``ipython`` (``%load_ext gpumagic``)."""
    for name in _MAGIC_MODULES:
        importlib.import_module(name).register(ipython)


def unload_ipython_extension(ipython: InteractiveShell) -> None:
    """Undo :func:`load_ipython_extension` (``%unload_ext gpumagic``)."""
    for name in reversed(_MAGIC_MODULES):
        module = importlib.import_module(name)
        unregister = getattr(module, "unregister", None)
        if unregister is not None:
            unregister(ipython)


def __getattr__(name: str) -> Any:
    """``gpumagic.compare``, imported on first use (importing gpumagic stays free)."""
    if name == "compare":
        from gpumagic.timing_result import compare

        return compare
    raise AttributeError(f"module 'gpumagic' has no attribute {name!r}")
