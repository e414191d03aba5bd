"""Leak checks as a GPU suite uses them: none of these tests leaks.

``pytest examples/sample_suite`` checks the marked test; ``--cuda-leak-check`` checks
every test that uses CUDA, ``--cuda-leak-trace`` adds the lines that allocated what a
leaking test left behind, ``--cuda-memory-report 5`` lists the five largest peaks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from pytest_cuda import no_cuda_leak

if TYPE_CHECKING:
    import torch

_CACHE: dict[str, torch.Tensor] = {}


@pytest.mark.cuda_leak_check
def test_training_step_frees_what_it_allocates(cuda_device: torch.device) -> None:
    """The first matmul's cuBLAS workspace is kept by design: not reported as a leak."""
    import torch

    model = torch.nn.Linear(256, 256, device=cuda_device)
    loss = model(torch.randn(64, 256, device=cuda_device)).square().mean()
    loss.backward()
    assert model.weight.grad is not None


@pytest.mark.cuda_leak_check(tolerance="1KiB")
def test_cache_is_emptied(cuda_device: torch.device) -> None:
    """A module-level cache may hold tensors during the test, not after it."""
    import torch

    _CACHE["ones"] = torch.ones(1024, device=cuda_device)
    assert _CACHE["ones"].sum().item() == 1024
    _CACHE.clear()


def test_block_inside_a_test(cuda_device: torch.device) -> None:
    """``no_cuda_leak`` checks one block; a leak there fails with the allocating line."""
    import torch

    with no_cuda_leak():
        x = torch.randn(4096, device=cuda_device)
        assert x.isfinite().all().item()
        del x
