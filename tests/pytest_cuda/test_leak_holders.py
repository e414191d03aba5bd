"""Who holds a leak: the walk from leaked objects up to a root, with small real objects.

``Blob`` stands in for a leaked tensor (the walk is told which objects are leaked by a
function, as the checker tells it which CUDA tensors lie in the leaked blocks); the
autograd case uses real CPU tensors, whose saved tensors have no Python object.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import gc
import subprocess
import sys
import types
import weakref
from typing import TYPE_CHECKING, Any, ClassVar

import pytest
import torch

from gpumagic.stacks import Block, Frame, blocks_from_segments
from pytest_cuda.leaks.blocks import GRAPH_POOL, UNSHOWN, find_block_holders
from pytest_cuda.leaks.walk.holders import LIBRARY, OUTSIDE, LeakHolderScan, find_leak_holders
from pytest_cuda.leaks.walk.roots import held_from_outside

if TYPE_CHECKING:
    from collections.abc import Iterator

    from pytest_cuda.leaks.walk.graphs import Facts


class Blob:
    """A stand-in for a leaked tensor: a size, and a marker the walk is told about."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def blob_facts(obj: object) -> tuple[tuple[str, int], int, str] | None:
    if isinstance(obj, Blob):
        return ("cuda:0", id(obj)), obj.nbytes, "cuda:0"
    return None


def scan(facts: Facts = blob_facts) -> LeakHolderScan:
    objects = gc.get_objects()
    try:
        return find_leak_holders(objects, facts)
    finally:
        del objects


def storage_facts(storage: int, nbytes: int) -> Facts:
    """Facts for the CPU tensors of one storage (its ``data_ptr``), as if on cuda:0."""

    def facts(obj: object) -> tuple[tuple[str, int], int, str] | None:
        if isinstance(obj, torch.Tensor) and obj.untyped_storage().data_ptr() == storage:
            return ("cpu", storage), nbytes, "cuda:0"
        return None

    return facts


def only(result: LeakHolderScan) -> tuple[str, str, str]:
    assert len(result.holders) == 1, result
    holder = result.holders[0]
    return holder.path, holder.kind, holder.note


@pytest.fixture(scope="module")
def _thawed_heap() -> Iterator[None]:
    """The suite's conftest freezes the heap (``gc.freeze()``), which hides objects
    from ``gc.get_referrers``: thawed for this module's walks, frozen again after them
    (a collection of the whole thawed heap costs the tests after it)."""
    gc.unfreeze()
    yield
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _visible_heap(_thawed_heap: None) -> Iterator[None]:
    """Each walk starts from no garbage (the next test's collection, or the module's
    last, collects what this one left)."""
    gc.collect()
    yield
    TestLike.batch.cache_clear()


@pytest.fixture
def module() -> Iterator[types.ModuleType]:
    """A real module in sys.modules, as a user's ``mymod`` would be."""
    made = types.ModuleType("mymod")
    made.__file__ = "/home/me/project/mymod.py"
    sys.modules["mymod"] = made
    yield made
    del sys.modules["mymod"]


def test_a_module_global_dict(module: types.ModuleType) -> None:
    module._cache = {"x": Blob(4096)}  # type: ignore[attr-defined]
    path, kind, _ = only(scan())
    assert (path, kind) == ("mymod._cache['x']", "module global")
    assert scan().holders[0].nbytes == 4096


def test_a_holder_frozen_by_gc_freeze_is_found_from_its_module(
    module: types.ModuleType,
) -> None:
    """gc.freeze() (a user's, a plugin's) hides the holder list and the module's
    namespace from gc.get_referrers: the walk down from the modules finds them."""
    module.KEEP = []  # type: ignore[attr-defined]
    gc.freeze()
    try:
        module.KEEP.append(Blob(64))  # type: ignore[attr-defined]
        found = scan()
    finally:
        gc.unfreeze()
    assert only(found)[:2] == ("mymod.KEEP[0]", "module global")
    assert found.complete
    assert not found.hidden
    assert not any("frozen" in note for note in found.notes)


