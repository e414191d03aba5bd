"""Compute peaks of NVIDIA GPUs from their data sheets, by device name (pure).

The hardware reports its memory bandwidth (:func:`gpumagic.cuda.device_peaks`), not
its tensor-core throughput: that comes from this table.
"""

from __future__ import annotations

__all__ = ["DENSE_BF16_BASIS", "dense_bf16_peak"]

DENSE_BF16_BASIS = "dense bf16 tensor-core peak"

# Dense bf16 tensor-core peaks (FLOP/s) from NVIDIA's data sheets, matched against the
# device name in this order (more specific names first).
DENSE_BF16_PEAKS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.4e12),
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100 NVL", 835.0e12),
    ("H100", 989.4e12),
    ("H800", 989.4e12),
    ("B200", 2250.0e12),
    ("A100", 312.0e12),
    ("A800", 312.0e12),
    ("L40S", 362.05e12),
    ("L4", 121.0e12),
    ("RTX 4090", 165.2e12),
)


def dense_bf16_peak(name: str) -> float | None:
    """The dense bf16 tensor-core peak (FLOP/s) of the device called ``name``, if known."""
    return next((peak for key, peak in DENSE_BF16_PEAKS if key in name), None)
