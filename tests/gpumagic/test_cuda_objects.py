"""What a torch object is (``gpumagic.cuda.objects``), with real torch objects on the CPU:
the seam answers these so that no other module recognises torch's classes by name."""

from __future__ import annotations

import warnings

import pytest

from gpumagic import cuda

torch = pytest.importorskip("torch")


def test_graph_owners_are_the_non_leaf_tensors_with_their_grad_fn() -> None:
    leaf = torch.ones(3, requires_grad=True)
    owner = (leaf * 2).sum()
    plain = torch.ones(3)
    found = cuda.graph_owners([leaf, owner, plain, "not a tensor", 42])
    assert found == [(owner, owner.grad_fn)]


def test_tensors_among_a_heap_keeps_tensors_and_subclasses_in_order() -> None:
    class Marked(torch.Tensor):
        pass

    plain, param = torch.ones(2), torch.nn.Parameter(torch.ones(2))
    marked = torch.ones(2).as_subclass(Marked)
    heap = ["text", plain, 3, param, {"t": plain}, marked, torch.float32]
    found = cuda.tensors_among(heap)
    assert [id(t) for t in found] == [id(plain), id(param), id(marked)]


def test_modules_and_compiled_callables_are_recognised() -> None:
    model = torch.nn.Linear(2, 2)
    assert cuda.is_module(model)
    assert not cuda.is_module(torch.ones(1))
    assert not cuda.is_compiled(model)

    def plain(x: object) -> object:
        return x

    assert not cuda.is_compiled(plain)
    with warnings.catch_warnings():  # torch's own deprecations, importing torch._dynamo
        warnings.simplefilter("ignore", DeprecationWarning)
        compiled = torch.compile(plain)
    assert cuda.is_compiled(compiled)


def test_the_fixtures_devices_are_torch_devices() -> None:
    # Constructing a device object needs no GPU and creates no context.
    device = cuda.torch_device(1)
    assert isinstance(device, torch.device)
    assert (device.type, device.index) == ("cuda", 1)


def test_tensor_facts_of_views_share_their_storage() -> None:
    base = torch.zeros(4, 4)
    view = base[1]
    facts, view_facts = cuda.tensor_facts(base), cuda.tensor_facts(view)
    assert facts is not None
    assert view_facts is not None
    assert facts.storage == view_facts.storage
    assert (facts.nbytes, facts.device, facts.shape, view_facts.view) == (64, "cpu", (4, 4), True)
    assert cuda.tensor_facts(object()) is None
