"""pytest_cuda's marker forms and device fixtures, as a GPU suite uses them.

``pytest -rs examples/sample_suite`` runs what this machine can and says why it skips
the rest; ``--cuda-devices=0,1`` picks devices, ``-n 2 --cuda-devices=0,1`` gives each
pytest-xdist worker its own, ``--cuda-require`` turns every skip into a failure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch


def test_runs_once_per_device(cuda_device: torch.device) -> None:
    """``test_runs_once_per_device[cuda:0]``, ``[cuda:1]``, …: one run per selected GPU."""
    import torch

    x = torch.arange(6.0, device=cuda_device).reshape(2, 3)
    assert (x @ x.T).trace().item() == 55.0


@pytest.mark.cuda(min_memory="2GiB")
def test_needs_free_memory(cuda_device: torch.device) -> None:
    """Skipped (with the free memory found) on a device with less than 2 GiB free."""
    import torch

    block = torch.empty(2**28, device=cuda_device)  # 1 GiB of float32
    assert block.numel() == 2**28


@pytest.mark.cuda(min_capability=(8, 0))
def test_bfloat16_matmul(cuda_device: torch.device) -> None:
    """bfloat16 tensor cores need sm_80 or newer: skipped (naming both) on older GPUs."""
    import torch

    a = torch.ones(64, 64, device=cuda_device, dtype=torch.bfloat16)
    assert (a @ a)[0, 0].item() == 64.0


@pytest.mark.cuda(min_devices=2)
def test_copy_between_devices(cuda_devices: list[torch.device]) -> None:
    """Needs two GPUs: skipped with the devices there are on a one-GPU machine."""
    import torch

    first, second = cuda_devices[:2]
    moved = torch.full((4,), 7.0, device=first).to(second)
    assert moved.device == second
    assert moved.sum().item() == 28.0


@pytest.mark.cuda(min_memory="1TiB")
def test_needs_a_terabyte() -> None:
    """No GPU has 1 TiB free today: the skip reason shows what the device has."""
