"""What the holder walk takes for a root, and for a test's own object.

A module's global, a class attribute, a ``functools.lru_cache``, a closure cell, a
pytest fixture's value end a path of :mod:`pytest_cuda.leaks.walk.holders`; a library's
(an installed package's, by :class:`gpumagic.stacks.FrameFilter`'s one rule) is kept by
design. A path that ends at an object no Python object refers to starts where C++
holds it (:func:`held_from_outside`): the hooks of an autograd node, a custom autograd
Function's ``ctx``. Pure Python over the objects it is given.
"""

from __future__ import annotations

import collections
import gc
import sys
import types
import unittest

from gpumagic.stacks import FrameFilter

__all__ = [
    "closure_owner",
    "fixture_name",
    "held_from_outside",
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


def held_from_outside(obj: object) -> tuple[int, str]:
    """How to name ``obj``, which no Python object refers to although it is alive (C++
    holds it, or a variable of a running function), and a rank: what says more first
    (0: a recognised holder, 1: any other object).

    torch keeps the hooks registered on an autograd node (``grad_fn.register_hook``) in
    a dict of hook handle ids that only the node holds, and a custom Function's ``ctx``
    is held by its graph alone: a path through either is a reference cycle the garbage
    collector cannot see when a tensor of that graph is on it."""
    cls = type(obj)
    names = {klass.__name__ for klass in cls.__mro__}
    if "BackwardCFunction" in names:
        function = cls.__name__.removesuffix("Backward")
        return 0, f"the ctx of autograd Function {function} (only its autograd graph holds it)"
    if type(obj) is collections.OrderedDict and obj and _hook_dict(obj):
        return 0, "hooks of an autograd node (an OrderedDict of hook ids that only C++ holds)"
    return 1, f"a {cls.__qualname__} that no Python object holds (C++ does, or a running function)"


def _hook_dict(mapping: dict[object, object]) -> bool:
    """``{hook id: hook}``: torch's ``RemovableHandle`` ids, callables (torch's
    ``_HookMixin._register_hook`` makes an ``OrderedDict`` of them for a node)."""
    try:
        return all(type(k) is int and callable(v) for k, v in mapping.items())
    except Exception:
        return False
