"""Peak throughput of NVIDIA GPUs from their data sheets, by device name (pure).

The hardware reports its memory clock and bus width (:func:`gpumagic.cuda.device_peaks`
turns them into a DRAM bandwidth), not its tensor-core throughput: that comes from this
table. Each row gives the **dense** peaks (NVIDIA's data sheets print the figures with
2:4 structured sparsity next to them, marked with an asterisk: those are halved here),
the memory bandwidth, and the data sheet it was read from.

Columns, in FLOP/s (bytes/s for the bandwidth):

* ``bf16``, ``fp16``: tensor cores, fp32 accumulate (what torch's matmuls use);
* ``tf32``: tensor cores, for fp32 matmuls and convolutions when torch allows TF32
  (``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``);
* ``fp32``: the CUDA cores (an fp32 matmul with TF32 off runs there);
* ``fp64``: the FP64 tensor cores where the GPU has them (A100, H100, H200, B200),
  which cuBLAS uses for fp64 matmuls; ``None`` where the data sheet gives no figure;
* ``fp8``: tensor cores (``torch._scaled_mm``), where the GPU has them.

A name matches the first row whose pattern it contains (case-insensitive), so the more
specific names come first. A GPU not in the table has "peak unknown".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["BASIS", "PEAK_TABLE", "DevicePeak", "Peaks", "device_peak", "flops_peak", "peaks_for"]

#: What each precision's peak is, as the output names it.
BASIS = {
    "bf16": "dense bf16 tensor-core peak",
    "fp16": "dense fp16 tensor-core peak",
    "tf32": "dense tf32 tensor-core peak",
    "fp32": "fp32 peak (CUDA cores)",
    "fp64": "fp64 peak",
    "fp8": "dense fp8 tensor-core peak",
}

T = 1e12  # FLOP/s or bytes/s in a tera

_H100 = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_H200 = "https://www.nvidia.com/en-us/data-center/h200/"
_GH200 = "https://www.nvidia.com/en-us/data-center/grace-hopper-superchip/"
_A100 = (
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
_B200 = "https://www.nvidia.com/en-us/data-center/hgx/"
_L40S = "https://www.nvidia.com/en-us/data-center/l40s/"
_L4 = "https://www.nvidia.com/en-us/data-center/l4/"
_A10 = "https://www.nvidia.com/en-us/data-center/products/a10-gpu/"
_ADA = (
    "https://images.nvidia.com/aem-dam/Solutions/Data-Center/l4/"
    "nvidia-ada-gpu-architecture-whitepaper-v2.1.pdf"
)


@dataclass(frozen=True)
class DevicePeak:
    """One GPU's dense peaks (FLOP/s), memory bandwidth (bytes/s) and their source.
    ``None``: the data sheet gives no figure."""

    pattern: str
    model: str
    bf16: float | None
    fp16: float | None
    tf32: float | None
    fp32: float | None
    fp64: float | None
    fp8: float | None
    bandwidth: float | None
    source: str

    def flops(self, dtype: str) -> float | None:
        """The peak for ``dtype`` (a :data:`BASIS` key), if the data sheet gives one."""
        value = getattr(self, dtype, None) if dtype in BASIS else None
        return float(value) if value else None


def _row(
    pattern: str,
    model: str,
    figures: tuple[float | None, float | None, float | None, float | None, float | None],
    bandwidth: float | None,
    source: str,
) -> DevicePeak:
    """A row from tera-figures: (bf16, tf32, fp32, fp64, fp8) and the bandwidth in TB/s;
    fp16 runs at the bf16 rate on every GPU here (fp32 accumulate)."""
    bf16, tf32, fp32, fp64, fp8 = (v * T if v is not None else None for v in figures)
    tb = bandwidth * T if bandwidth is not None else None
    return DevicePeak(pattern, model, bf16, bf16, tf32, fp32, fp64, fp8, tb, source)


# Dense figures in TFLOP/s (the data sheets' sparse ones halved), bandwidth in TB/s.
# pattern, model, (bf16/fp16, tf32, fp32, fp64, fp8), bandwidth, source
PEAK_TABLE: tuple[DevicePeak, ...] = (
    # Grace Hopper: the H100 SXM's compute; HBM3 (4 TB/s) and HBM3e (4.9 TB/s) boards
    # share the name, so the bandwidth comes from the hardware.
    _row("GH200", "GH200", (989.4, 494.7, 67, 67, 1978.9), None, _GH200),
    _row("H200 NVL", "H200 NVL", (835.5, 417.5, 60, 60, 1670.5), 4.8, _H200),
    _row("H200", "H200 SXM", (989.4, 494.7, 67, 67, 1978.9), 4.8, _H200),
    _row("H100 PCIe", "H100 PCIe", (756.5, 378, 51, 51, 1513), 2.0, _H100),
    _row("H100 NVL", "H100 NVL", (835.5, 417.5, 60, 60, 1670.5), 3.9, _H100),
    _row("H100", "H100 SXM", (989.4, 494.7, 67, 67, 1978.9), 3.35, _H100),
    # Export variant of the H100 SXM: its tensor-core rate; nothing else published.
    _row("H800", "H800", (989.4, 494.7, None, None, 1978.9), None, _H100),
    _row(r"A100.*80GB.*PCIe", "A100 80GB PCIe", (312, 156, 19.5, 19.5, None), 1.935, _A100),
    _row(r"A100.*PCIe", "A100 40GB PCIe", (312, 156, 19.5, 19.5, None), 1.555, _A100),
    _row(r"A100.*80GB", "A100 80GB SXM", (312, 156, 19.5, 19.5, None), 2.039, _A100),
    _row(r"A100.*40GB", "A100 40GB SXM", (312, 156, 19.5, 19.5, None), 1.555, _A100),
    # Other A100 boards: the same compute, the bandwidth from the hardware.
    _row("A100", "A100", (312, 156, 19.5, 19.5, None), None, _A100),
    _row("A800", "A800", (312, 156, 19.5, None, None), None, _A100),
    # HGX B200: the 8-GPU board's figures divided by 8.
    _row("B200", "B200", (2250, 1125, 75, 37, 4500), 8.0, _B200),
    _row("L40S", "L40S", (362.05, 183, 91.6, None, 733), 0.864, _L40S),
    _row(r"\bL4\b", "L4", (121, 60, 30.3, None, 242.5), 0.3, _L4),
    _row(r"\bA10\b", "A10", (125, 62.5, 31.2, None, None), 0.6, _A10),
    _row("RTX 6000 Ada", "RTX 6000 Ada", (364.2, 182.1, 91.1, None, 728.5), 0.96, _ADA),
    _row("RTX 4090", "RTX 4090", (165.2, 82.6, 82.6, None, 330.3), 1.008, _ADA),
)


def device_peak(name: str) -> DevicePeak | None:
    """The table's row for the device called ``name``
    (``torch.cuda.get_device_name()``), or ``None``: peak unknown."""
    return next((row for row in PEAK_TABLE if re.search(row.pattern, name, re.I)), None)


def flops_peak(name: str, dtype: str) -> float | None:
    """The dense peak (FLOP/s) of the device called ``name`` for ``dtype`` (a
    :data:`BASIS` key), if known."""
    row = device_peak(name)
    return row.flops(dtype) if row is not None else None


@dataclass(frozen=True)
class Peaks:
    """What a measurement is compared with: the FLOP/s peak for its precision and what
    it is (or why there is none), the memory bandwidth, and their source."""

    flops: float | None
    basis: str
    bandwidth: float | None
    source: str


def peaks_for(name: str, dtype: str, hardware_bandwidth: float | None) -> Peaks:
    """The peaks of the device called ``name`` for FLOPs in ``dtype`` (``""``: not
    known, taken as bf16). The bandwidth is the data sheet's, else the one the hardware
    reports (``hardware_bandwidth``, from its memory clock and bus width)."""
    row = device_peak(name)
    dtype = dtype or "bf16"
    if row is None:
        return Peaks(None, f"peak unknown for {name}", hardware_bandwidth, "")
    flops = row.flops(dtype)
    basis = BASIS[dtype] if flops else f"no {dtype} peak for the {row.model} in the table"
    return Peaks(flops, basis, row.bandwidth or hardware_bandwidth, row.source)
