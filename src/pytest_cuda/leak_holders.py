"""Who holds leaked memory: from each leaked tensor up to a root a person recognises.

Runs only for a test already judged leaking. The walk goes *up* the references
(:func:`gc.get_referrers`, one heap scan per level for all tensors at once) to a root: a
module global (``mymod._cache['x']``), a class attribute, a ``functools.lru_cache``
(saying when its keys hold test instances), a closure cell, a pytest fixture's value,
or a library's global ("library cache": by design, not the user's leak). Tensors an
autograd graph saved are found from the graph's owner (``loss.grad_fn._saved_*``).
Objects :func:`gc.freeze` hid from the walk up are searched *down* from the modules.
What no Python object reaches is said to be so.

Pure Python over objects it is given: no torch import, no CUDA call (tensor facts come
from a function passed in; which tensors own autograd graphs, from the seam's
:func:`gpumagic.cuda.graph_owners`). Every failure to inspect an object is noted.
"""

from __future__ import annotations

import functools
import gc
import sys
import time
import types
import unittest
import warnings
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from gpumagic import cuda
from gpumagic.stacks import FrameFilter
from gpumagic.units import format_bytes
from pytest_cuda.leak_paths import Step, key_of, referents, render, step_between

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    #: ``facts(obj)``: ``(storage key, bytes, device)`` of a leaked tensor, else None.
    Facts = Callable[[object], tuple[tuple[str, int], int, str] | None]
    #: ``explain(key, searched)``: the ``(path, kind)`` of a storage no root reached;
    #: ``searched``: nothing was out of the walk's sight (no time limit, nothing frozen).
    Explain = Callable[[tuple[str, int], bool], tuple[str, str] | None]

__all__ = [
    "LIBRARY",
    "NO_TENSOR",
    "LeakHolder",
    "LeakHolderScan",
    "find_leak_holders",
    "holder_order",
]

#: The kind of a holder that is a library's cache, kept by design.
LIBRARY = "library cache"
NO_TENSOR = "no Python tensor object shows the leaked blocks"

#: How far up the walk goes, and how many objects one level may hold.
MAX_DEPTH = 12
MAX_FRONTIER = 2_000
#: How many autograd graph nodes are read when looking for saved tensors.
MAX_GRAPH_NODES = 20_000


@dataclass(frozen=True)
class LeakHolder:
    """One root that keeps leaked tensors alive, and how much it holds."""

    path: str
    kind: str
    nbytes: int
    devices: tuple[str, ...]
    tensors: int = 1
    note: str = ""
    #: The root is certainly alive (a module's global, a fixture's value, or an object
    #: its module names), so what it holds is no garbage waiting for a collection.
    alive: bool = False

    def describe(self) -> str:
        where = ", ".join(self.devices)
        count = f" ({self.tensors} tensor" + ("s)" if self.tensors != 1 else ")")
        note = f"; {self.note}" if self.note else ""
        count = count if self.tensors else ""
        return f"{format_bytes(self.nbytes)}{count} on {where}: {self.path} ({self.kind}{note})"


@dataclass(frozen=True)
class LeakHolderScan:
    """What the walk found: holders, largest first, and what it could not see."""

    holders: tuple[LeakHolder, ...]
    notes: tuple[str, ...] = ()
    #: Bytes that live tensors show: of the leaked blocks they lie in (when the walk was
    #: given blocks), else of the storages Python objects reach.
    found: int = 0
    #: The walk ran to its end (``False``: its time budget ran out first).
    complete: bool = True
    #: Objects frozen by ``gc.freeze()`` when it ran: invisible to it.
    hidden: int = 0

    @property
    def alive(self) -> bool:
        """Every holder is a root known to be alive: no collection could free them."""
        return self.complete and bool(self.holders) and all(h.alive for h in self.holders)

    def first(self) -> str | None:
        """``"mymod.CACHE['x'] (module global)"`` for the largest holder that Python
        objects reach, ``None`` when none does."""
        if not self.holders or self.holders[0].kind.startswith("C++"):
            return None
        top = self.holders[0]
        return f"{top.path} ({top.kind})"


