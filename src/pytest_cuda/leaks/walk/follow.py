"""One step of the holder walk: what an object that refers to a node of the walk is, a
root a person recognises (a module global, a class attribute, a ``functools.lru_cache``,
a closure cell, a pytest fixture's value; a library's: "library cache") or the next
node up. Shared by the walk up (:mod:`pytest_cuda.leaks.walk.holders`) and the walk
down (:mod:`pytest_cuda.leaks.walk.down`), so both name a path by the same rules. Pure
Python.
"""

from __future__ import annotations

import functools
import os
import types

from pytest_cuda.leaks.walk.paths import key_of, render, step_between
from pytest_cuda.leaks.walk.roots import (
    closure_owner,
    fixture_name,
    is_library,
    is_test_instance,
    named_by_module,
    test_instances_in_keys,
)
from pytest_cuda.leaks.walk.state import Budget, Node, Target

__all__ = ["LIBRARY", "follow", "frame_root"]

#: The kind of a holder that is a library's cache, kept by design.
LIBRARY = "library cache"


def follow(
    ref: object, child: object, node: Node, modules: dict[int, str], budget: Budget
) -> Node | None:
    """``ref`` refers to ``child`` (a node of the walk): a root (recorded on the node's
    target), or the next node up, or ``None`` for a link the walk does not follow."""
    target = node.target
    through = set(node.through)
    if is_test_instance(child):
        through.add(type(child).__qualname__)
    note = _through_note(through)
    if isinstance(ref, dict) and id(ref) in modules:
        module = modules[id(ref)]
        key = key_of(ref, child)
        path = render(module, [("attr", key), *node.steps])
        kind = LIBRARY if is_library(module) else "module global"
        _root(target, path, kind, note, alive=True)
        return None
    if isinstance(ref, functools._lru_cache_wrapper):
        name = f"{getattr(ref, '__module__', '?')}.{getattr(ref, '__qualname__', '?')}"
        keyed = test_instances_in_keys(ref)
        if keyed:
            through.update(keyed)
            note = _through_note(through) + (
                f"; its keys hold {', '.join(sorted(keyed))} instances, so the cache keeps "
                "each test instance and what it holds"
            )
        kind = LIBRARY if is_library(name) else "functools.lru_cache"
        # A bounded cache holds results in its own links (one step); functools.cache
        # in a dict, whose key step the walk already has.
        if isinstance(child, dict):
            where, steps = f"{name}.cache", node.steps
        elif isinstance(child, list | tuple) and any(is_test_instance(x) for x in child):
            where, steps = f"{name}.cache key", node.steps  # the arguments, self first
        else:
            where, steps = f"{name}.cache", [("key", "…"), *node.steps]
        _root(target, render(where, steps), kind, note, alive=named_by_module(ref))
        return None
    if isinstance(ref, types.CellType) and not budget.spent():
        owner = closure_owner(ref)
        if owner is not None:
            function, variable = owner
            name = f"{function.__module__}.{function.__qualname__}"
            kind = LIBRARY if is_library(function.__module__) else "closure cell"
            path = render(f"{name} closure variable {variable!r}", node.steps)
            _root(target, path, kind, note, alive=named_by_module(function))
            return None
    fixture = fixture_name(ref)
    if fixture is not None:
        # FixtureDef.__dict__['cached_result'][0] is the value.
        steps = node.steps
        if steps[:2] == [("key", "cached_result"), ("index", 0)]:
            steps = steps[2:]
        _root(target, render(f"fixture {fixture}", steps), "pytest fixture value", note, True)
        return None
    step = step_between(ref, child)
    if step is None:
        return None
    if step[0] == "dictof" and isinstance(ref, type):
        # The class's own __dict__: a class attribute, a root.
        name = f"{ref.__module__}.{ref.__qualname__}"
        kind = LIBRARY if is_library(ref.__module__) else "class attribute"
        _root(target, render(name, [step, *node.steps]), kind, note, named_by_module(ref))
        return None
    return Node(ref, [step, *node.steps], target, through, node.origin)


def frame_root(frame: types.FrameType, child: object, node: Node) -> None:
    """A variable of ``frame`` holds ``child``: the root of ``node``'s path (a value on
    the frame's stack, not in a variable, names nothing)."""
    try:
        name = next((k for k, v in frame.f_locals.items() if v is child), None)
    except Exception:  # a frame whose locals cannot be read
        return
    if name is None:
        return
    code = frame.f_code
    where = f"{os.path.basename(code.co_filename)}:{frame.f_lineno}"
    kind = f"local variable of {code.co_name} at {where}"
    _root(node.target, render(name, node.steps), kind, _through_note(set(node.through)))


def _root(target: Target, path: str, kind: str, note: str, alive: bool = False) -> None:
    target.path, target.kind, target.note = path, kind, note.lstrip("; ")
    target.alive = alive


def _through_note(through: set[str]) -> str:
    return f"through a {', '.join(sorted(through))} instance" if through else ""
