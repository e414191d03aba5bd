"""What a torch object is, read from the host without a CUDA call: a tensor's storage,
size and device (:func:`tensor_facts`), the tensors among a heap's objects
(:func:`tensors_among`), the autograd graph a tensor owns (:func:`graph_owners`),
whether an object is an ``nn.Module`` or a ``torch.compile``-d callable, and
``torch.device`` objects for the pytest fixtures.

The rest of gpumagic and pytest_cuda asks these questions here instead of importing
torch or recognising its classes by name: none of them imports torch unless torch is
already imported (a process without torch has no tensors), except :func:`torch_device`,
which is asked for a device object.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumagic.cuda.discovery import torch_module

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

__all__ = [
    "TensorFacts",
    "graph_owners",
    "is_compiled",
    "is_module",
    "start_torch",
    "tensor_facts",
    "tensors_among",
    "torch_device",
]


@dataclass(frozen=True)
class TensorFacts:
    """What a live tensor holds: its storage (shared by views), size and where."""

    storage: tuple[str, int]
    nbytes: int
    device: str
    shape: tuple[int, ...]
    dtype: str
    grad: object | None = None
    view: bool = False


def tensor_facts(obj: object) -> TensorFacts | None:
    """The facts of ``obj`` when it is a torch tensor (any device), else ``None``.

    Reads only host-side metadata: no synchronisation, no CUDA context. Views of one
    storage get the same ``storage`` key; ``grad`` is read only from leaf tensors (a
    non-leaf's ``.grad`` warns).
    """
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor):
        return None
    import warnings

    device = str(obj.device)
    try:
        storage = obj.untyped_storage()
        key = (device, int(storage.data_ptr()))
        nbytes = int(storage.nbytes())
    except (RuntimeError, NotImplementedError, TypeError):
        # Sparse, nested or fake tensors: no single storage to share.
        key = ("object", id(obj))
        nbytes = int(obj.element_size() * obj.numel()) if obj.layout == torch.strided else 0
    if key[1] == 0:
        key = ("object", id(obj))
    grad = None
    if obj.is_leaf:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            grad = obj.grad
    return TensorFacts(
        storage=key,
        nbytes=nbytes,
        device=device,
        shape=tuple(int(n) for n in obj.shape),
        dtype=str(obj.dtype).removeprefix("torch."),
        grad=grad,
        view=bool(obj._is_view()),
    )


def tensors_among(objects: Iterable[object]) -> list[object]:
    """The torch tensors among ``objects`` (subclasses included), in their order. One
    type check per class, not per object, so a whole heap (``gc.get_objects()``: a few
    hundred thousand objects) is read in tens of milliseconds; nothing without torch
    imported."""
    base = getattr(sys.modules.get("torch"), "Tensor", None)
    if not isinstance(base, type):
        return []  # no torch here: no tensors
    tensor_types: dict[type, bool] = {}
    found = []
    for obj in objects:
        cls = type(obj)
        is_tensor = tensor_types.get(cls)
        if is_tensor is None:
            is_tensor = tensor_types[cls] = issubclass(cls, base)
        if is_tensor:
            found.append(obj)
    return found


def graph_owners(objects: Iterable[object]) -> list[tuple[object, object]]:
    """The torch tensors among ``objects`` that own an autograd graph (non-leaf tensors),
    each with its ``grad_fn``: the graph's nodes hold the tensors it saved for backward,
    which have no Python object of their own (:func:`tensors_among` reads the heap)."""
    owners = []
    for obj in tensors_among(objects):
        grad_fn = getattr(obj, "grad_fn", None)
        if grad_fn is not None:
            owners.append((obj, grad_fn))
    return owners


def is_compiled(obj: object) -> bool:
    """``obj`` is what ``torch.compile`` returned (a function or an ``OptimizedModule``)."""
    return getattr(obj, "_torchdynamo_orig_callable", None) is not None or (
        type(obj).__name__ == "OptimizedModule" and hasattr(obj, "_orig_mod")
    )


def is_module(obj: object) -> bool:
    """``obj`` is a ``torch.nn.Module`` (checked by class, without importing torch)."""
    return any(
        cls.__name__ == "Module" and cls.__module__ == "torch.nn.modules.module"
        for cls in type(obj).__mro__
    )


def torch_device(index: int) -> torch.device:
    """``torch.device("cuda", index)``; imports torch (no CUDA context)."""
    device: torch.device = torch_module().device("cuda", index)
    return device


def start_torch() -> None:
    """Import torch now, so that work queued for its CUDA initialisation
    (:func:`gpumagic.cuda.on_cuda_init`) can be registered; creates no context."""
    torch_module()
