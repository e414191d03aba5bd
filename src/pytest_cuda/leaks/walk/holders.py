"""Who holds leaked memory: from each leaked tensor up to a root a person recognises.

Runs only for a test already judged leaking. The walk goes *up* the references
(:func:`gc.get_referrers`, one heap scan per level for all tensors at once; only the
test's own objects while the older heap is still frozen, :mod:`pytest_cuda.leaks.walk.young`)
to a root (:mod:`pytest_cuda.leaks.walk.roots`): a module global (``mymod._cache['x']``), a
class attribute, a ``functools.lru_cache`` (saying when its keys hold test instances),
a closure cell, a pytest fixture's value, or a library's global ("library cache": by
design, not the user's leak). Tensors an
autograd graph saved are found from the graph's owner (``loss.grad_fn._saved_*``).
Objects :func:`gc.freeze` hid from the walk up are searched *down* from the modules
(:mod:`pytest_cuda.leaks.walk.down`); each step is named by
:mod:`pytest_cuda.leaks.walk.follow`.
What no Python object reaches is said to be so.

Pure Python over objects it is given: no torch import, no CUDA call (tensor facts come
from a function passed in; which tensors own autograd graphs, from the seam's
:func:`gpumagic.cuda.graph_owners`). Every failure to inspect an object is noted.
"""

from __future__ import annotations

import gc
import sys
import types
import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gpumagic.units import format_bytes
from pytest_cuda.leaks.walk.down import walk_down
from pytest_cuda.leaks.walk.follow import LIBRARY, follow, frame_root
from pytest_cuda.leaks.walk.graphs import Saved, graph_probes, name_saved, place_from
from pytest_cuda.leaks.walk.paths import referents
from pytest_cuda.leaks.walk.state import (
    OUTSIDE,
    Boundary,
    Budget,
    Node,
    Target,
    end_path,
    ended,
)
from pytest_cuda.leaks.walk.young import young_referrers

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from pytest_cuda.leaks.walk.graphs import Facts

    #: ``explain(key, searched)``: the ``(path, kind)`` of a storage no root reached;
    #: ``searched``: nothing was out of the walk's sight (no time limit, nothing frozen).
    Explain = Callable[[tuple[str, int], bool], tuple[str, str] | None]

__all__ = [
    "LIBRARY",
    "NO_TENSOR",
    "OUTSIDE",
    "LeakHolder",
    "LeakHolderScan",
    "find_leak_holders",
    "holder_order",
]

NO_TENSOR = "no Python tensor object shows the leaked blocks"

#: How many tensors of one storage the walk starts from.
MAX_VIEWS = 8
#: How far up the walk goes, and how many objects one level may hold.
MAX_DEPTH = 16
MAX_FRONTIER = 2_000


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
    #: The storages it holds, as ``(device, address)`` (``("cuda:0", 0x7f...)``): where a
    #: memory snapshot names the holder of each block.
    storages: tuple[tuple[str, int], ...] = ()

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
    #: Per device (``"cuda:0"``), bytes of the leaked blocks that the user's holders
    #: proven alive keep (when the walk was given blocks): no collection frees them.
    proven: tuple[tuple[str, int], ...] = ()

    @property
    def alive(self) -> bool:
        """Every holder is a root known to be alive: no collection could free them."""
        return self.complete and bool(self.holders) and all(h.alive for h in self.holders)

    @property
    def only_libraries(self) -> bool:
        """Every holder is a library's cache (:data:`LIBRARY`): kept by design."""
        return all(h.kind == LIBRARY for h in self.holders)

    def first(self) -> str | None:
        """``"mymod.CACHE['x'] (module global)"`` for the largest holder that Python
        objects reach, ``None`` when none does."""
        if not self.holders or self.holders[0].kind.startswith("C++"):
            return None
        top = self.holders[0]
        return f"{top.path} ({top.kind})"