def test_a_leaked_object_frozen_itself_is_found_though_no_list_shows_it(
    module: types.ModuleType,
) -> None:
    module.KEEP = {"w": Blob(128)}  # type: ignore[attr-defined]
    gc.freeze()
    try:
        found = find_leak_holders([], blob_facts)  # no object listed: the leaked one is frozen
    finally:
        gc.unfreeze()
    assert only(found)[:2] == ("mymod.KEEP['w']", "module global")
    assert found.found == 128


def test_frozen_objects_not_searched_in_time_are_said_to_hide_a_holder(
    module: types.ModuleType,
) -> None:
    module.KEEP = []  # type: ignore[attr-defined]
    gc.freeze()
    try:
        module.KEEP.append(Blob(64))  # type: ignore[attr-defined]
        objects = gc.get_objects()
        found = find_leak_holders(objects, blob_facts, budget_s=1e-9)
        del objects
    finally:
        gc.unfreeze()
    assert not found.complete
    assert found.hidden > 0


def test_a_class_attribute(module: types.ModuleType) -> None:
    class Model:
        store: ClassVar[list[Blob]] = []

    Model.__module__ = "mymod"
    Model.__qualname__ = "Model"
    module.Model = Model  # type: ignore[attr-defined]
    Model.store.append(Blob(512))
    path, kind, _ = only(scan())
    assert (path, kind) == ("mymod.Model.store[0]", "class attribute")


class TestLike:
    """A test class, as pytest collects them."""

    __test__ = False  # named like one, but not for pytest to collect (it warned twice)

    def __init__(self) -> None:
        self.weights = Blob(8 << 20)

    @functools.lru_cache  # noqa: B019 -- the leak this test plants
    def batch(self, n: int) -> Blob:
        return Blob(n)


def test_an_lru_cache_keyed_by_a_test_instance() -> None:
    instance = TestLike()
    instance.batch(1024)
    del instance
    found = scan()
    paths = {h.path: h for h in found.holders}
    cache = f"{__name__}.TestLike.batch.cache[…]"
    # The cached result, and the instance's own tensor that the cache's key keeps.
    key = f"{__name__}.TestLike.batch.cache key[0].weights"
    assert set(paths) == {cache, key}, paths
    for holder in paths.values():
        assert holder.kind == "functools.lru_cache"
        assert "its keys hold TestLike instances" in holder.note


def test_an_instance_attribute_through_a_global(module: types.ModuleType) -> None:
    class Holder:
        pass

    holder = Holder()
    holder.batch = Blob(100)  # type: ignore[attr-defined]
    module.STATE = holder  # type: ignore[attr-defined]
    del holder
    path, kind, _ = only(scan())
    assert (path, kind) == ("mymod.STATE.batch", "module global")


def make_counter() -> Any:
    buffer = Blob(2048)

    def count() -> int:
        return buffer.nbytes

    return count


def test_a_closure_cell(module: types.ModuleType) -> None:
    module.counter = make_counter()  # type: ignore[attr-defined]
    path, kind, _ = only(scan())
    assert path == f"{__name__}.make_counter.<locals>.count closure variable 'buffer'"
    assert kind == "closure cell"


def test_what_nothing_reaches_is_said_so() -> None:
    # A reference cycle nothing else holds: the walk finds no root.
    blob = Blob(64)
    cycle: list[Any] = [blob]
    cycle.append(cycle)
    del blob, cycle
    found = scan()
    path, kind, _ = only(found)
    assert path == "no Python object that the walk reached"
    assert kind.startswith("C++ side or unreachable")
    assert found.found == 0
    gc.collect()