@dataclass(slots=True)
class _Target:
    """One leaked storage: a tensor that shows it, its size and device."""

    obj: object
    key: tuple[str, int]
    nbytes: int
    device: str
    tensors: int = 1
    path: str = ""
    kind: str = ""
    note: str = ""
    alive: bool = False


class _Budget:
    """The walk's time limit: ``spent()`` once it is over (never, without a limit)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds, self.ran_out = seconds, False
        self.deadline = None if seconds is None else time.perf_counter() + seconds

    def spent(self) -> bool:
        self.ran_out = self.ran_out or (
            self.deadline is not None and time.perf_counter() > self.deadline
        )
        return self.ran_out


@dataclass(slots=True)
class _Node:
    obj: object
    steps: list[Step]
    target: _Target
    through: set[str] = field(default_factory=set)


def find_leak_holders(
    objects: Sequence[object],
    facts: Facts,
    explain: Explain | None = None,
    *,
    budget_s: float | None = None,
    covered: Callable[[], bool] | None = None,
    frozen_before: int | None = None,
) -> LeakHolderScan:
    """Walk from every leaked storage among ``objects`` to its root.

    ``facts(obj)`` answers ``(storage key, bytes, device)`` for a leaked tensor (views
    of one storage share the key) and ``None`` for anything else; ``objects`` is where
    to look for the tensors (``gc.get_objects()``, or what a test made); the walk up
    goes through the whole heap. ``explain(key, searched)`` may name the ``(path,
    kind)`` of a storage the walk found no root for (``searched``: it looked
    everywhere). ``budget_s``: the walk stops after about this
    long (each step up scans the heap once), saying so. ``covered()``: the tensors
    found so far account for every leaked block, so autograd graphs need not be read
    for saved tensors. ``frozen_before``: how many objects :func:`gc.freeze` had
    frozen when the leaked memory began to be allocated (Python 3.12 freezes a few
    hundred at start-up); only a freeze since then can hide the leaked tensors
    themselves (``None``: any may). Never raises: what cannot be inspected is in
    :attr:`LeakHolderScan.notes`.
    """
    notes: list[str] = []
    targets: dict[tuple[str, int], _Target] = {}
    budget = _Budget(budget_s)
    hidden = 0  # frozen objects that may hide what the walk did not find
    try:
        # Reading arbitrary objects can warn (deprecated module attributes): not the
        # user's warnings to see.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            targets.update(_targets(objects, facts))
            _walk_up(list(targets.values()), notes, budget, ignore={id(objects)})
            if covered is None or not covered():
                _saved_by_graphs(objects, targets, facts, notes, budget)
            hidden = _search_frozen(targets, facts, budget, covered, frozen_before)
        if not targets:
            notes.append(NO_TENSOR)
    except Exception as exc:  # the report must come out whatever the heap holds
        notes.append(f"the walk stopped: {type(exc).__name__}: {exc}")
    if budget.ran_out:
        notes.append(
            f"the walk stopped at its {budget.seconds:g} s limit "
            "(--cuda-leak-trace walks to the end)"
        )
    if hidden:
        notes.append(
            f"{hidden} objects frozen by gc.freeze() are invisible to the walk: a holder "
            "among them is reported as unreachable"
        )
    # Whether the walk searched everything: where it did not, what it did not reach may
    # have a holder it did not get to, which ``explain`` must not pass for a library's.
    searched = not budget.ran_out and not hidden
    scan = _scan(list(targets.values()), notes, explain, searched)
    return replace(scan, complete=not budget.ran_out, hidden=hidden)


def _search_frozen(
    targets: dict[tuple[str, int], _Target],
    facts: Facts,
    budget: _Budget,
    covered: Callable[[], bool] | None,
    frozen_before: int | None,
) -> int:
    """Search what :func:`gc.freeze` hid from the walk up (:func:`_walk_down`) where it
    may matter; how many objects stayed unsearched (0: none)."""
    frozen = gc.get_freeze_count()
    unplaced = any(not t.path for t in targets.values())
    unshown = not covered() if covered is not None else not targets
    # Only a freeze since frozen_before hides leaked tensors; an older one (Python 3.12's
    # start-up objects) a holder only if the test changed it: searched without a limit.
    later = frozen_before is None or frozen > frozen_before
    unshown = unshown and later
    if not frozen or not (unplaced or unshown) or not (later or budget.seconds is None):
        return 0
    return 0 if _walk_down(targets, facts, budget, unshown) else frozen


def holder_order(holder: LeakHolder) -> tuple[bool, int, str]:
    """Holders that a Python root reaches first, then by size, largest first."""
    return holder.kind.startswith("C++"), -holder.nbytes, holder.path


def _targets(objects: Iterable[object], facts: Facts) -> dict[tuple[str, int], _Target]:
    found: dict[tuple[str, int], _Target] = {}
    for obj in objects:
        try:
            fact = facts(obj)
        except Exception:  # an object whose isinstance or attributes raise
            continue
        if fact is None:
            continue
        key, nbytes, device = fact
        if key in found:
            found[key].tensors += 1
        else:
            found[key] = _Target(obj, key, nbytes, device)
    return found


def _scan(
    targets: list[_Target],
    notes: list[str],
    explain: Explain | None,
    searched: bool,
) -> LeakHolderScan:
    groups: dict[tuple[str, str, str, bool], list[_Target]] = {}
    for target in targets:
        if not target.path:
            explained = explain(target.key, searched) if explain is not None else None
            target.path, target.kind = explained or (
                "no Python object that the walk reached",
                "C++ side or unreachable: a library workspace, or an object cycle",
            )
        groups.setdefault((target.path, target.kind, target.note, target.alive), []).append(target)
    holders = [
        LeakHolder(
            path,
            kind,
            sum(t.nbytes for t in group),
            tuple(sorted({t.device for t in group})),
            sum(t.tensors for t in group),
            note,
            alive,
        )
        for (path, kind, note, alive), group in groups.items()
    ]
    holders.sort(key=holder_order)
    found = sum(t.nbytes for t in targets if not t.kind.startswith("C++"))
    return LeakHolderScan(tuple(holders), tuple(notes), found)


# ---------------------------------------------------------------------------
# The walk up.


def _walk_up(
    targets: list[_Target], notes: list[str], budget: _Budget, ignore: Iterable[int] = ()
) -> None:
    modules = {id(vars(m)): name for name, m in list(sys.modules.items()) if m is not None}
    layer = [_Node(t.obj, [], t) for t in targets]
    seen = {(id(t.obj), id(t)) for t in targets}  # (object, target): each target's own walk
    own = {id(layer), id(targets), id(seen), *ignore}
    for _depth in range(MAX_DEPTH):
        layer = [n for n in layer if not n.target.path]
        if not layer or budget.spent():
            return
        by_id: dict[int, list[_Node]] = {}
        for node in layer:
            by_id.setdefault(id(node.obj), []).append(node)
        nodes = tuple(node.obj for node in layer)
        own.add(id(nodes))
        referrers = gc.get_referrers(*nodes)
        own.add(id(referrers))
        following: list[_Node] = []
        for ref in referrers:
            if id(ref) in own or isinstance(ref, types.FrameType | _Target | _Node):
                continue
            for child in _children_in(ref, by_id):
                for node in by_id[id(child)]:
                    if node.target.path:
                        continue
                    step = _follow(ref, child, node, modules, budget)
                    # A root ends a path however often it is met; an object in between
                    # is walked from once per target.
                    if step is not None and (id(ref), id(node.target)) not in seen:
                        seen.add((id(ref), id(node.target)))
                        following.append(step)
        del referrers, nodes
        if len(following) > MAX_FRONTIER:
            notes.append(f"the walk kept the first {MAX_FRONTIER} of {len(following)} paths")
            following = following[:MAX_FRONTIER]
        layer = following
    if any(not n.target.path for n in layer):
        notes.append(f"some paths were longer than {MAX_DEPTH} steps")


def _walk_down(
    targets: dict[tuple[str, int], _Target], facts: Facts, budget: _Budget, unshown: bool
) -> bool:
    """From every module's namespace down the references (:func:`referents`),
    breadth first, to the leaked tensors the walk up did not reach (objects frozen by
    :func:`gc.freeze` are invisible to :func:`gc.get_referrers`, not to this walk); with
    ``unshown``, every object is asked (``facts``) whether it is a leaked tensor too. A
    path found is named by the walk up's rules (:func:`_follow`). ``False`` when its
    time ran out before it found everything or went through the whole heap."""
    modules = {id(vars(m)): name for name, m in list(sys.modules.items()) if m is not None}
    pending = {id(t.obj): t for t in targets.values() if not t.path}
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
                        target = targets[fact[0]] = _Target(child, fact[0], fact[1], fact[2])
                if target is not None:
                    _place(target, child, parent, modules, budget)
                    if not pending and not unshown:
                        return True
                if gc.is_tracked(child):
                    following.append(child)
        layer = following
    return True


def _place(
    target: _Target,
    found: object,
    parent: dict[int, object],
    modules: dict[int, str],
    budget: _Budget,
) -> None:
    """Name the path the walk down found to ``found`` (a tensor of ``target``), by
    following it back up as the walk up would have."""
    node: _Node | None = _Node(found, [], target)
    while node is not None and not target.path:
        ref = parent.get(id(node.obj))
        if ref is None:
            return
        node = _follow(ref, node.obj, node, modules, budget)


def _children_in(ref: object, by_id: dict[int, list[_Node]]) -> list[object]:
    try:
        return [child for child in referents(ref) if id(child) in by_id]
    except Exception:
        return []


def _follow(
    ref: object, child: object, node: _Node, modules: dict[int, str], budget: _Budget
) -> _Node | None:
    """``ref`` refers to ``child`` (a node of the walk): a root (recorded on the node's
    target), or the next node up, or ``None`` for a link the walk does not follow."""
    target = node.target
    through = set(node.through)
    if _is_test_instance(child):
        through.add(type(child).__qualname__)
    note = _through_note(through)
    if isinstance(ref, dict) and id(ref) in modules:
        module = modules[id(ref)]
        key = key_of(ref, child)
        path = render(module, [("attr", key), *node.steps])
        kind = LIBRARY if _is_library(module) else "module global"
        _root(target, path, kind, note, alive=True)
        return None
    if isinstance(ref, functools._lru_cache_wrapper):
        name = f"{getattr(ref, '__module__', '?')}.{getattr(ref, '__qualname__', '?')}"
        keyed = _test_instances_in_keys(ref)
        if keyed:
            through.update(keyed)
            note = _through_note(through) + (
                f"; its keys hold {', '.join(sorted(keyed))} instances, so the cache keeps "
                "each test instance and what it holds"
            )
        kind = LIBRARY if _is_library(name) else "functools.lru_cache"
        # A bounded cache holds results in its own links (one step); functools.cache
        # in a dict, whose key step the walk already has.
        if isinstance(child, dict):
            where, steps = f"{name}.cache", node.steps
        elif isinstance(child, list | tuple) and any(_is_test_instance(x) for x in child):
            where, steps = f"{name}.cache key", node.steps  # the arguments, self first
        else:
            where, steps = f"{name}.cache", [("key", "…"), *node.steps]
        _root(target, render(where, steps), kind, note, alive=_named_by_module(ref))
        return None
    if isinstance(ref, types.CellType) and not budget.spent():
        owner = _closure_owner(ref)
        if owner is not None:
            function, variable = owner
            name = f"{function.__module__}.{function.__qualname__}"
            kind = LIBRARY if _is_library(function.__module__) else "closure cell"
            path = render(f"{name} closure variable {variable!r}", node.steps)
            _root(target, path, kind, note, alive=_named_by_module(function))
            return None
    fixture = _fixture_name(ref)
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
        kind = LIBRARY if _is_library(ref.__module__) else "class attribute"
        _root(target, render(name, [step, *node.steps]), kind, note, _named_by_module(ref))
        return None
    return _Node(ref, [step, *node.steps], target, through)


def _root(target: _Target, path: str, kind: str, note: str, alive: bool = False) -> None:
    target.path, target.kind, target.note = path, kind, note.lstrip("; ")
    target.alive = alive


def _named_by_module(obj: object) -> bool:
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


def _through_note(through: set[str]) -> str:
    return f"through a {', '.join(sorted(through))} instance" if through else ""


def _is_library(module: str) -> bool:
    return FrameFilter.default().is_library_module(module)  # the one rule, in stacks.py


def _is_test_instance(obj: object) -> bool:
    cls = type(obj)
    return isinstance(obj, unittest.TestCase) or (
        cls.__name__.startswith("Test") and cls.__module__ not in ("builtins",)
    )


def _test_instances_in_keys(wrapper: object) -> set[str]:
    found: set[str] = set()
    try:
        for part in gc.get_referents(wrapper):
            if isinstance(part, list | tuple):
                found.update(type(x).__qualname__ for x in part if _is_test_instance(x))
    except Exception:
        return found
    return found


def _closure_owner(cell: types.CellType) -> tuple[types.FunctionType, str] | None:
    for closure in gc.get_referrers(cell):
        if not isinstance(closure, tuple):
            continue
        for function in gc.get_referrers(closure):
            if isinstance(function, types.FunctionType) and function.__closure__ is closure:
                index = closure.index(cell)
                return function, function.__code__.co_freevars[index]
    return None


def _fixture_name(ref: object) -> str | None:
    """A pytest ``FixtureDef``'s cached result holds the value: name the fixture."""
    cls = type(ref)
    if cls.__name__ != "FixtureDef" or not cls.__module__.startswith("_pytest"):
        return None
    return f"'{getattr(ref, 'argname', '?')}' ({getattr(ref, 'scope', '?')} scope)"


