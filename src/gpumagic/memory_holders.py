"""Who holds the GPU memory: a walk from the user's names to the live CUDA tensors.

``%gpumem --top`` names each live storage by the names that reach it (``x``,
``model.layer1.weight.grad``, ``opt.state[model.fc.weight]['exp_avg']``), counting each
storage once, and says how much memory no name reaches. Tensors are told apart by
:func:`gpumagic.cuda.tensor_facts`; nothing here imports torch or IPython.
"""

from __future__ import annotations

import collections
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpumagic import cuda

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

__all__ = ["Holder", "HolderScan", "find_holders", "namespace_roots"]

# The namespace walk stops after this many objects and says so.
WALK_MAX_OBJECTS = 200_000
WALK_MAX_DEPTH = 24


@dataclass(frozen=True)
class Holder:
    """One live storage and the names that reach it (views of it included)."""

    #: The names that reach the storage (``model.fc.weight``,
    #: ``opt.state[model.fc.weight]['exp_avg']``), at most a few.
    names: tuple[str, ...]
    #: The storage's size in bytes.
    nbytes: int
    #: Where it lives (``"cuda:0"``).
    device: str
    #: The shape of the first tensor found on it.
    shape: tuple[int, ...]
    #: Its dtype (``"float32"``).
    dtype: str
    #: How many tensors (views included) share the storage.
    tensors: int = 1
    #: How many more names reach it than ``names`` shows.
    more_names: int = 0
    #: The storage's ``(device, address)``: where a memory snapshot names its block's holder.
    storage: tuple[str, int] | None = None


@dataclass(frozen=True)
class HolderScan:
    """The result of walking the user's names: storages, largest first."""

    #: The storages found, largest first.
    holders: tuple[Holder, ...]
    #: How many objects the walk visited.
    visited: int
    #: Whether the walk stopped at its limit before it had visited everything (some names
    #: may be missing).
    truncated: bool

    def reachable(self, device: str) -> int:
        """Bytes of the storages on ``device`` that some name reaches."""
        return sum(h.nbytes for h in self.holders if h.device == device)


class _KeyRef:
    """A dict key that is an object (an optimizer's state is keyed by parameters):
    rendered with that object's own name once the walk is done."""

    __slots__ = ("fallback", "oid")

    def __init__(self, oid: int, fallback: str) -> None:
        self.oid = oid
        self.fallback = fallback


_Step = str | _KeyRef
_ATOMIC = (str, bytes, bytearray, int, float, complex, bool, type(None), range, memoryview)
_OPAQUE = (
    types.ModuleType,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.CodeType,
    types.FrameType,
    types.GeneratorType,
    types.CoroutineType,
    property,
    staticmethod,
    classmethod,
)
_SKIPPED: tuple[type, ...] = (*_ATOMIC, *_OPAQUE)
# nn.Module bookkeeping that is walked specially or holds no tensors.
_MODULE_SPECIAL = frozenset({"_parameters", "_buffers", "_modules", "training"})


def _instance_dict(obj: object) -> dict[str, Any] | None:
    try:
        found = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return None
    return found if isinstance(found, dict) else None


def _attr_step(name: str) -> str:
    if name.isidentifier():
        return f".{name}"
    if name.isdigit():
        return f"[{name}]"
    return f"[{name!r}]"


def _key_step(key: object, facts: Callable[[object], cuda.TensorFacts | None]) -> _Step:
    if isinstance(key, str | int | float | bool | type(None)):
        return f"[{key!r}]"
    if isinstance(key, tuple) and all(isinstance(k, str | int | float | bool) for k in key):
        text = repr(key)
        return f"[{text}]" if len(text) <= 40 else "[(...)]"
    if facts(key) is not None:
        return _KeyRef(id(key), f"<{type(key).__name__}>")
    return f"[<{type(key).__name__}>]"