def test_an_autograd_graph_holds_its_saved_tensors(module: types.ModuleType) -> None:
    x = torch.ones(1000, requires_grad=True)
    module.LOSS = (x * x).sum()  # type: ignore[attr-defined]
    saved = storage_facts(x.untyped_storage().data_ptr(), 4000)
    del x
    path, kind, _ = only(scan(saved))
    assert path.startswith("mymod.LOSS.grad_fn (SumBackward0).next_functions[0][0] (MulBackward0)")
    assert path.endswith(("._saved_self", "._saved_other"))
    assert kind == "autograd graph (a saved tensor)"


def test_an_autograd_graph_holds_the_leaf_it_accumulates_into(module: types.ModuleType) -> None:
    # torchvision's DeformConv tests cache x.permute(...).contiguous().permute(...) of a
    # leaf that requires grad: the leaf itself is held only by the copy's graph.
    x = torch.ones(10, 100, requires_grad=True)
    module.COPY = x.t().contiguous().t()  # type: ignore[attr-defined]
    leaf = storage_facts(x.untyped_storage().data_ptr(), 4000)
    del x
    found = scan(leaf)
    path, kind, _ = only(found)
    assert path == (
        "mymod.COPY.grad_fn (TBackward0).next_functions[0][0] (CloneBackward0)"
        ".next_functions[0][0] (TBackward0).next_functions[0][0] (AccumulateGrad).variable"
    )
    assert kind == "autograd graph (a leaf it accumulates gradients into)"
    # A module global holds the graph's owner: no collection could free the leaf.
    assert found.alive


def test_a_leaf_no_python_object_holds_is_placed_through_the_graph_when_blocks_are_shown(
    module: types.ModuleType,
) -> None:
    # torchvision's DeformConv tests again, as the leak check sees them: the copy and the
    # leaf are both leaked, and every leaked block is shown by a tensor (the leaf's
    # Python object outlives `del x`: torch keeps it while the graph holds the leaf).
    # The graphs are read for the leaf that no Python object holds, and the owner's
    # place, which the walk found, names it: proven alive, no collection needed.
    x = torch.ones(10, 100, requires_grad=True)
    module.COPY = x.t().contiguous().t()  # type: ignore[attr-defined]
    storages = {x.untyped_storage().data_ptr(), module.COPY.untyped_storage().data_ptr()}
    del x

    def facts(obj: object) -> tuple[tuple[str, int], int, str] | None:
        if isinstance(obj, torch.Tensor) and obj.untyped_storage().data_ptr() in storages:
            return ("cpu", obj.untyped_storage().data_ptr()), 4000, "cuda:0"
        return None

    objects = gc.get_objects()
    try:
        found = find_leak_holders(objects, facts, covered=lambda: True)
    finally:
        del objects
    paths = sorted(h.path for h in found.holders)
    assert paths == [
        "mymod.COPY",
        "mymod.COPY._base.grad_fn (CloneBackward0).next_functions[0][0] (TBackward0)"
        ".next_functions[0][0] (AccumulateGrad).variable",
    ], found
    assert found.alive


class Strategy:
    """Holds a cached tensor and what the test leaks, as gpytorch's prediction strategy."""

    cache: torch.Tensor | None
    kept: Blob


def clear_cache_hook(strategy: Strategy, *grads: object) -> None:
    strategy.cache = None


def test_a_hook_on_an_autograd_node_is_where_the_path_starts() -> None:
    # gpytorch registers functools.partial(clear_cache_hook, strategy) on a cached
    # tensor's grad_fn, and the strategy keeps that tensor: torch keeps the hook's dict
    # in the node (C++), so no Python object refers to it and the garbage collector
    # cannot see the cycle; the walk says where C++ holds the path.
    strategy = Strategy()
    strategy.kept = Blob(256)
    strategy.cache = torch.ones(3, requires_grad=True) * 2
    assert strategy.cache.grad_fn is not None
    handle = strategy.cache.grad_fn.register_hook(functools.partial(clear_cache_hook, strategy))
    hook_id = handle.id
    alive = weakref.ref(strategy)
    del strategy, handle
    try:
        found = scan()
        path, kind, _ = only(found)
        assert path == (
            "hooks of an autograd node (an OrderedDict of hook ids that only C++ holds)"
            f"[{hook_id}] (functools.partial of clear_cache_hook).args[0].kept"
        )
        assert kind == OUTSIDE
        # Nothing proves that C++ keeps it: a collection of the whole heap decides.
        assert not found.alive
    finally:
        left = alive()
        assert left is not None
        left.cache = None  # the cycle, broken