# ---------------------------------------------------------------------------
# Autograd graphs: the tensors a graph saved have no Python object of their own.


def _saved_by_graphs(
    objects: Sequence[object],
    targets: dict[tuple[str, int], _Target],
    facts: Facts,
    notes: list[str],
    budget: _Budget,
) -> None:
    owners = cuda.graph_owners(objects)
    if not owners:
        return
    nodes = MAX_GRAPH_NODES
    probes: list[tuple[_Target, _Target, str]] = []  # (the owner's probe, target, where)
    for owner, grad_fn in owners:
        probe = _Target(owner, ("graph", id(owner)), 0, "")
        stack: list[tuple[object, str]] = [(grad_fn, f".grad_fn ({type(grad_fn).__name__})")]
        visited: set[int] = set()
        while stack and nodes > 0 and not budget.spent():
            node, where = stack.pop()
            if id(node) in visited:
                continue
            visited.add(id(node))
            nodes -= 1
            for name in _saved_names(node):
                try:
                    saved = getattr(node, name)
                    fact = facts(saved)
                except Exception:
                    continue
                if fact is None:
                    continue
                target = targets.get(fact[0])
                if target is None:
                    target = targets[fact[0]] = _Target(saved, fact[0], fact[1], fact[2])
                if target.path and not target.kind.startswith("C++"):
                    continue
                target.path = "…"  # placed below, once the owners' walk is done
                probes.append((probe, target, f"{where}.{name}"))
            for index, pair in enumerate(getattr(node, "next_functions", ()) or ()):
                following = pair[0] if pair else None
                if following is not None:
                    label = f"{where}.next_functions[{index}][0] ({type(following).__name__})"
                    stack.append((following, label))
    if nodes <= 0:
        notes.append(f"autograd graphs were read up to {MAX_GRAPH_NODES} nodes")
    # One walk up for every owner at once (each step scans the heap once).
    _walk_up(list({id(p): p for p, _, _ in probes}.values()), [], budget)
    for probe, target, where in probes:
        held_by = probe.path or "a tensor that the walk could not place"
        target.path = f"{held_by}{where}"
        target.kind = "autograd graph (a saved tensor)"
        target.note = probe.note
        target.alive = probe.alive


def _saved_names(node: object) -> list[str]:
    try:
        return [name for name in dir(node) if name.startswith("_saved_")]
    except Exception:
        return []
