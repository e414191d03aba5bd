"""What the holder walk takes for a root, and for a test's own object.

A module's global, a class attribute, a ``functools.lru_cache``, a closure cell, a
pytest fixture's value end a path of :mod:`pytest_cuda.leak_holders`; a library's
(an installed package's, by :class:`gpumagic.stacks.FrameFilter`'s one rule) is kept by
design. Pure Python over the objects it is given.
"""

from __future__ import annotations

import gc
import sys
import types
import unittest

from gpumagic.stacks import FrameFilter

__all__ = [
    "closure_owner",
    "fixture_name",
    "is_library",
    "is_test_instance",
    "named_by_module",
    "test_instances_in_keys",
]


def named_by_module(obj: object) -> bool:
    """``obj`` is what its module's namespace names by its qualified name (a class, a
    function, a cache defined at module or class level): alive while the module is."""
    module = sys.modules.get(str(getattr(obj, "__module__", "") or ""))
    qualname = str(getattr(obj, "__qualname__", "") or "")
    if module is None or not qualname or "<locals>" in qualname:
        return False
    found: object = module
    for part in qualname.split("."):
        try:
            # The namespace's own entry, not what a descriptor would give back.
            found = object.__getattribute__(found, "__dict__")[part]
        except (AttributeError, KeyError, TypeError):
            return False
    return found is obj


def is_library(module: str) -> bool:
    return FrameFilter.default().is_library_module(module)  # the one rule, in stacks.py


def is_test_instance(obj: object) -> bool:
    cls = type(obj)
    return isinstance(obj, unittest.TestCase) or (
        cls.__name__.startswith("Test") and cls.__module__ not in ("builtins",)
    )


def test_instances_in_keys(wrapper: object) -> set[str]:
    found: set[str] = set()
    try:
        for part in gc.get_referents(wrapper):
            if isinstance(part, list | tuple):
                found.update(type(x).__qualname__ for x in part if is_test_instance(x))
    except Exception:
        return found
    return found


def closure_owner(cell: types.CellType) -> tuple[types.FunctionType, str] | None:
    for closure in gc.get_referrers(cell):
        if not isinstance(closure, tuple):
            continue
        for function in gc.get_referrers(closure):
            if isinstance(function, types.FunctionType) and function.__closure__ is closure:
                index = closure.index(cell)
                return function, function.__code__.co_freevars[index]
    return None


def fixture_name(ref: object) -> str | None:
    """A pytest ``FixtureDef``'s cached result holds the value: name the fixture."""
    cls = type(ref)
    if cls.__name__ != "FixtureDef" or not cls.__module__.startswith("_pytest"):
        return None
    return f"'{getattr(ref, 'argname', '?')}' ({getattr(ref, 'scope', '?')} scope)"
