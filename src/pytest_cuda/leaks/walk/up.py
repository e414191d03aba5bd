"""The walk up: from every leaked tensor up the referrers to a root, all at once.

Each step scans the heap once (:func:`gc.get_referrers`) for the objects of every path;
while the heap that existed before the test is frozen, only the test's own objects
(:mod:`pytest_cuda.leaks.walk.young`), and the objects something outside them holds
too wait for the whole heap. Each reference met is followed by
:func:`~pytest_cuda.leaks.walk.follow.follow`'s rules. Pure Python.
"""

from __future__ import annotations

import gc
import sys
import types
from typing import TYPE_CHECKING

from pytest_cuda.leaks.walk.follow import follow
from pytest_cuda.leaks.walk.graphs import Saved
from pytest_cuda.leaks.walk.paths import referents
from pytest_cuda.leaks.walk.state import Boundary, Budget, Node, Target, ended
from pytest_cuda.leaks.walk.young import young_referrers

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["MAX_DEPTH", "MAX_FRONTIER", "walk_up"]

#: How far up the walk goes, and how many objects one level may hold.
MAX_DEPTH = 16
MAX_FRONTIER = 2_000


def walk_up(
    targets: list[Target],
    notes: list[str],
    budget: Budget,
    ignore: Iterable[int] = (),
    boundary: Boundary | None = None,
) -> None:
    """Up from every target to a root, all targets a step at a time. While the
    ``boundary`` is young, a step scans only the test's objects, and the objects that
    something outside them holds too wait; once no young step is left, the heap is
    thawed and they go on, scanning the whole heap."""
    modules = {id(vars(m)): name for name, m in list(sys.modules.items()) if m is not None}
    layer = [Node(obj, [], t) for t in targets for obj in (t.obj, *t.others)]
    seen = {(id(n.obj), id(n.target)) for n in layer}  # (object, target): each target's walk
    own = {id(layer), id(targets), id(seen), *ignore, *(id(t.others) for t in targets)}
    waiting: list[Node] = []  # held from outside the young objects: for the whole heap
    own.add(id(waiting))
    too_long = False
    while True:
        layer = [n for n in layer if not n.target.path]
        too_long = too_long or any(len(n.steps) >= MAX_DEPTH for n in layer)
        layer = [n for n in layer if len(n.steps) < MAX_DEPTH]
        if not layer and waiting and boundary is not None:
            boundary.thaw()
            layer, waiting = [n for n in waiting if not n.target.path], []
        if not layer or budget.spent():
            break
        young = boundary is not None and boundary.young
        by_id: dict[int, list[Node]] = {}
        for node in layer:
            by_id.setdefault(id(node.obj), []).append(node)
        # Each object once: a scan of the whole heap costs more with every one asked for.
        nodes = tuple(group[0].obj for group in by_id.values())
        own.add(id(nodes))
        if young:
            referrers, outside = young_referrers(nodes)
            waiting.extend(n for n in layer if id(n.obj) in outside)
        else:
            referrers = gc.get_referrers(*nodes)
        own.add(id(referrers))
        following, held = _step_up(
            referrers, by_id, own=own, seen=seen, modules=modules, budget=budget
        )
        if not young:
            # The whole heap was scanned: what nothing refers to, C++ holds.
            for key in by_id.keys() - held:
                for node in by_id[key]:
                    ended(node)
        # No variable of this frame may hold an object of the next step while the young
        # step counts its references.
        del referrers, nodes
        if len(following) > MAX_FRONTIER:
            notes.append(f"the walk kept the first {MAX_FRONTIER} of {len(following)} paths")
            following = following[:MAX_FRONTIER]
        layer = following
    if too_long:
        notes.append(f"some paths were longer than {MAX_DEPTH} steps")


def _step_up(
    referrers: list[object],
    by_id: dict[int, list[Node]],
    *,
    own: set[int],
    seen: set[tuple[int, int]],
    modules: dict[int, str],
    budget: Budget,
) -> tuple[list[Node], set[int]]:
    """One step up from the nodes ``by_id`` (by their object's id) through their
    ``referrers``: the nodes of the next step, and the ids of the objects something
    other than the walk refers to (a running function's frame included)."""
    following: list[Node] = []
    held: set[int] = set()
    for ref in referrers:
        if id(ref) in own or isinstance(ref, Target | Node | Saved):
            continue
        children = _children_in(ref, by_id)
        held.update(map(id, children))
        if isinstance(ref, types.FrameType):
            continue
        for child in children:
            for node in by_id[id(child)]:
                if node.target.path:
                    continue
                step = follow(ref, child, node, modules, budget)
                # A root ends a path however often it is met; an object in between is
                # walked from once per target.
                if step is not None and (id(ref), id(node.target)) not in seen:
                    seen.add((id(ref), id(node.target)))
                    following.append(step)
    return following, held


def _children_in(ref: object, by_id: dict[int, list[Node]]) -> list[object]:
    try:
        return [child for child in referents(ref) if id(child) in by_id]
    except Exception:
        return []
