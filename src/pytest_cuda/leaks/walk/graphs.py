"""Autograd graphs: the tensors a graph holds, read from the graph's owner.

A tensor saved for backward (``loss.grad_fn._saved_self``), or a leaf whose gradient the
graph accumulates (``….next_functions[0][0] (AccumulateGrad).variable``: the leaf of
``x.permute(…).contiguous()`` once ``x`` itself was dropped), has no Python object of
its own until it is read, and no Python container holds it: only the graph's C++ nodes
do. It is found from the tensor that owns the graph (a non-leaf tensor, its ``grad_fn``),
by reading the ``_saved_*`` attributes and ``variable`` of every node of the graph, and
named from where the owner is held (:func:`pytest_cuda.leaks.walk.holders.find_leak_holders`
walks up from the owner). Pure Python over objects it is given: which tensors own graphs
comes from the seam (:func:`gpumagic.cuda.graph_owners`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumagic import cuda
from pytest_cuda.leaks.walk.state import OUTSIDE, Budget, Target, end_path

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    #: ``facts(obj)``: ``(storage key, bytes, device)`` of a leaked tensor, else None.
    Facts = Callable[[object], tuple[tuple[str, int], int, str] | None]

__all__ = [
    "MAX_GRAPH_NODES",
    "Saved",
    "graph_probes",
    "name_saved",
    "place_from",
    "saved_tensors",
]

#: How many autograd graph nodes are read when looking for saved tensors.
MAX_GRAPH_NODES = 20_000
#: The attribute of an ``AccumulateGrad`` node that is its leaf tensor.
LEAF = "variable"


@dataclass(frozen=True, slots=True)
class Saved:
    """One leaked tensor a graph holds: the graph's owner, and where in its graph."""

    owner: object
    #: From the owner: ``.grad_fn (MulBackward0).next_functions[0][0] (…)._saved_self``.
    where: str
    tensor: object
    fact: tuple[tuple[str, int], int, str]

    @property
    def kind(self) -> str:
        """What the graph holds it as, for the holder line."""
        if self.where.endswith(f".{LEAF}"):
            return "autograd graph (a leaf it accumulates gradients into)"
        return "autograd graph (a saved tensor)"


def saved_tensors(
    objects: Sequence[object], facts: Facts, notes: list[str], spent: Callable[[], bool]
) -> list[Saved]:
    """The leaked tensors (``facts`` answers for them) that the autograd graphs of the
    tensors among ``objects`` saved or accumulate into, each with its owner and where,
    once per place a graph holds it (depth first, in no preferred order); reads at most
    :data:`MAX_GRAPH_NODES` nodes (saying so in ``notes``), and stops when ``spent()``."""
    found: list[Saved] = []
    nodes = MAX_GRAPH_NODES
    names: dict[type, list[str]] = {}
    for owner, grad_fn in cuda.graph_owners(objects):
        stack: list[tuple[object, str]] = [(grad_fn, f".grad_fn ({type(grad_fn).__name__})")]
        visited: set[int] = set()
        while stack and nodes > 0 and not spent():
            node, where = stack.pop()
            if id(node) in visited:
                continue
            visited.add(id(node))
            nodes -= 1
            for name in _saved_names(node, names):
                try:
                    saved = getattr(node, name)
                    fact = facts(saved)
                except Exception:
                    continue
                if fact is not None:
                    found.append(Saved(owner, f"{where}.{name}", saved, fact))
            for index, pair in enumerate(getattr(node, "next_functions", ()) or ()):
                following = pair[0] if pair else None
                if following is not None:
                    label = f"{where}.next_functions[{index}][0] ({type(following).__name__})"
                    stack.append((following, label))
    if nodes <= 0:
        notes.append(f"autograd graphs were read up to {MAX_GRAPH_NODES} nodes")
    return found


def _saved_names(node: object, by_type: dict[type, list[str]]) -> list[str]:
    """The ``_saved_*`` attributes of ``node`` (and the leaf's ``variable``). A node of
    torch's own (no ``__dict__``) has its class's, read once per class in ``by_type``;
    a custom Function's node may have more of its own."""
    cls = type(node)
    known = by_type.get(cls)
    if known is not None:
        return known
    try:
        found = [name for name in dir(node) if name.startswith("_saved_") or name == LEAF]
    except Exception:
        return []
    if not hasattr(node, "__dict__"):
        by_type[cls] = found
    return found


def graph_probes(
    objects: Sequence[object],
    targets: dict[tuple[str, int], Target],
    facts: Facts,
    notes: list[str],
    budget: Budget,
) -> tuple[list[tuple[Target, Target, Saved]], list[Target]]:
    """``(owner's probe, target, saved)`` for every place an autograd graph holds a
    leaked tensor (:func:`saved_tensors`), and the probes, one per owner: a probe is
    walked up like a target; a target that no Python object showed waits for it
    (``"…"``)."""
    probes: dict[int, Target] = {}
    found: list[tuple[Target, Target, Saved]] = []
    for saved in saved_tensors(objects, facts, notes, budget.spent):
        key, nbytes, device = saved.fact
        target = targets.get(key)
        if target is None:
            target = targets[key] = Target(saved.tensor, key, nbytes, device, path="…")
        probe = probes.setdefault(
            id(saved.owner), Target(saved.owner, ("graph", id(saved.owner)), 0, "")
        )
        found.append((probe, target, saved))
    return found, list(probes.values())


def place_from(probes: list[Target], targets: Iterable[Target]) -> list[Target]:
    """Place each probe whose owner is the tensor a placed target's path starts at (or
    that tensor's base: ``._base``) from that path; the probes left to walk up."""
    placed: dict[int, tuple[Target, str]] = {}
    for t in targets:
        if t.path and t.origin is not None:
            base = getattr(t.origin, "_base", None)
            if base is not None:
                placed.setdefault(id(base), (t, "._base"))
            placed[id(t.origin)] = (t, "")
    left: list[Target] = []
    for probe in probes:
        found, step = placed.get(id(probe.obj), (None, ""))
        if found is None:
            left.append(probe)
        else:
            probe.path, probe.kind, probe.note = found.path + step, found.kind, found.note
            probe.alive = found.alive
    return left


def name_saved(graphs: list[tuple[Target, Target, Saved]]) -> None:
    """Name a tensor a graph holds from its owner's place, unless a path of its own
    placed it. Owners the walk placed go first (a view's base, which only C++ holds,
    owns a part of the view's graph too), then the shorter path."""

    def order(graph: tuple[Target, Target, Saved]) -> tuple[bool, bool, int]:
        probe, _, saved = graph
        return not probe.path, not probe.alive, len(probe.path) + len(saved.where)

    for probe, target, saved in sorted(graphs, key=order):
        if target.path not in ("", "…"):
            continue
        held_by = probe.path or end_path(probe) or "a tensor that the walk could not place"
        target.path = f"{held_by}{saved.where}"
        target.kind = saved.kind
        target.note = probe.note if probe.path or probe.end is None else OUTSIDE
        target.alive = probe.alive
