"""gpumagic: IPython magics that time and profile GPU work correctly.

Load it in IPython or Jupyter with ``%load_ext gpumagic``. Importing this package is
free: torch is imported on the first CUDA use and IPython when the extension loads.
"""

from __future__ import annotations

import importlib
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

__version__ = "0.1.0.dev0"
__all__ = ["__version__", "compare", "load_ipython_extension", "unload_ipython_extension"]

# Each entry: a module holding IPython glue, whose ``MAGICS`` is its Magics class (and
# whose optional ``unregister(shell)`` stops what it started). Imported only when the
# extension loads.
_MAGIC_MODULES: tuple[str, ...] = (
    "gpumagic.memory_magics",
    "gpumagic.timing_magics",
    "gpumagic.lineprof_magics",
)

# Per shell: the magics of other extensions that loading gpumagic replaced (line
# profiler's %lprun), put back on unload.
_REPLACED: weakref.WeakKeyDictionary[Any, dict[tuple[str, str], Any]] = weakref.WeakKeyDictionary()


def load_ipython_extension(ipython: InteractiveShell) -> None:
    """Register gpumagic's magics on ``ipython`` (``%load_ext gpumagic``). A magic of
    another extension under the same name (line_profiler's ``%lprun``) is replaced,
    which is said in one line, and put back by ``%unload_ext gpumagic``."""
    table = ipython.magics_manager.magics
    replaced = _REPLACED.setdefault(ipython, {})
    for name in _MAGIC_MODULES:
        magics = importlib.import_module(name).MAGICS
        for kind, names in magics.magics.items():
            for magic in names:
                found = table[kind].get(magic)
                owner = getattr(found, "__self__", None)
                if found is None or isinstance(owner, magics):
                    continue
                replaced.setdefault((kind, magic), found)
                prefix = "%" if kind == "line" else "%%"
                print(
                    f"gpumagic: {prefix}{magic} replaces {_origin(found)}'s "
                    "(%unload_ext gpumagic puts it back)"
                )
        ipython.register_magics(magics)


def unload_ipython_extension(ipython: InteractiveShell) -> None:
    """Undo :func:`load_ipython_extension` (``%unload_ext gpumagic``): every magic and
    hook of gpumagic is removed, and the magics it replaced are put back."""
    table = ipython.magics_manager.magics
    replaced = _REPLACED.pop(ipython, {})
    for name in reversed(_MAGIC_MODULES):
        module = importlib.import_module(name)
        unregister = getattr(module, "unregister", None)
        if unregister is not None:
            unregister(ipython)
        magics = module.MAGICS
        for kind, names in magics.magics.items():
            for magic in names:
                if isinstance(getattr(table[kind].get(magic), "__self__", None), magics):
                    del table[kind][magic]
                    if (kind, magic) in replaced:
                        table[kind][magic] = replaced[(kind, magic)]
        ipython.magics_manager.registry.pop(magics.__name__, None)


def _origin(magic: Any) -> str:
    """The package a magic comes from (``line_profiler``), for the user."""
    module = getattr(getattr(magic, "__self__", magic), "__module__", None) or "another extension"
    return str(module).split(".")[0]


def __getattr__(name: str) -> Any:
    """``gpumagic.compare``, imported on first use (importing gpumagic stays free)."""
    if name == "compare":
        from gpumagic.timing_compare import compare

        return compare
    raise AttributeError(f"module 'gpumagic' has no attribute {name!r}")