def test_a_custom_functions_ctx_is_named_by_its_function() -> None:
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            return 2 * x * grad

    y = Square.apply(torch.ones(3, requires_grad=True))
    assert held_from_outside(y.grad_fn) == (
        0,
        "the ctx of autograd Function Square (only its autograd graph holds it)",
    )
    assert held_from_outside(collections.OrderedDict({1: print}))[0] == 0
    assert held_from_outside({1: print})[0] == 1
    assert held_from_outside([]) == (
        1,
        "a list that no Python object holds (C++ does, or a running function)",
    )


class Untouchable:
    """An object that raises on every attribute read."""

    def __getattribute__(self, name: str) -> Any:
        raise RuntimeError(f"no {name}")


def test_objects_that_raise_do_not_stop_the_walk(module: types.ModuleType) -> None:
    module.TRAP = [Untouchable(), Blob(256)]  # type: ignore[attr-defined]

    def facts(obj: object) -> tuple[tuple[str, int], int, str] | None:
        if type(obj) is Untouchable:
            raise RuntimeError("cannot look")
        return blob_facts(obj)

    objects = gc.get_objects()
    found = find_leak_holders(objects, facts)
    del objects
    path, kind, _ = only(found)
    assert (path, kind) == ("mymod.TRAP[1]", "module global")


def test_a_broken_facts_function_is_noted_not_raised() -> None:
    def facts(obj: object) -> tuple[tuple[str, int], int, str] | None:
        raise ValueError("bad facts")

    found = find_leak_holders([Blob(1)], facts)
    assert found.holders == ()
    # (A note on objects frozen by gc.freeze() may come first: torch freezes some.)
    assert found.notes[-1] == "no Python tensor object shows the leaked blocks"


def test_a_library_global_is_a_library_cache() -> None:
    functools._gpumagic_test_cache = {"k": Blob(32)}  # type: ignore[attr-defined]
    try:
        path, kind, _ = only(scan())
        assert (path, kind) == ("functools._gpumagic_test_cache['k']", "library cache")
    finally:
        del functools._gpumagic_test_cache  # type: ignore[attr-defined]


def test_an_installed_package_s_global_is_a_library_cache(module: types.ModuleType) -> None:
    """The walk asks stacks.FrameFilter's rule: site-packages is a library's."""
    module.__file__ = "/venv/lib/python3.12/site-packages/mymod/__init__.py"
    module.KEEP = [Blob(64)]  # type: ignore[attr-defined]
    assert only(scan())[:2] == ("mymod.KEEP[0]", LIBRARY)
    module.__file__ = "/home/me/project/mymod.py"
    assert only(scan())[:2] == ("mymod.KEEP[0]", "module global")


def test_the_largest_holder_comes_first(module: types.ModuleType) -> None:
    module.SMALL = Blob(10)  # type: ignore[attr-defined]
    module.LARGE = Blob(10_000)  # type: ignore[attr-defined]
    found = scan()
    assert [h.path for h in found.holders] == ["mymod.LARGE", "mymod.SMALL"]
    assert found.first() == "mymod.LARGE (module global)"
    described = found.holders[0].describe()
    assert described == "9.8 KiB (1 tensor) on cuda:0: mymod.LARGE (module global)"


