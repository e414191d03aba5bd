"""Counting FLOPs and bytes (``gpumagic.cuda.count_ops``) on CPU tensors: the counters
are torch's dispatch machinery, the same on the CPU as on the GPU, so the counts are
exact here (the GPU kernels are in ``test_roofline_gpu.py``)."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from gpumagic import cuda

torch: Any = pytest.importorskip("torch")

N = 128


def test_a_matmul_counts_two_n_cubed_flops_and_its_three_matrices() -> None:
    a = torch.randn(N, N, dtype=torch.bfloat16)
    b = torch.randn(N, N, dtype=torch.bfloat16)
    counts = cuda.count_ops(lambda: a @ b)
    assert counts is not None
    assert counts.flops == 2 * N**3
    assert counts.bytes == 3 * N * N * 2  # a and b read, the product written
    assert counts.flops_by_dtype == {"bf16": 2 * N**3}
    assert counts.dtype == "bf16"
    assert counts.not_counted == ()


def test_a_copy_moves_twice_its_size() -> None:
    x = torch.randn(1 << 16)
    y = torch.empty_like(x)
    size = x.numel() * x.element_size()
    copy = cuda.count_ops(lambda: y.copy_(x))
    clone = cuda.count_ops(x.clone)
    assert copy is not None
    assert clone is not None
    assert (copy.flops, copy.bytes, copy.not_counted) == (0, 2 * size, ())
    assert (clone.flops, clone.bytes) == (0, 2 * size)


def test_views_move_nothing_and_in_place_ops_read_and_write() -> None:
    x = torch.randn(64, 64)
    y = torch.randn(64, 64)
    out = torch.empty(64, 64)
    size = 64 * 64 * 4
    views = cuda.count_ops(lambda: x.view(-1)[:10].unsqueeze(0).t())
    in_place = cuda.count_ops(lambda: x.add_(y))
    into = cuda.count_ops(lambda: torch.add(x, y, out=out))
    assert views is not None
    assert in_place is not None
    assert into is not None
    assert views.bytes == 0
    assert in_place.bytes == 3 * size  # x and y read, x written
    assert into.bytes == 3 * size  # x and y read, out only written


def test_a_broadcast_operand_counts_once() -> None:
    x = torch.randn(256, 256)
    row = torch.randn(256)
    counts = cuda.count_ops(lambda: x + row.expand(256, 256))
    assert counts is not None
    assert counts.bytes == (2 * 256 * 256 + 256) * 4


def test_arithmetic_without_a_flop_formula_is_listed() -> None:
    x = torch.randn(32, 32)
    counts = cuda.count_ops(lambda: torch.softmax(x * 2, -1).sum())
    assert counts is not None
    assert counts.flops == 0
    assert counts.not_counted == ("aten::mul.Tensor", "aten::_softmax", "aten::sum")


def test_data_movement_is_not_listed() -> None:
    x = torch.randn(32, 32)

    def body() -> None:
        y = torch.zeros(32, 32)
        y.copy_(x)
        torch.cat([x, y]).contiguous()
        x[x > 0]
        x.fill_(1.0)
        torch.randn(4)

    counts = cuda.count_ops(body)
    assert counts is not None
    assert counts.not_counted == ()


def test_scaled_dot_product_attention_is_counted_on_the_cpu() -> None:
    b, h, s, d = 2, 4, 128, 32
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    counts = cuda.count_ops(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert counts is not None
    assert counts.flops == 4 * b * h * s * s * d  # two products over the sequence
    assert counts.not_counted == ()


def test_the_dominant_precision_is_the_one_with_most_flops() -> None:
    small = torch.randn(16, 16, dtype=torch.float64)
    big = torch.randn(64, 64, dtype=torch.float16)
    counts = cuda.count_ops(lambda: (small @ small, big @ big))
    assert counts is not None
    assert counts.flops_by_dtype == {"fp64": 2 * 16**3, "fp16": 2 * 64**3}
    assert counts.dtype == "fp16"


def test_without_flops_the_precision_is_that_of_the_bytes_moved() -> None:
    # A reduction has no FLOP formula: its roofline uses fp32's peaks, not bf16's.
    x = torch.randn(256, 256)
    counts = cuda.count_ops(x.sum)
    assert counts is not None
    assert (counts.flops, counts.flops_by_dtype) == (0, {})
    assert counts.bytes_by_dtype == {"fp32": counts.bytes}
    assert counts.dtype == "fp32"


def test_a_body_that_raises_leaves_no_mode_behind() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    def body() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        cuda.count_ops(body)
    assert _get_current_dispatch_mode() is None


def test_nothing_is_counted_before_torch_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch")
    assert cuda.count_ops(lambda: None) is None
    assert not cuda.can_count()  # and %cudatime loads no counters


def test_the_counters_load_once_a_process() -> None:
    """``%cudatime`` times this on its own, inside its budget (issue 39: the first count
    of a session cost 0.69 s and was never said)."""
    assert cuda.can_count()
    cuda.load_counters()  # loaded now, or by an earlier test of this process
    assert cuda.load_counters() is False
    counts = cuda.count_ops(lambda: torch.ones(4) * 2)
    assert counts is not None
    assert counts.ops == 2
