"""``CudaTimeResult`` and ``compare``: statistics, renderings and the TimeitResult interface."""

from __future__ import annotations

import json
import math
import re

import pytest

from gpumagic.timing_compare import compare
from gpumagic.timing_result import CudaTimeResult, KernelStat, SyncSite
from gpumagic.units import format_time, quantile


def result(per_loop: list[float], loops: int = 10, **kwargs: object) -> CudaTimeResult:
    runs = [t * loops for t in per_loop]
    fields: dict[str, object] = {
        "loops": loops,
        "repeat": len(runs),
        "all_runs": runs,
        "host_runs": [r * 1.01 for r in runs],
    }
    fields.update(kwargs)
    return CudaTimeResult(**fields)  # type: ignore[arg-type]


def test_quantile_interpolates_like_numpy() -> None:
    assert quantile([1, 2, 3, 4], 0.5) == 2.5
    assert quantile([1, 2, 3, 4], 0.25) == 1.75
    assert quantile([5], 0.75) == 5
    assert math.isnan(quantile([], 0.5))


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (170e-6, "170 µs"),
        (1.234e-3, "1.23 ms"),
        (2.5, "2.5 s"),
        (8.26e-9, "8.26 ns"),
        (0, "0 s"),
        (999.96e-9, "1 µs"),  # rounds up into the next unit, not "1e+03 ns"
        (0.99999, "1 s"),
    ],
)
def test_format_time(seconds: float, text: str) -> None:
    assert format_time(seconds) == text


def test_timeit_result_attributes_match_ipython() -> None:
    from IPython.core.magics.execution import TimeitResult

    per_loop = [3e-6, 1e-6, 2e-6, 4e-6]
    ours = result(per_loop, loops=100)
    theirs = TimeitResult(100, 4, 1e-6, 4e-6, ours.all_runs, 0.0, 3)
    for name in ("loops", "repeat", "best", "worst", "all_runs", "compile_time"):
        assert getattr(ours, name) == pytest.approx(getattr(theirs, name)), name
    for name in ("average", "stdev"):
        assert getattr(ours, name) == pytest.approx(getattr(theirs, name)), name
    assert ours.timings == pytest.approx(theirs.timings)


def test_robust_statistics() -> None:
    r = result([1e-3, 2e-3, 3e-3, 4e-3, 100e-3])
    assert r.median == pytest.approx(3e-3)
    assert r.q1 == pytest.approx(2e-3)
    assert r.q3 == pytest.approx(4e-3)
    assert r.iqr == pytest.approx(2e-3)
    assert r.rel_iqr == pytest.approx(2 / 3)
    assert r.gpu_time == pytest.approx(3e-3)
    assert r.host_time == pytest.approx(3.03e-3)
    assert r.gpu_times == r.timings


def test_host_clock_has_no_gpu_time() -> None:
    r = result([1e-3, 1e-3, 1e-3], clock="host")
    assert r.gpu_time is None
    assert r.gpu_times == []
    assert "host time" in str(r)
    assert "GPU time" not in r.text()


def test_text_names_the_three_clocks_and_the_verdict() -> None:
    r = result(
        [170e-6, 171e-6, 170.5e-6],
        loops=60,
        first_call=0.045,
        kernel_time=169e-6,
        kernels=[KernelStat("sm90_xmma_gemm_bf16", 1.0, 169e-6)],
        busy_fraction=0.98,
        verdict="GPU-bound: GPU busy 98% of wall time",
        device_name="NVIDIA H200",
        torch_version="2.11.0",
        cuda_version="13.0",
        label="torch.mm(a, b)",
        warnings=["the spread is large"],
        notes=["a note"],
    )
    text = r.text()
    assert text.startswith("%cudatime  torch.mm(a, b)")
    assert "NVIDIA H200 · torch 2.11.0 · CUDA 13.0" in text
    assert re.search(r"GPU time\s+170 µs per loop\s+median of 3 runs . 60 loops", text)
    assert "host wall" in text
    assert re.search(r"first call\s+45 ms\s+not in the numbers above\n", text)
    assert re.search(r"kernels\s+169 µs per loop\s+CUPTI, 1 kernel per loop · GPU busy 98 %", text)
    assert "verdict      GPU-bound" in text
    assert "  ! the spread is large" in text
    assert "  · a note" in text
    assert repr(r).startswith("<CudaTimeResult : 170 µs GPU time per loop")