def test_blocks_that_no_tensor_shows_are_said_so(module: types.ModuleType) -> None:
    # One block holds a global's tensor; the other holds nothing Python can see (a
    # library's C++ workspace): it is listed last, with its bytes, as such.
    module.CACHE = [Blob(4096)]  # type: ignore[attr-defined]
    shown = Block(0, id(module.CACHE[0]) - 16, 4608, 4096)  # type: ignore[attr-defined]
    hidden = Block(0, 1 << 60, 8 << 20, 8 << 20)
    objects = gc.get_objects()
    found = find_block_holders(objects, [shown, hidden], blob_facts)
    del objects
    assert [(h.path, h.kind) for h in found.holders] == [
        (f"{module.__name__}.CACHE[0]", "module global"),
        ("1 block that no Python tensor shows", UNSHOWN),
    ]
    assert found.holders[1].nbytes == 8 << 20
    assert found.holders[1].describe() == (
        f"8.0 MiB on cuda:0: 1 block that no Python tensor shows ({UNSHOWN})"
    )
    assert found.found == 4608  # the block's bytes, not the tensor's
    assert found.first() == f"{module.__name__}.CACHE[0] (module global)"
    # The global is proven alive, the hidden block is not: the block bytes it keeps.
    assert not found.alive
    assert found.proven == (("cuda:0", 4608),)


def test_when_no_tensor_shows_any_block_the_holder_line_says_it_once() -> None:
    objects = gc.get_objects()
    found = find_block_holders(objects, [Block(0, 1 << 60, 512, 100)], blob_facts)
    del objects
    assert [h.kind for h in found.holders] == [UNSHOWN]
    assert "no Python tensor object shows the leaked blocks" not in found.notes
    assert found.first() is None


def test_the_walk_reads_a_module_through_its_namespace_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio  # noqa: F401 -- its C module is among those the walk meets

    asked: list[types.ModuleType] = []
    real = gc.get_referents

    def spy(*objs: object) -> list[object]:
        asked.extend(obj for obj in objs if isinstance(obj, types.ModuleType))
        return real(*objs)

    monkeypatch.setattr(gc, "get_referents", spy)
    objects = gc.get_objects()
    found = find_block_holders(objects, [Block(0, 1 << 60, 512, 100)], blob_facts)
    del objects
    assert [h.kind for h in found.holders] == [UNSHOWN]
    assert asked == []


FREED_FUTURE_ITERATORS = """
import asyncio, gc
from gpumagic.stacks import Block
from pytest_cuda.leaks.blocks import find_block_holders

async def main():
    future = asyncio.get_running_loop().create_future()
    iterators = [iter(future) for _ in range(20)]
    del iterators  # on _asyncio's free list now
    future.cancel()

asyncio.run(main())
find_block_holders(gc.get_objects(), [Block(0, 1 << 60, 512, 100)], lambda obj: None)
for _ in range(3):
    gc.collect()
print("collected")
"""


