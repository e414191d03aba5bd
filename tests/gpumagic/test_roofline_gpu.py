"""``%cudatime`` counting its own work on a real GPU (skipped without CUDA): exact FLOP
and byte counts of cuBLAS, copy and attention kernels, the % of peak from the table,
and the counting call outside every timed number."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from cudatime_call import cudatime

from gpumagic.peaks import device_peak, flops_peak

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell


pytestmark = pytest.mark.cuda

GiB = 1 << 30


def test_the_device_is_in_the_peak_table(torch: Any) -> None:
    name = torch.cuda.get_device_name()
    if not any(key in name for key in ("H100", "H200")):
        pytest.skip(f"the done-when cases are for H100 or H200; this is {name}")
    row = device_peak(name)
    assert row is not None, name
    assert row.source.startswith("https://")


@pytest.mark.gpu_timing
def test_a_4096_cubed_bf16_matmul_and_its_percent_of_peak(
    shell: InteractiveShell, torch: Any
) -> None:
    shell.user_ns["a"] = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    shell.user_ns["b"] = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    r = cudatime(shell, "a @ b")
    assert r.clock == "gpu"
    assert r.flops == 2 * 4096**3
    assert r.bytes == 3 * 4096 * 4096 * 2
    assert (r.flops_counted, r.bytes_counted, r.flops_dtype) == (True, True, "bf16")
    assert r.not_counted == []
    name = torch.cuda.get_device_name()
    peak = flops_peak(name, "bf16")
    if peak is None:
        pytest.skip(f"{name} is not in the peak table")
    assert r.peak_flops == peak
    fraction = r.flops / r.median / peak
    text = " ".join(r.text().split())
    assert f"{fraction * 100:.0f} % of {peak / 1e12:.3g} TFLOP/s dense bf16" in text
    assert 0.3 < fraction < 1.05, (fraction, r.median)  # cuBLAS reaches 60-80 % here
    assert "roofline compute-bound" in text
    assert '<svg class="gpumagic-roofline"' in r._repr_html_()


def test_a_copy_of_1_gib_moves_2_gib(shell: InteractiveShell, torch: Any) -> None:
    shell.user_ns["x"] = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    shell.user_ns["y"] = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    copy = cudatime(shell, "--budget 0.3 y.copy_(x)")
    assert (copy.flops, copy.bytes) == (0, 2 * GiB)
    assert copy.not_counted == []
    assert copy.roofline is not None
    assert copy.roofline.bound == "memory-bound"
    if copy.peak_bytes_per_s:
        assert 0.2 < copy.gbps * 1e9 / copy.peak_bytes_per_s < 1.05  # type: ignore[operator]
    clone = cudatime(shell, "--budget 0.3 x.clone()")
    assert clone.bytes == 2 * GiB
    del shell.user_ns["x"], shell.user_ns["y"]


def test_scaled_dot_product_attention_is_counted(shell: InteractiveShell, torch: Any) -> None:
    b, h, s, d = 4, 16, 2048, 64
    for name in "qkv":
        shell.user_ns[name] = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    shell.user_ns["F"] = torch.nn.functional
    r = cudatime(shell, "--budget 0.3 F.scaled_dot_product_attention(q, k, v)")
    assert r.flops == 4 * b * h * s * s * d
    assert r.flops_dtype == "bf16"
    assert r.not_counted == []
    causal = cudatime(shell, "--budget 0.3 F.scaled_dot_product_attention(q, k, v, is_causal=True)")
    assert 0 < causal.flops <= r.flops  # type: ignore[operator]


def test_fp32_matmuls_count_as_tf32_when_torch_allows_it(
    shell: InteractiveShell, torch: Any
) -> None:
    shell.user_ns["m"] = torch.randn(1024, 1024, device="cuda")
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert cudatime(shell, "--budget 0.2 m @ m").flops_dtype == "fp32"
        torch.backends.cuda.matmul.allow_tf32 = True
        r = cudatime(shell, "--budget 0.2 m @ m")
        assert r.flops_dtype == "tf32"
        assert r.peak_flops == flops_peak(torch.cuda.get_device_name(), "tf32")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_the_counting_call_is_outside_every_timed_number(
    shell: InteractiveShell, torch: Any
) -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    shell.user_ns.update(seen=[], mode=_get_current_dispatch_mode)
    shell.user_ns["a"] = torch.randn(256, 256, device="cuda")
    for options in ("-n 50 -r 3 -w 0", "-n 50 -r 3 -w 0 --kernels --sync-check", "--cold -r 3"):
        shell.user_ns["seen"] = seen = []
        r = cudatime(shell, f"{options} seen.append(mode()); a @ a")
        assert sum(m is not None for m in seen) == 1, options
        assert seen[-1] is not None, options  # the last call of all
        assert r.flops == 2 * 256**3
    shell.user_ns["seen"] = seen = []
    cudatime(shell, "--graph -n 64 -r 3 seen.append(mode()); a @ a")
    assert seen[-1] is not None
    assert sum(m is not None for m in seen) == 1