def test_sync_sites_and_throughput_rows() -> None:
    r = result(
        [1e-3] * 3,
        syncs_per_loop=1.0,
        sync_sites=[SyncSite("Tensor.item", "line 3", "v = x.sum().item()", 1.0)],
        flops=2 * 4096**3,
        peak_flops=989.4e12,
        peak_flops_basis="dense bf16 tensor-core peak",
        bytes=1 << 30,
        peak_bytes_per_s=4.8e12,
    )
    text = r.text()
    assert "host syncs   1 per loop" in text
    assert "Tensor.item at line 3: v = x.sum().item()" in text
    assert r.tflops == pytest.approx(2 * 4096**3 / 1e-3 / 1e12)
    assert re.search(r"compute\s+137 TFLOP/s\s+14 % of 989 TFLOP/s dense bf16", text)
    assert re.search(r"memory\s+1.07 TB/s\s+22 % of 4.8 TB/s DRAM peak", text)


def test_counted_work_shows_rates_intensity_and_the_roofline() -> None:
    r = result(
        [200e-6] * 3,
        device_name="NVIDIA H100 80GB HBM3",
        flops=2 * 4096**3,
        bytes=3 * 4096**2 * 2,
        flops_counted=True,
        bytes_counted=True,
        flops_dtype="bf16",
        peak_flops=989.4e12,
        peak_flops_basis="dense bf16 tensor-core peak",
        peak_bytes_per_s=3.35e12,
    )
    text = " ".join(r.text().split())
    assert re.search(r"compute\s+687 TFLOP/s\s+69 % of 989 TFLOP/s dense bf16 tensor-core", text)
    assert "137 GFLOP per loop, counted" in text
    assert re.search(r"memory\s+503 GB/s\s+15 % of 3.35 TB/s DRAM peak", text)
    assert "96.0 MiB per loop read and written, counted (a lower bound)" in text
    assert re.search(r"roofline\s+compute-bound\s+1,365 FLOP/B, above the ridge at 295", text)
    page = r._repr_html_()
    assert '<svg class="gpumagic-roofline"' in page
    assert r.to_dict()["intensity"] == pytest.approx(4096 / 3)


def test_an_unknown_peak_says_so() -> None:
    r = result(
        [1e-3] * 3,
        device_name="Tesla T4",
        flops=1e9,
        bytes=1e8,
        flops_counted=True,
        peak_flops_basis="peak unknown for Tesla T4",
        peak_bytes_per_s=320e9,
    )
    text = r.text()
    assert re.search(r"compute\s+1 TFLOP/s\s+peak unknown for Tesla T4", text)
    assert re.search(r"intensity\s+10 FLOP/B", text)
    assert '<svg class="gpumagic-roofline"' not in r._repr_html_()


def test_pretty_printer_uses_the_text() -> None:
    from IPython.lib.pretty import pretty

    r = result([1e-3] * 3, label="x")
    assert pretty(r) == r.text()


def test_html_is_self_contained_and_escaped() -> None:
    r = result(
        [1e-3, 1.1e-3, 0.9e-3],
        label="a < b and '<script>'",
        warnings=["<b>careful</b>"],
        device_name="NVIDIA H200",
    )
    page = r._repr_html_()
    assert "<script" not in page
    assert "&lt;script&gt;" in page
    assert "&lt;b&gt;careful&lt;/b&gt;" in page
    assert "<link" not in page
    assert "http" not in page
    assert "<svg" in page  # the per-run sparkline, inline
    assert "color:" not in page  # text keeps the page's colours (light and dark themes)
    assert "GPU time" in page
    assert "NVIDIA H200" in page


