"""The report header: versions and the selected devices, from discovery alone.

It comes after collection when some test uses CUDA (a suite without CUDA tests does no
discovery at all), and at the top of the run when devices were asked for or xdist
workers start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fake_cuda import CPU_BUILD, CPU_BUILD_REASON, board, h200s
from gpumagic import cuda

if TYPE_CHECKING:
    import pytest

    from conftest import FakeGpus

CUDA_TEST = """
import pytest

@pytest.mark.cuda
def test_gpu():
    pass
"""
CPU_TEST = "def test_cpu():\n    pass\n"

COUNTING_CONFTEST = """
import fake_cuda
from gpumagic.cuda import discovery

fake_cuda.install_planted()
calls = []
real = discovery._status_now
discovery._status_now = lambda: calls.append(1) or real()


def pytest_unconfigure(config):
    print("DISCOVERIES:", len(calls))
"""


def header_lines(result: pytest.RunResult) -> list[str]:
    starts = ("cuda", "  cuda:", "  gw", "  no worker")
    return [line for line in result.outlines if line.startswith(starts)]


def test_header_lists_versions_and_devices(pytester: pytest.Pytester, fake_gpus: FakeGpus) -> None:
    a100 = board(1, "NVIDIA A100-SXM4-80GB", total=85_899_345_920, capability=(8, 0))
    fake_gpus([board(0), a100])
    pytester.makepyfile(CUDA_TEST)
    result = pytester.runpytest()
    result.assert_outcomes(passed=1)
    assert header_lines(result) == [
        "cuda: torch 2.11.0+cu130, CUDA 13.0, driver 580.95.05",
        "cuda devices (available):",
        "  cuda:0 NVIDIA H200 (140.4 GiB, sm_90)",
        "  cuda:1 NVIDIA A100-SXM4-80GB (80.0 GiB, sm_80)",
    ]


def test_header_shows_the_selection(pytester: pytest.Pytester, fake_gpus: FakeGpus) -> None:
    fake_gpus(h200s(3))
    pytester.makepyfile(CPU_TEST)
    result = pytester.runpytest("--cuda-devices=2,1")
    assert header_lines(result)[1:] == [
        "cuda devices (selected by --cuda-devices=2,1):",
        "  cuda:2 NVIDIA H200 (140.4 GiB, sm_90)",
        "  cuda:1 NVIDIA H200 (140.4 GiB, sm_90)",
    ]


def test_header_shows_the_outer_visible_devices(
    pytester: pytest.Pytester, fake_gpus: FakeGpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_gpus([board(0), board(1, "NVIDIA L4", total=24_152_899_584, capability=(8, 9))])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    pytester.makepyfile(CUDA_TEST)
    assert header_lines(pytester.runpytest()) == [
        "cuda: torch 2.11.0+cu130, CUDA 13.0, driver 580.95.05, CUDA_VISIBLE_DEVICES='1'",
        "cuda devices (available):",
        "  cuda:0 NVIDIA L4 (22.5 GiB, sm_89)",
    ]


def test_header_is_one_line_without_cuda_in_torch(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus(**CPU_BUILD)
    pytester.makepyfile(CUDA_TEST)
    assert header_lines(pytester.runpytest()) == [
        f"cuda: torch 2.11.0+cpu; no usable GPU: {CPU_BUILD_REASON}"
    ]


def test_header_is_one_line_without_a_gpu(pytester: pytest.Pytester, fake_gpus: FakeGpus) -> None:
    fake_gpus([])
    pytester.makepyfile(CUDA_TEST)
    assert header_lines(pytester.runpytest()) == [
        "cuda: torch 2.11.0+cu130, CUDA 13.0, driver 580.95.05; "
        "no usable GPU: the NVIDIA driver reports no GPU"
    ]


def test_header_is_one_line_when_every_gpu_is_hidden(
    pytester: pytest.Pytester, fake_gpus: FakeGpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_gpus(h200s(2))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makepyfile(CUDA_TEST)
    assert header_lines(pytester.runpytest()) == [
        "cuda: torch 2.11.0+cu130, CUDA 13.0, driver 580.95.05; "
        "no usable GPU: CUDA_VISIBLE_DEVICES='' hides all 2 GPU(s) of this machine"
    ]


def test_header_on_this_machine(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(CUDA_TEST)
    result = pytester.runpytest("-rs")
    status = cuda.status()
    first = header_lines(result)[0]
    if status.available:
        assert first.startswith(f"cuda: torch {status.torch_version}, CUDA {status.cuda_version}")
    else:
        assert header_lines(result) == [f"cuda: {status.summary()}"]


def test_header_shows_the_worker_map(pytester: pytest.Pytester, fake_gpus: FakeGpus) -> None:
    fake_gpus(h200s(4))
    pytester.makepyfile(CPU_TEST)
    result = pytester.runpytest_subprocess(
        "-n", "2", "--cuda-devices=3,2,1,0", "--cuda-devices-per-worker=2"
    )
    result.assert_outcomes(passed=1)
    assert header_lines(result)[-3:] == [
        "cuda xdist workers (2 device(s) each):",
        "  gw0 → cuda:3 NVIDIA H200, cuda:2 NVIDIA H200 (CUDA_VISIBLE_DEVICES=3,2)",
        "  gw1 → cuda:1 NVIDIA H200, cuda:0 NVIDIA H200 (CUDA_VISIBLE_DEVICES=1,0)",
    ]


def test_header_says_which_devices_get_no_worker(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus(h200s(3))
    pytester.makepyfile(CPU_TEST)
    result = pytester.runpytest_subprocess("-n", "1", "--cuda-devices=all")
    result.assert_outcomes(passed=1)
    assert header_lines(result)[-3:] == [
        "cuda xdist workers (1 device(s) each):",
        "  gw0 → cuda:0 NVIDIA H200 (CUDA_VISIBLE_DEVICES=0)",
        "  no worker for cuda:1, cuda:2: -n 1 starts fewer workers than groups",
    ]


def test_cpu_suite_does_no_discovery_and_shows_no_header(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus(h200s(2))
    pytester.makeconftest(COUNTING_CONFTEST)
    pytester.makepyfile(CPU_TEST)
    result = pytester.runpytest("-s")
    result.assert_outcomes(passed=1)
    assert header_lines(result) == []
    result.stdout.fnmatch_lines(["*DISCOVERIES: 0"])


def test_header_follows_collection_when_a_test_uses_cuda(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus(h200s(1))
    pytester.makeconftest(COUNTING_CONFTEST)
    pytester.makepyfile(test_a=CPU_TEST, test_b="def test_device(cuda_device):\n    pass\n")
    result = pytester.runpytest("-s")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        ["collected 2 items", "cuda: torch 2.11.0+cu130, CUDA 13.0, driver 580.95.05", "*"]
    )
    result.stdout.fnmatch_lines(["*DISCOVERIES: 1"])


def test_header_comes_first_when_devices_are_asked_for(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus(h200s(1))
    pytester.makepyfile(CPU_TEST)
    result = pytester.runpytest("--cuda-devices=all")
    result.stdout.fnmatch_lines(
        ["cuda: torch 2.11.0+cu130, CUDA 13.0, driver 580.95.05", "*", "collected 1 item"]
    )
    assert len([line for line in result.outlines if line.startswith("cuda: ")]) == 1
