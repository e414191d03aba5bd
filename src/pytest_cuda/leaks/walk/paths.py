"""How one object reaches another, and how a path of such steps is written.

The holder walk (:mod:`pytest_cuda.leaks.walk.holders`) goes up from a leaked tensor one
referrer at a time; each step says how the referrer reaches the object below it (a key,
an index, an attribute), and :func:`render` writes the steps as the Python expression
a person would type: ``mymod._cache['x'][3].weight``. Pure Python, no torch.
"""

from __future__ import annotations

import functools
import gc
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["Step", "key_of", "referents", "render", "step_between"]

Step = tuple[str, Any]  # ("key", k) | ("index", i) | ("attr", name) | ("dictof", None) | ...


def referents(obj: object) -> list[Any]:
    """What ``obj`` refers to (:func:`gc.get_referents`); of a module, its namespace only.

    A module's C state is never read: on CPython 3.12.0-3.12.5 the ``_asyncio`` module
    hands out the freed future iterators of its free list there (CPython gh-122695), and
    touching them corrupts the heap: a later collection crashes the process or never
    ends. What a module holds for Python code is in its namespace."""
    if isinstance(obj, types.ModuleType):
        namespace = getattr(obj, "__dict__", None)
        return [namespace] if isinstance(namespace, dict) else []
    return gc.get_referents(obj)


def step_between(ref: object, child: object) -> Step | None:
    """How ``ref`` reaches ``child``, or ``None`` for a link the walk does not follow."""
    if isinstance(ref, dict):
        return ("key", key_of(ref, child))
    if isinstance(ref, list | tuple):
        for index, item in enumerate(ref):
            if item is child:
                return ("index", index)
        return None
    if isinstance(ref, set | frozenset):
        return ("member", None)
    if isinstance(ref, types.MethodType):
        return ("bound", ref.__name__)
    if isinstance(ref, functools.partial):
        for name in ("args", "keywords", "func"):
            if getattr(ref, name) is child:
                return ("partial", (getattr(ref.func, "__qualname__", "?"), name))
        return None
    if isinstance(ref, types.FunctionType | types.ModuleType | types.CodeType):
        return None  # globals and defaults are reached through their module
    if isinstance(ref, type):
        # A class reaches its attributes through the dict behind its mappingproxy.
        if isinstance(child, dict) and any(d is child for d in gc.get_referents(vars(ref))):
            return ("dictof", None)
        return None
    if getattr(ref, "__dict__", None) is child:
        return ("dictof", None)
    attributes = _instance_attributes(ref)
    for name, value in attributes.items():
        if value is child:
            return ("attr", name)
    for name in _slot_names(type(ref)):
        try:
            if getattr(ref, name) is child:
                return ("attr", name)
        except Exception:
            continue
    return ("via", type(ref).__qualname__)


def key_of(mapping: dict[Any, Any], child: object) -> object:
    try:
        for key, value in mapping.items():
            if value is child:
                return key
            if key is child:
                return "<key>"
    except Exception:
        return "?"
    return "?"


def render(root: str, steps: Sequence[Step]) -> str:
    text = root
    index = 0
    while index < len(steps):
        kind, value = steps[index]
        if kind == "dictof" and index + 1 < len(steps) and steps[index + 1][0] == "key":
            text += f".{steps[index + 1][1]}"
            index += 2
            continue
        if kind == "attr":
            text += f".{value}"
        elif kind == "key":
            text += "[…]" if value == "…" else f"[{value!r}]"
        elif kind == "index":
            text += f"[{value}]"
        elif kind == "member":
            text += " (a set member)"
        elif kind == "bound":
            text += f" (bound method .{value})"
        elif kind == "partial":
            text += f" (functools.partial of {value[0]}).{value[1]}"
        elif kind == "via":
            text += f" → a {value}"
        elif kind == "graph":
            text += str(value)
        index += 1
    return text


def _instance_attributes(obj: object) -> dict[str, Any]:
    """An instance's attributes (since Python 3.11 they may live in the object itself,
    with no dict object in between for the walk to meet)."""
    try:
        found = object.__getattribute__(obj, "__dict__")
    except Exception:
        return {}
    return found if isinstance(found, dict) else {}


def _slot_names(cls: type) -> list[str]:
    names: list[str] = []
    for klass in getattr(cls, "__mro__", ()):
        slots = vars(klass).get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    return [n for n in names if n not in ("__dict__", "__weakref__")]