def test_to_dict_is_json_and_complete() -> None:
    r = result(
        [1e-3, 2e-3, 3e-3],
        kernels=[KernelStat("k", 2.0, 1e-4)],
        sync_sites=[SyncSite("Tensor.item", "line 1", "x.item()", 1.0)],
    )
    data = json.loads(json.dumps(r.to_dict()))
    assert data["median"] == pytest.approx(2e-3)
    assert data["loops"] == 10
    assert data["kernels"][0]["name"] == "k"
    assert data["sync_sites"][0]["op"] == "Tensor.item"
    for key in ("best", "worst", "average", "stdev", "iqr", "host_time", "timings"):
        assert key in data


def test_compare_labels_same_faster_slower() -> None:
    base = result([10e-6, 10.2e-6, 9.9e-6, 10.1e-6, 10e-6, 10.05e-6], label="eager")
    same = result([10.1e-6, 10.0e-6, 10.2e-6, 9.95e-6, 10e-6, 10.05e-6], label="again")
    fast = result([5e-6, 5.1e-6, 4.9e-6, 5e-6, 5e-6, 5.05e-6], label="graph")
    slow = result([20e-6, 21e-6, 19e-6, 20e-6, 20e-6, 20.5e-6], label="cold")
    table = compare(base, same, fast, slow)
    assert [row.status for row in table.rows] == [
        "baseline",
        "no difference within the noise",
        "FASTER",
        "SLOWER",
    ]
    assert table.rows[2].speedup == pytest.approx(10.025 / 5.0, rel=0.01)
    low, high = table.rows[2].speedup_low, table.rows[2].speedup_high
    assert low is not None
    assert high is not None
    assert 1 < low < table.rows[2].speedup < high
    text = str(table)
    assert " ".join(text.splitlines()[0].split()) == (
        "median per loop IQR speedup 99 % interval vs baseline"
    )
    assert re.search(
        r"graph\s+5 µs \(gpu\)\s+5 µs . 5.04 µs\s+2.00.\s+1.94.2.07.\s+FASTER", text
    ), text
    page = table._repr_html_()
    assert page.count("<tr>") == 5
    assert "FASTER" in page
    assert json.dumps(table.to_dict())


def test_compare_labels_and_clock_mismatch() -> None:
    gpu = result([1e-3, 1.1e-3, 0.9e-3, 1e-3, 1.05e-3])
    host = result([1e-3, 1.1e-3, 0.9e-3, 1e-3, 1.05e-3], clock="host")
    table = compare(gpu, host, labels=["on the GPU", "on the host"])
    assert table.rows[0].label == "on the GPU"
    assert table.rows[1].status == "no difference within the noise (other clock)"


def test_compare_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one"):
        compare()
    with pytest.raises(TypeError, match="not float"):
        compare(1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 labels for 1 results"):
        compare(result([1e-3]), labels=["a", "b"])


def test_gpumagic_compare_is_lazy() -> None:
    import subprocess
    import sys

    code = (
        "import sys, gpumagic; assert 'gpumagic.timing_result' not in sys.modules; "
        "f = gpumagic.compare; assert 'gpumagic.timing_result' in sys.modules; "
        "assert 'torch' not in sys.modules and 'IPython' not in sys.modules; print(f.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "compare"
    import gpumagic

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        gpumagic.nope  # noqa: B018


def test_a_percentage_is_never_split_from_its_sign() -> None:
    """The spread's "(20 %)" wrapped as "(20" and "%)" on the next line."""
    for repeat in range(3, 40):  # run counts and spreads of every width
        for spread in (0.05, 0.2, 0.45):
            runs = [28.7e-3 * (1 + spread * ((i % 4) - 1.5) / 1.5) for i in range(repeat)]
            result = CudaTimeResult(
                loops=1, repeat=repeat, all_runs=runs, host_runs=runs, clock="host"
            )
            for line in result.text().splitlines()[1:]:
                assert not line.strip().startswith("%"), result.text()