def find_leak_holders(
    objects: Sequence[object],
    facts: Facts,
    explain: Explain | None = None,
    *,
    budget_s: float | None = None,
    covered: Callable[[], bool] | None = None,
    frozen_before: int | None = None,
    thaw: Callable[[], None] | None = None,
    frames: bool = False,
) -> LeakHolderScan:
    """Walk from every leaked storage among ``objects`` to its root.

    ``facts(obj)`` answers ``(storage key, bytes, device)`` for a leaked tensor (views
    of one storage share the key) and ``None`` for anything else; ``objects`` is where
    to look for the tensors (``gc.get_objects()``, or what a test made); the walk up
    goes through the whole heap (first the test's own objects, given ``thaw``).
    ``explain(key, searched)`` may name the ``(path, kind)`` of a storage the walk found
    no root for (``searched``: it looked everywhere). ``budget_s``: the walk stops after
    about this long (each step up scans the heap once), saying so. ``covered()``: the
    tensors found so far account for every leaked block, so autograd graphs need not be
    read for saved tensors. ``frozen_before``: how many objects :func:`gc.freeze` had
    frozen when the leaked memory began to be allocated (Python 3.12 freezes a few
    hundred at start-up); only a freeze since then can hide the leaked tensors
    themselves (``None``: any may). ``frames``: a variable of a function's frame is a
    root too (an out-of-memory error's traceback keeps the failed test's frames); else
    the walk does not go up through frames. ``thaw``: the caller keeps the heap that existed
    before the test frozen (:class:`~pytest_cuda.leaks.heap.TestHeap`; ``objects`` are
    the test's own) and this puts it back: the walk goes up among the test's objects
    first and thaws before it scans the whole heap (always called). Never raises: what
    cannot be inspected is in :attr:`LeakHolderScan.notes`.
    """
    notes: list[str] = []
    targets: dict[tuple[str, int], Target] = {}
    budget = Budget(budget_s)
    boundary = Boundary(thaw)
    hidden = 0  # frozen objects that may hide what the walk did not find
    try:
        # Reading arbitrary objects can warn (deprecated module attributes): not the
        # user's warnings to see.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            targets.update(_targets(objects, facts))
            # Saved tensors are read before the walk, so that one walk up goes from the
            # tensors and the graphs' owners together.
            read = covered is None or not covered()
            graphs, probes = (
                graph_probes(objects, targets, facts, notes, budget) if read else ([], [])
            )
            _walk_up(
                [*targets.values(), *probes], notes, budget, {id(objects)}, boundary, frames=frames
            )
            if not read and any(not t.path for t in targets.values()):
                # Every block was shown, but a tensor no Python object holds may be a
                # leaf a graph accumulates into (x.permute(…).contiguous() cached, x
                # dropped): the graphs are read for it now, their owners placed from
                # the walk when it placed them, else walked up.
                graphs, probes = graph_probes(objects, targets, facts, notes, budget)
                unplaced = place_from(probes, targets.values())
                _walk_up(unplaced, notes, budget, {id(objects)}, boundary, frames=frames)
            name_saved(graphs)
            boundary.thaw()
            hidden = _search_frozen(targets, facts, budget, covered, frozen_before)
        if not targets:
            notes.append(NO_TENSOR)
    except Exception as exc:  # the report must come out whatever the heap holds
        notes.append(f"the walk stopped: {type(exc).__name__}: {exc}")
    finally:
        boundary.thaw()
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
    targets: dict[tuple[str, int], Target],
    facts: Facts,
    budget: Budget,
    covered: Callable[[], bool] | None,
    frozen_before: int | None,
) -> int:
    """Search what :func:`gc.freeze` hid from the walk up
    (:func:`~pytest_cuda.leaks.walk.down.walk_down`) where it may matter; how many
    objects stayed unsearched (0: none)."""
    frozen = gc.get_freeze_count()
    unplaced = any(not t.path for t in targets.values())
    unshown = not covered() if covered is not None else not targets
    # Only a freeze since frozen_before hides leaked tensors; an older one (Python 3.12's
    # start-up objects) a holder only if the test changed it: searched without a limit.
    later = frozen_before is None or frozen > frozen_before
    unshown = unshown and later
    if not frozen or not (unplaced or unshown) or not (later or budget.seconds is None):
        return 0
    return 0 if walk_down(targets, facts, budget, unshown) else frozen


def holder_order(holder: LeakHolder) -> tuple[int, int, str]:
    """Holders that a Python root reaches first, then the paths from where only C++
    holds them (:data:`OUTSIDE`), then what no Python object reaches; by size, largest
    first."""
    rank = 2 if holder.kind.startswith("C++") else 1 if holder.kind == OUTSIDE else 0
    return rank, -holder.nbytes, holder.path


def _targets(objects: Iterable[object], facts: Facts) -> dict[tuple[str, int], Target]:
    found: dict[tuple[str, int], Target] = {}
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
            if len(found[key].others) < MAX_VIEWS:
                found[key].others.append(obj)
        else:
            found[key] = Target(obj, key, nbytes, device)
    return found


def _scan(
    targets: list[Target],
    notes: list[str],
    explain: Explain | None,
    searched: bool,
) -> LeakHolderScan:
    groups: dict[tuple[str, str, str, bool], list[Target]] = {}
    for target in targets:
        if not target.path:
            explained = explain(target.key, searched) if explain is not None else None
            if explained is None and target.end is not None:
                explained = end_path(target), OUTSIDE
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
            tuple(sorted(t.key for t in group)),
        )
        for (path, kind, note, alive), group in groups.items()
    ]
    holders.sort(key=holder_order)
    found = sum(t.nbytes for t in targets if not t.kind.startswith("C++"))
    return LeakHolderScan(tuple(holders), tuple(notes), found)


# ---------------------------------------------------------------------------
# The walk up.


def _walk_up(
    targets: list[Target],
    notes: list[str],
    budget: Budget,
    ignore: Iterable[int] = (),
    boundary: Boundary | None = None,
    *,
    frames: bool = False,
) -> None:
    """Up from every target to a root, all targets a step at a time. While the
    ``boundary`` is young, a step scans only the test's objects, and the objects that
    something outside them holds too wait; once no young step is left, the heap is
    thawed and they go on, scanning the whole heap."""
    modules = {id(vars(m)): name for name, m in list(sys.modules.items()) if m is not None}
    layer = [Node(obj, [], t, origin=obj) for t in targets for obj in (t.obj, *t.others)]
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
            referrers, by_id, own=own, seen=seen, modules=modules, budget=budget, frames=frames
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
    frames: bool = False,
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
            if frames:
                for child in children:
                    for node in by_id[id(child)]:
                        if not node.target.path:
                            frame_root(ref, child, node)
                            node.target.origin = node.origin
            continue
        for child in children:
            for node in by_id[id(child)]:
                if node.target.path:
                    continue
                step = follow(ref, child, node, modules, budget)
                if step is None:  # a root (or a link not followed: a later root resets it)
                    node.target.origin = node.origin
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