def test_a_suite_that_ran_asyncio_survives_the_walk() -> None:
    # CPython gh-122695: on 3.12.0-3.12.5, reading the _asyncio module's C state hands
    # out freed future iterators; the walk did, and the next collection never ended
    # (or the process died), seen as a hung or crashed xdist worker on the GPU machine.
    result = subprocess.run(
        [sys.executable, "-c", FREED_FUTURE_ITERATORS],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "collected"


TORCH_FRAME = Frame("/venv/lib/python3.12/site-packages/torch/nn/modules/rnn.py", 1123, "forward")
USER_FRAME = Frame("/home/me/project/test_model.py", 12, "test_lstm")


def is_user(filename: str) -> bool:
    return "site-packages" not in filename


def test_a_tensor_only_a_cuda_graph_pool_keeps_is_a_library_cache() -> None:
    # Reachable by no root (a cycle stands in for torch's C++ side): its block lies in
    # a CUDA graph's private pool, so torch's graphs keep it by design.
    blob = Blob(16)
    cycle: list[Any] = [blob]
    cycle.append(cycle)
    block = Block(0, id(blob) - 8, 1024, 16, (USER_FRAME,), private_pool=True)
    del blob, cycle
    objects = gc.get_objects()
    found = find_block_holders(objects, [block], blob_facts, is_user)
    del objects
    assert [(h.path, h.kind, h.nbytes) for h in found.holders] == [(GRAPH_POOL, LIBRARY, 16)]
    assert found.found == 1024
    gc.collect()


def test_a_block_a_library_call_allocated_and_no_tensor_shows_is_that_librarys() -> None:
    # cuDNN's dropout state: allocated inside torch's LSTM, kept in C++.
    library = Block(0, 1 << 60, 2 << 20, 2 << 20, (TORCH_FRAME, USER_FRAME))
    user = Block(0, 1 << 61, 512, 512, (USER_FRAME,))
    objects = gc.get_objects()
    found = find_block_holders(objects, [library, user], blob_facts, is_user)
    del objects
    assert [(h.path, h.kind, h.nbytes) for h in found.holders] == [
        (
            "the C++ side of the library call at torch/nn/modules/rnn.py:1123 in forward",
            LIBRARY,
            2 << 20,
        ),
        ("1 block that no Python tensor shows", UNSHOWN, 512),
    ]
    assert found.found == 2 << 20


def test_segments_in_a_private_pool_give_private_blocks() -> None:
    block = {"state": "active_allocated", "address": 4096, "size": 512, "requested_size": 16}
    segments = [
        {"device": 0, "segment_pool_id": (0, 0), "blocks": [block]},
        {"device": 0, "segment_pool_id": (1, 3), "blocks": [{**block, "address": 8192}]},
        {"device": 0, "blocks": [{**block, "address": 16384}]},
    ]
    assert [b.private_pool for b in blocks_from_segments(segments)] == [False, True, False]


def test_cpp_frames_before_the_users_line_do_not_make_it_a_library_call() -> None:
    # A recording with C++ frames (stacks="all") lists them innermost: the innermost
    # Python frame decides, here the user's own line.
    cpp = Frame("/pytorch/c10/cuda/CUDACachingAllocator.cpp", 1234, "malloc")
    block = Block(0, 1 << 60, 4 << 20, 4 << 20, (cpp, USER_FRAME))
    objects = gc.get_objects()
    found = find_block_holders(objects, [block], blob_facts, is_user)
    del objects
    assert [(h.kind, h.nbytes) for h in found.holders] == [(UNSHOWN, 4 << 20)]


def test_a_storage_is_walked_from_each_tensor_that_shows_it(module: types.ModuleType) -> None:
    # torchvision caches x.t().contiguous().t(): the cache holds the view, only C++ holds
    # its base (no Python object refers to it), and both show one storage.
    base = torch.ones(4, 3)
    module.CACHE = [base.t()]  # type: ignore[attr-defined]
    shows = storage_facts(base.untyped_storage().data_ptr(), 48)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(base))  # as C++ holds a view's base
    del base

    cached = module.CACHE[0]  # type: ignore[attr-defined]
    held = cached._base
    try:
        # The base first, as the heap may list it: the view still places the storage.
        objects = [held, cached]
        del cached
        found = find_leak_holders(objects, shows)
        del objects
        path, kind, _ = only(found)
        assert (path, kind) == ("mymod.CACHE[0]", "module global")
        assert found.holders[0].tensors == 2
    finally:
        ctypes.pythonapi.Py_DecRef(ctypes.py_object(held))


def test_a_python_root_comes_before_what_only_cpp_holds(module: types.ModuleType) -> None:
    module.KEEP = [Blob(64)]  # type: ignore[attr-defined]
    orphan = Blob(4096)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(orphan))  # as C++ holds a leaf's .grad
    alive = weakref.ref(orphan)
    del orphan
    try:
        found = scan()
        assert [(h.path, h.kind) for h in found.holders] == [
            ("mymod.KEEP[0]", "module global"),
            ("a Blob that no Python object holds (C++ does, or a running function)", OUTSIDE),
        ]
        assert found.first() == "mymod.KEEP[0] (module global)"
    finally:
        ctypes.pythonapi.Py_DecRef(ctypes.py_object(alive()))
