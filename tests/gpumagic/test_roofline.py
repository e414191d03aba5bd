"""The peak table, the roofline's ridge and verdict, and its SVG (pure)."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET

import pytest

from gpumagic.peaks import BASIS, PEAK_TABLE, device_peak, flops_peak, peaks_for
from gpumagic.roofline import Roofline

T = 1e12


@pytest.mark.parametrize(
    ("name", "model", "bandwidth"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 3.35e12),
        ("NVIDIA H100 PCIe", "H100 PCIe", 2.0e12),
        ("NVIDIA H100 NVL", "H100 NVL", 3.9e12),
        ("NVIDIA H200", "H200 SXM", 4.8e12),
        ("NVIDIA H200 NVL", "H200 NVL", 4.8e12),
        ("NVIDIA GH200 480GB", "GH200", None),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB SXM", 1.555e12),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM", 2.039e12),
        ("NVIDIA A100-PCIE-40GB", "A100 40GB PCIe", 1.555e12),
        ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe", 1.935e12),
        ("NVIDIA L40S", "L40S", 0.864e12),
        ("NVIDIA L4", "L4", 0.3e12),
        ("NVIDIA A10", "A10", 0.6e12),
        ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada", 0.96e12),
        ("NVIDIA B200", "B200", 8e12),
    ],
)
def test_device_names_find_their_row(name: str, model: str, bandwidth: float | None) -> None:
    row = device_peak(name)
    assert row is not None
    assert row.model == model
    assert row.bandwidth == (pytest.approx(bandwidth) if bandwidth else None)


@pytest.mark.parametrize(
    "name", ["NVIDIA L40", "NVIDIA A10G", "Tesla T4", "NVIDIA GeForce GTX 1080"]
)
def test_other_devices_have_no_row(name: str) -> None:
    assert device_peak(name) is None
    peaks = peaks_for(name, "bf16", 1e12)
    assert peaks.flops is None
    assert peaks.basis == f"peak unknown for {name}"
    assert peaks.bandwidth == 1e12  # the hardware's own figure


def test_every_row_is_sourced_and_ordered_by_precision() -> None:
    for row in PEAK_TABLE:
        assert row.source.startswith("https://www.nvidia.com/") or row.source.startswith(
            ("https://resources.nvidia.com/", "https://images.nvidia.com/")
        ), row
        assert row.bf16 == row.fp16
        assert row.bf16 is not None
        assert row.tf32 is not None
        assert row.tf32 < row.bf16
        if row.fp8 is not None:
            assert row.fp8 == pytest.approx(2 * row.bf16, rel=0.02)  # L40S: 733 vs 362.05
        if row.fp32 is not None:
            assert row.fp32 <= row.tf32


def test_the_h100_figures() -> None:
    name = "NVIDIA H100 80GB HBM3"
    assert flops_peak(name, "bf16") == pytest.approx(989.4 * T)
    assert flops_peak(name, "tf32") == pytest.approx(494.7 * T)
    assert flops_peak(name, "fp32") == pytest.approx(67 * T)
    assert flops_peak(name, "fp64") == pytest.approx(67 * T)
    assert flops_peak(name, "int8") is None
    peaks = peaks_for(name, "", 3.0e12)
    assert (peaks.flops, peaks.basis) == (pytest.approx(989.4 * T), BASIS["bf16"])
    assert peaks.bandwidth == pytest.approx(3.35e12)  # the data sheet's, not the hardware's
    assert "nvidia.com" in peaks.source


def test_a_precision_the_data_sheet_lacks_is_named() -> None:
    peaks = peaks_for("NVIDIA L4", "fp64", None)
    assert peaks.flops is None
    assert peaks.basis == "no fp64 peak for the L4 in the table"


def h100(flops: float, nbytes: float, seconds: float) -> Roofline:
    return Roofline(flops, nbytes, seconds, 989.4 * T, 3.35e12)


def test_ridge_and_verdicts() -> None:
    matmul = h100(2 * 4096**3, 3 * 4096**2 * 2, 200e-6)
    copy = h100(0, 2 << 30, 1e-3)
    assert matmul.ridge == pytest.approx(989.4e12 / 3.35e12)
    assert matmul.intensity == pytest.approx(4096 / 3)
    assert matmul.bound == "compute-bound"
    assert matmul.roof == pytest.approx(989.4 * T)
    assert copy.intensity == 0
    assert copy.bound == "memory-bound"
    assert Roofline(1, 1, 1, None, 3e12).bound == ""


def test_the_text_line() -> None:
    name, verdict, detail = h100(2 * 4096**3, 3 * 4096**2 * 2, 200e-6).row()
    assert (name, verdict) == ("roofline", "compute-bound")
    assert detail == (
        "1,365 FLOP/B, above the ridge at 295 FLOP/B (989 TFLOP/s ÷ 3.35 TB/s); 69 % of the roof"
    )
    name, value, detail = Roofline(10, 5, 1, None, None).row()
    assert (name, value) == ("intensity", "2 FLOP/B")


def points(svg: str) -> ET.Element:
    return ET.fromstring(svg.replace("÷", "/"))


@pytest.mark.parametrize(
    ("flops", "nbytes", "seconds"),
    [
        (2 * 4096**3, 3 * 4096**2 * 2, 200e-6),  # compute-bound, near the roof
        (2**20, 3 << 30, 1e-3),  # memory-bound, far left
        (1e6, 1e6, 10.0),  # far below the roof
        (1e15, 1, 1.0),  # far right
    ],
)
def test_the_svg_is_self_contained_and_places_the_point_in_the_plot(
    flops: float, nbytes: float, seconds: float
) -> None:
    svg = h100(flops, nbytes, seconds).svg()
    root = points(svg)  # well-formed XML
    assert root.tag == "svg"
    assert "<script" not in svg
    assert not re.search(r"https?:|url\(|@import|href", svg)
    assert "currentColor" in svg
    assert "fill-opacity" in svg  # translucent, so it reads on any background
    width, height = float(root.get("width", 0)), float(root.get("height", 0))
    dot = root.find("circle")
    assert dot is not None
    x, y = float(dot.get("cx", -1)), float(dot.get("cy", -1))
    assert 0 < x < width
    assert 0 < y < height
    assert "ridge" in svg
    assert "roofline" in (root.get("aria-label") or "")


def test_no_svg_without_peaks_or_flops() -> None:
    assert Roofline(1e9, 1e6, 1.0, None, None).svg() == ""
    assert h100(0, 1 << 30, 1.0).svg() == ""
    assert not math.isnan(h100(0, 1 << 30, 1.0).intensity)


def _rate_label_y(svg: str) -> tuple[float, float]:
    point = re.search(r'<circle cx="[\d.]+" cy="([\d.]+)" r="4.5"', svg)
    label = re.search(r'<text x="[\d.]+" y="([\d.]+)" text-anchor="(?:start|end)" ', svg)
    assert point is not None
    assert label is not None
    return float(point.group(1)), float(label.group(1))


def test_the_rate_label_goes_below_a_point_just_under_the_roof() -> None:
    # 171 FLOP/B at 38 TFLOP/s against an fp32 roof of 67 TFLOP/s: the roof runs just
    # above the point, so the label goes under it; far below the roof, above it.
    near = Roofline(2 * 1024**3, 3 * 4 * 1024**2, 2 * 1024**3 / 38e12, 67e12, 3.35e12)
    py, label = _rate_label_y(near.svg())
    assert label > py
    far = Roofline(2 * 1024**3, 3 * 4 * 1024**2, 2 * 1024**3 / 0.5e12, 67e12, 3.35e12)
    py, label = _rate_label_y(far.svg())
    assert label < py
