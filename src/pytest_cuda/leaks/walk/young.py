"""The walk up inside what the test made: referrers among the test's own objects, and
which of the objects walked something else holds too.

While :class:`~pytest_cuda.leaks.heap.TestHeap` keeps the heap that existed before the
test frozen, :func:`gc.get_referrers` scans only the objects made since: a few hundred
or thousand, where the whole heap of a process with torch and a large suite loaded is a
few hundred thousand (about 50 ms a scan). A step up that stays among the young objects
costs microseconds. An object that something outside them holds too (an older object,
C++, a variable of a running function) shows it in its reference count: more references
than its referrers among the young objects account for. Only those objects need a scan
of the whole heap, all of them in one, once the heap is thawed
(:func:`pytest_cuda.leaks.walk.holders.find_leak_holders`).

Counting is exact only where ``sys.getrefcount`` counts every reference: CPython with
the GIL, 3.11 to 3.13 (:func:`counts_references`). Elsewhere (3.14 leaves some
references on the interpreter's stack uncounted; free-threaded builds defer counts)
the walk thaws the heap first and scans all of it at every step, as before. An object
whose count cannot be read exactly is always taken as held from outside: the count can
only send more objects to the whole-heap scan, never fewer.
"""

from __future__ import annotations

import gc
import sys
import types
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["counts_references", "young_referrers"]


def counts_references() -> bool:
    """``sys.getrefcount`` counts every reference here (CPython 3.11-3.13 with the GIL)."""
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    return sys.implementation.name == "cpython" and (3, 11) <= sys.version_info < (3, 14) and gil


def young_referrers(nodes: Sequence[object]) -> tuple[list[object], set[int]]:
    """The referrers of ``nodes`` that :func:`gc.get_referrers` sees (with the older heap
    frozen: among the young objects), and the ids of the nodes that something else holds
    too (their reference count is more than those referrers account for).

    A module among the referrers is not read (its C state is never touched: see
    :func:`pytest_cuda.leaks.walk.paths.referents`), so what it holds counts as held from
    outside."""
    wanted = tuple(nodes)
    referrers = gc.get_referrers(*wanted)
    counted = dict.fromkeys(map(id, wanted), 0)
    # The references of this function's own containers: ``wanted`` (unless it is in
    # ``referrers``: CPython 3.13 hands gc.get_referrers a copy, which it skips) and
    # ``referrers``, which holds the nodes that refer to other nodes.
    own = (*referrers, *(() if any(r is wanted for r in referrers) else wanted))
    for key in map(id, own):
        if key in counted:
            counted[key] += 1
    for ref in referrers:
        if not isinstance(ref, types.ModuleType):
            for key in map(id, gc.get_referents(ref)):
                if key in counted:
                    counted[key] += 1
    ref, own = None, ()  # no local variable may hold a node while the counts are read
    outside = set()
    for index in range(len(wanted)):
        # ``wanted[index]`` is the call's argument: one reference more.
        if sys.getrefcount(wanted[index]) - 1 != counted[id(wanted[index])]:
            outside.add(id(wanted[index]))
    return referrers, outside