def _children(
    obj: object, facts: Callable[[object], cuda.TensorFacts | None]
) -> Iterable[tuple[_Step, object, bool]]:
    """``(step, child, low_priority)`` for the places a tensor can hide in ``obj``."""
    if isinstance(obj, dict):
        for key, value in list(obj.items()):
            yield _key_step(key, facts), value, False
        return
    if isinstance(obj, list | tuple | collections.deque):
        fields = getattr(type(obj), "_fields", None)
        if isinstance(obj, tuple) and isinstance(fields, tuple):
            for name, value in zip(fields, obj, strict=False):
                yield f".{name}", value, False
            return
        for i, value in enumerate(list(obj)):
            yield f"[{i}]", value, False
        return
    attrs = _instance_dict(obj)
    if attrs is None:
        return
    parameters, modules = attrs.get("_parameters"), attrs.get("_modules")
    if isinstance(parameters, dict) and isinstance(modules, dict):
        # A torch.nn.Module: parameters, buffers and submodules under their
        # attribute paths (model.layer1.weight, model[0].bias), like named_parameters().
        for group in ("_parameters", "_buffers", "_modules"):
            members = attrs.get(group)
            if isinstance(members, dict):
                for name, value in list(members.items()):
                    if value is not None:
                        yield _attr_step(str(name)), value, False
        for name, value in list(attrs.items()):
            if name not in _MODULE_SPECIAL and "hook" not in name:
                yield _attr_step(name), value, False
        return
    optimizer = isinstance(attrs.get("state"), dict) and isinstance(attrs.get("param_groups"), list)
    for name, value in list(attrs.items()):
        # An optimizer's param_groups list the parameters again; their names should
        # come from the model, so that path is taken last.
        yield _attr_step(name), value, optimizer and name == "param_groups"


def namespace_roots(
    namespace: Mapping[str, object], hidden: Iterable[str] = ()
) -> list[tuple[str, object, bool]]:
    """The roots of the walk: ``(name, object, low_priority)`` for the user's names.

    IPython's own names (``hidden``) and dunders are left out, except the output
    history ``Out`` (it keeps displayed tensors alive); it and ``_``-prefixed names are
    walked last, so that ``x`` wins over ``Out[3]`` and ``_3``.
    """
    skip = set(hidden) - {"Out"}
    roots = []
    for name, value in list(namespace.items()):
        if name in skip or (name.startswith("__") and name.endswith("__")):
            continue
        roots.append((name, value, name.startswith("_") or name == "Out"))
    return roots


def find_holders(
    roots: Iterable[tuple[str, object, bool]],
    *,
    keep: Callable[[cuda.TensorFacts], bool],
    facts: Callable[[object], cuda.TensorFacts | None] | None = None,
    max_objects: int = WALK_MAX_OBJECTS,
    max_names: int = 4,
) -> HolderScan:
    """Walk breadth-first from ``roots`` to every tensor they reach; group by storage.

    Each object is named by the first (shortest) path that reaches it, low-priority
    roots and edges last. Attributes, dict items (keys of any hashable type; a tensor
    key by its own name), list/tuple items, nn.Module parameters, buffers and
    submodules, and a tensor's ``.grad`` are followed; functions, classes and modules
    are not (what only they reach counts as unreachable). ``facts`` tells tensors
    apart (default: :func:`gpumagic.cuda.tensor_facts`).
    """
    walk = _Walk(facts or cuda.tensor_facts, max_names)
    walk.run(roots, max_objects)
    return walk.scan(keep)


