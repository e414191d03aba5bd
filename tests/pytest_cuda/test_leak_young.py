"""The holder walk's first steps among the test's own objects, with the older heap
frozen (:mod:`pytest_cuda.leaks.walk.young`), and the one thaw before the whole heap.

Objects made before :func:`gc.freeze` stand for the older heap (a module's namespace,
a cache made at import); those made after it, for what the test made. ``Blob`` stands
for a leaked tensor, as in ``test_leak_holders.py``.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import types
from typing import TYPE_CHECKING, Any

import pytest
from test_leak_holders import Blob, blob_facts

from pytest_cuda.leaks.walk import state as leak_walk_state
from pytest_cuda.leaks.walk.holders import OUTSIDE, LeakHolderScan, find_leak_holders
from pytest_cuda.leaks.walk.young import counts_references, young_referrers

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

pytestmark = pytest.mark.skipif(
    not counts_references(), reason="reference counts are not exact on this Python"
)


@pytest.fixture(autouse=True)
def _older_heap() -> Iterator[None]:
    """Everything made so far is the older heap, frozen (the suite's conftest froze the
    heap already: what the tests since made joins it); frozen again afterwards."""
    gc.collect()
    gc.freeze()
    yield
    gc.freeze()


class Spy:
    """``gc.get_referrers``, counting the scans made with the older heap frozen and
    those of the whole heap."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.young = self.whole = 0
        real = gc.get_referrers

        def spy(*objs: Any) -> list[Any]:
            if gc.get_freeze_count():
                self.young += 1
            else:
                self.whole += 1
            return real(*objs)

        monkeypatch.setattr(gc, "get_referrers", spy)


def walk(objects: list[object], thawed: list[bool]) -> LeakHolderScan:
    def thaw() -> None:
        thawed.append(True)
        gc.unfreeze()

    return find_leak_holders(objects, blob_facts, thaw=thaw)


def made(build: Callable[[], Any]) -> list[object]:
    """What ``build`` made: the young objects, as the checker lists them."""
    build()
    return gc.get_objects()


def test_a_young_chain_to_an_older_module_global_keeps_its_whole_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gc.unfreeze()
    module = types.ModuleType("oldmod")
    module.CACHE = {"seed": [0]}  # type: ignore[attr-defined]
    sys.modules["oldmod"] = module
    try:
        gc.freeze()  # the module and its cache are older than the test
        spy = Spy(monkeypatch)

        def build() -> None:
            module.CACHE["run"] = [{"out": Blob(512)}]  # type: ignore[attr-defined]

        thawed: list[bool] = []
        scan = walk(made(build), thawed)
        assert [h.path for h in scan.holders] == ["oldmod.CACHE['run'][0]['out']"]
        assert scan.holders[0].kind == "module global"
        assert thawed == [True]
        assert spy.young >= 3  # the blob, its dict, the list: among the young objects
        # The list, which the older cache holds too, then the cache: the whole heap.
        assert spy.whole == 2
    finally:
        del sys.modules["oldmod"]


def test_a_young_island_held_from_cpp_costs_one_whole_heap_scan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = Spy(monkeypatch)
    island: list[Any] = []

    def build() -> None:
        top = {"a": [[[Blob(2048)]]]}  # four steps up among young objects
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(top))  # a reference C++ holds
        island.append(id(top))

    objects = made(build)
    top = next(o for o in objects if id(o) == island[0])
    try:
        thawed: list[bool] = []
        scan = walk(objects, thawed)
        # Where the path starts: the object that only C++ holds.
        assert [(h.path, h.kind) for h in scan.holders] == [
            (
                "a dict that no Python object holds (C++ does, or a running function)"
                "['a'][0][0][0]",
                OUTSIDE,
            )
        ]
        assert thawed == [True]
        assert spy.young >= 4
        assert spy.whole == 1
    finally:
        ctypes.pythonapi.Py_DecRef(ctypes.py_object(top))


def test_a_walk_without_exact_counts_thaws_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leak_walk_state, "counts_references", lambda: False)
    spy = Spy(monkeypatch)
    keep: list[Any] = []

    def build() -> None:
        keep.append([Blob(64)])

    thawed: list[bool] = []
    scan = walk(made(build), thawed)
    assert thawed == [True]
    assert spy.young == 0
    assert spy.whole >= 1
    assert scan.complete


def test_young_referrers_tell_what_the_older_heap_holds_too() -> None:
    gc.unfreeze()
    older = {"seed": [0]}
    gc.freeze()
    objects: list[Any] = []

    def build() -> None:
        box = types.SimpleNamespace()
        inner = [1]
        box.items = [inner, inner]  # twice from one young list
        held = [2]
        older["k"] = held  # the older dict holds it too
        objects.extend([box, box.items, inner, held, {"top": [held]}])

    build()
    nodes = (objects[2], objects[3], objects[1], objects[4])
    referrers, outside = young_referrers(nodes)
    assert not any(r is older for r in referrers)  # frozen: not seen
    assert id(objects[3]) in outside  # the older dict's reference shows in its count
    assert id(objects[2]) not in outside
    assert id(objects[1]) not in outside
    assert id(objects[4]) not in outside
    local = objects[2]
    assert id(local) in young_referrers((objects[2],))[1]  # a variable: from outside
