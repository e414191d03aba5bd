"""The walk down: from every module's namespace to the leaked tensors the walk up did
not reach.

Objects :func:`gc.freeze` froze are invisible to :func:`gc.get_referrers`, so to the
walk up (:mod:`pytest_cuda.leaks.walk.up`), not to :func:`gc.get_referents`: this walk
goes down the references, breadth first, and names a path it finds by the walk up's
rules (:func:`~pytest_cuda.leaks.walk.follow.follow`). Pure Python.
"""

from __future__ import annotations

import gc
import sys
import types
from typing import TYPE_CHECKING

from pytest_cuda.leaks.walk.follow import follow
from pytest_cuda.leaks.walk.paths import referents
from pytest_cuda.leaks.walk.state import Budget, Node, Target

if TYPE_CHECKING:
    from pytest_cuda.leaks.walk.graphs import Facts

__all__ = ["walk_down"]


def walk_down(
    targets: dict[tuple[str, int], Target], facts: Facts, budget: Budget, unshown: bool
) -> bool:
    """From every module's namespace down the references (:func:`referents`),
    breadth first, to the leaked tensors the walk up did not reach (objects frozen by
    :func:`gc.freeze` are invisible to :func:`gc.get_referrers`, not to this walk); with
    ``unshown``, every object is asked (``facts``) whether it is a leaked tensor too. A
    path found is named by the walk up's rules (:func:`~pytest_cuda.leaks.walk.follow.follow`).
    ``False`` when its time ran out before it found everything or went through the
    whole heap."""
    modules = {id(vars(m)): name for name, m in list(sys.modules.items()) if m is not None}
    pending = {id(obj): t for t in targets.values() if not t.path for obj in (t.obj, *t.others)}
    parent: dict[int, object] = {}  # id(object) -> the object it was reached from
    layer: list[object] = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and id(namespace) not in parent:
            parent[id(namespace)] = None
            layer.append(namespace)
    own = {id(parent), id(layer), id(targets), id(pending)}
    while layer:
        following: list[object] = []
        own.add(id(following))
        for obj in layer:
            if budget.spent():
                return False
            try:
                children = referents(obj)
            except Exception:
                continue
            for child in children:
                if id(child) in parent or id(child) in own:
                    continue
                parent[id(child)] = obj
                target = pending.pop(id(child), None)
                if target is None and unshown and not isinstance(child, type | types.ModuleType):
                    try:
                        fact = facts(child)
                    except Exception:
                        fact = None
                    if fact is not None and fact[0] not in targets:
                        target = targets[fact[0]] = Target(child, fact[0], fact[1], fact[2])
                if target is not None:
                    _place(target, child, parent, modules, budget)
                    if not unshown and all(t.path for t in pending.values()):
                        return True
                if gc.is_tracked(child):
                    following.append(child)
        layer = following
    return True


def _place(
    target: Target,
    found: object,
    parent: dict[int, object],
    modules: dict[int, str],
    budget: Budget,
) -> None:
    """Name the path the walk down found to ``found`` (a tensor of ``target``), by
    following it back up as the walk up would have."""
    node: Node | None = Node(found, [], target)
    while node is not None and not target.path:
        ref = parent.get(id(node.obj))
        if ref is None:
            return
        node = follow(ref, node.obj, node, modules, budget)