class _Walk:
    """The state of one :func:`find_holders` walk."""

    def __init__(self, facts: Callable[[object], cuda.TensorFacts | None], max_names: int) -> None:
        self.facts = facts
        self.max_names = max_names
        self.first: dict[int, tuple[int | None, _Step]] = {}
        self.aliases: dict[int, list[tuple[int | None, _Step, bool]]] = {}
        self.low: set[int] = set()  # objects first reached by a low-priority path
        self.alive: list[object] = []  # keeps every id() valid until names are rendered
        self.tensors: dict[int, cuda.TensorFacts] = {}
        self.queues: tuple[collections.deque[tuple[object, int]], ...] = (
            collections.deque(),
            collections.deque(),
        )
        self.visited = 0
        self.truncated = False
        self.names: dict[int, str] = {}
        self.pending: set[int] = set()

    def discover(self, obj: object, parent: int | None, step: _Step, depth: int, low: bool) -> None:
        oid = id(obj)
        if oid in self.first:
            others = self.aliases.setdefault(oid, [])
            if len(others) < self.max_names * 2:
                others.append((parent, step, low))
            return
        if isinstance(obj, _SKIPPED):
            return
        self.first[oid] = (parent, step)
        if low:
            self.low.add(oid)
        self.alive.append(obj)
        self.queues[1 if low else 0].append((obj, depth))

    def run(self, roots: Iterable[tuple[str, object, bool]], max_objects: int) -> None:
        ordered = sorted(roots, key=lambda r: r[2])  # a name the user typed names first
        for root, obj, low in ordered:
            self.discover(obj, None, root, 0, low)
        while self.queues[0] or self.queues[1]:
            low = not self.queues[0]
            obj, depth = self.queues[1 if low else 0].popleft()
            if self.visited >= max_objects:
                self.truncated = True
                return
            self.visited += 1
            found = self.facts(obj)
            if found is not None:
                self.tensors[id(obj)] = found
                if found.grad is not None:
                    self.discover(found.grad, id(obj), ".grad", depth + 1, low)
                continue
            if depth >= WALK_MAX_DEPTH:
                continue
            try:
                children = list(_children(obj, self.facts))
            except Exception:  # a user object whose introspection fails
                continue
            for step, child, low_edge in children:
                self.discover(child, id(obj), step, depth + 1, low or low_edge)

    def path(self, parent: int | None, step: _Step) -> str:
        prefix = "" if parent is None else self.name(parent)
        if isinstance(step, _KeyRef):
            known = step.oid in self.first and step.oid not in self.pending
            return f"{prefix}[{self.name(step.oid) if known else step.fallback}]"
        return prefix + step

    def name(self, oid: int) -> str:
        if oid not in self.names:
            self.pending.add(oid)
            self.names[oid] = self.path(*self.first[oid])
            self.pending.discard(oid)
        return self.names[oid]

    def scan(self, keep: Callable[[cuda.TensorFacts], bool]) -> HolderScan:
        by_storage: dict[tuple[str, int], list[int]] = {}
        for oid, found in self.tensors.items():
            if keep(found) and found.nbytes > 0:
                by_storage.setdefault(found.storage, []).append(oid)
        holders = [self.holder(oids) for oids in by_storage.values()]
        holders.sort(key=lambda h: (-h.nbytes, _name_rank(h.names[0])))
        self.alive.clear()
        return HolderScan(holders=tuple(holders), visited=self.visited, truncated=self.truncated)

    def holder(self, oids: list[int]) -> Holder:
        # The tensor with the most elements (the base, not a view) leads the row.
        oids.sort(
            key=lambda o: (
                -_numel(self.tensors[o].shape),
                self.tensors[o].view,
                o in self.low,
                _name_rank(self.name(o)),
            )
        )
        # Names through the output history or an optimizer's param_groups are shown
        # only when nothing the user named reaches the storage.
        found = [(self.name(oid), oid in self.low) for oid in oids]
        found += [(self.path(p, s), low) for oid in oids for p, s, low in self.aliases.get(oid, ())]
        wanted = any(not low for _, low in found)
        names = list(dict.fromkeys(name for name, low in found if not (wanted and low)))
        if wanted:  # the first (shortest) path the user named leads
            unique = [names[0], *sorted(names[1:], key=_name_rank)]
        else:
            unique = sorted(names, key=_name_rank)
        facts = self.tensors[oids[0]]
        return Holder(
            names=tuple(unique[: self.max_names]),
            nbytes=facts.nbytes,
            device=facts.device,
            shape=facts.shape,
            dtype=facts.dtype,
            tensors=len(oids),
            more_names=max(0, len(unique) - self.max_names),
            storage=facts.storage,
        )


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def _name_rank(name: str) -> tuple[int, int, str]:
    """Names people typed first, then ``Out[N]``, then ``_``-names; short before long."""
    group = 2 if name.startswith("_") else 1 if name.startswith("Out[") else 0
    return (group, len(name), name)
