"""A sample GPU test suite for the demo: runs anywhere, uses the GPU where there is one."""

from __future__ import annotations

import pytest


def test_on_the_cpu() -> None:
    import torch

    assert torch.ones(3).sum().item() == 3


@pytest.mark.cuda
def test_on_the_gpu() -> None:
    import torch

    x = torch.ones(3, device="cuda")
    assert x.sum().item() == 3
