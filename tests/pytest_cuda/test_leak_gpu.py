"""The leak checks on a real GPU: a planted suite in fresh pytest processes, alone and
under ``-n 2`` on one GPU, and ``no_cuda_leak`` in this process.

The planted suite leaks 512 B, 4 KiB, 8 MiB and 1 GiB (each must be caught, with the
allocating line named), does what libraries keep memory for by design (first matmul,
cuDNN convolution, RNG seeding, an FFT plan, torch.compile, allocator growth, a module-level cache
emptied again, another process holding GPU memory: none may be reported), and fails
an assertion while leaking (both must be reported). Each inner run's output goes to
``$OUT/leaks_<run>.txt`` when ``$OUT`` is set, for the record.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from gpumagic import cuda
from pytest_cuda.leaks.block import CudaLeakError, no_cuda_leak

pytestmark = pytest.mark.cuda

PLANTED = """
import subprocess
import sys

import pytest
import torch

KEEP = []
CACHE = {}


def test_first_cuda_use_is_clean():
    x = torch.ones(1000, device="cuda")
    assert x.sum().item() == 1000


def test_leak_512b():
    KEEP.append(torch.ones(1, device="cuda"))  # leak: 512 B


def test_leak_4kib():
    KEEP.append(torch.empty(1024, device="cuda"))  # leak: 4 KiB


def test_leak_8mib():
    KEEP.append(torch.empty(2 * 1024 * 1024, device="cuda"))  # leak: 8 MiB


def test_leak_1gib():
    KEEP.append(torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))  # leak: 1 GiB


def test_first_matmul():
    a = torch.randn(512, 512, device="cuda")
    b = torch.randn(512, 512, device="cuda")
    assert (a @ b).isfinite().all().item()
    c = torch.nn.functional.linear(a, b, torch.ones(512, device="cuda"))
    assert c.shape == (512, 512)


def test_cudnn_convolution():
    assert torch.backends.cudnn.is_available()
    x = torch.randn(8, 16, 64, 64, device="cuda")
    w = torch.randn(32, 16, 3, 3, device="cuda")
    assert torch.nn.functional.conv2d(x, w, padding=1).shape == (8, 32, 64, 64)


def test_rng_seeding():
    torch.manual_seed(0)
    torch.cuda.manual_seed_all(0)
    first = torch.rand(16, device="cuda")
    torch.cuda.manual_seed(0)
    assert torch.equal(first, torch.rand(16, device="cuda"))


def test_module_cache_then_deleted():
    CACHE["activations"] = torch.randn(1 << 20, device="cuda")
    assert CACHE["activations"].numel() == 1 << 20
    del CACHE["activations"]


def test_fft_plan():
    x = torch.randn(1 << 16, device="cuda")
    assert torch.fft.irfft(torch.fft.rfft(x), n=x.numel()).sub(x).abs().max().item() < 1e-3


def test_allocator_growth():
    blocks = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(4)]
    assert torch.cuda.memory_reserved() >= 1 << 30
    del blocks


def test_first_torch_compile():
    f = torch.compile(lambda x: torch.sin(x) * 2 + 1)
    x = torch.randn(4096, device="cuda")
    assert torch.allclose(f(x), torch.sin(x) * 2 + 1)


@pytest.fixture(scope="module")
def other_process():
    # Another process holds 2 GiB on the same GPU for as long as this module runs.
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, torch; x = torch.empty(2 << 30, dtype=torch.uint8, device='cuda'); "
         "torch.cuda.synchronize(); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    yield holder
    holder.stdin.close()
    holder.wait(timeout=60)


def test_another_process_on_the_gpu(other_process):
    x = torch.randn(1000, device="cuda")
    assert x.isfinite().all().item()


def test_fails_and_leaks():
    KEEP.append(torch.empty(1024, device="cuda"))  # leak: failing
    assert torch.zeros(1, device="cuda").item() == 1
"""

PASSING = [
    "test_first_cuda_use_is_clean",
    "test_first_matmul",
    "test_cudnn_convolution",
    "test_rng_seeding",
    "test_module_cache_then_deleted",
    "test_fft_plan",
    "test_allocator_growth",
    "test_first_torch_compile",
    "test_another_process_on_the_gpu",
]
# name: (the amount as reported, the tag of its line). A leak that reuses a cached
# block larger than it asked for may read a little more (8.5 MiB): hence the patterns.
LEAKS = {
    "test_leak_512b": ("512 B", "512 B"),
    "test_leak_4kib": ("4.0 KiB", "4 KiB"),
    "test_leak_8mib": ("8.* MiB", "8 MiB"),
    "test_leak_1gib": ("1.0* GiB", "1 GiB"),
    "test_fails_and_leaks": ("4.0 KiB", "failing"),
}


def _line(tag: str) -> int:
    # pytester writes the source stripped: line 1 is ``import subprocess``.
    lines = PLANTED.strip().splitlines()
    return next(i for i, text in enumerate(lines, 1) if f"# leak: {tag}" in text)


def _record(name: str, result: pytest.RunResult) -> None:
    out = os.environ.get("OUT")
    if out:
        Path(out, f"leaks_{name}.txt").write_text(
            "\n".join(result.outlines) + "\n--- stderr ---\n" + "\n".join(result.errlines[-30:])
        )


def _check_planted(result: pytest.RunResult) -> None:
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == len(PASSING) + len(LEAKS) - 1, outcomes
    assert outcomes.get("failed") == 1, outcomes
    assert outcomes.get("leaked") == len(LEAKS), outcomes
    expected = []
    for name, (amount, tag) in LEAKS.items():
        expected.append(
            f"LEAKED test_planted.py::{name} - {amount} on cuda:0, allocated at "
            f"test_planted.py:{_line(tag)} in {name}, held by test_planted.KEEP*(module global)"
        )
    expected.append("FAILED test_planted.py::test_fails_and_leaks - *assert 0.0 == 1")
    result.stdout.fnmatch_lines_random(expected)
    for name in PASSING:
        result.stdout.no_fnmatch_line(f"LEAKED *::{name} *")
    leaked = re.findall(r"^LEAKED test_planted.py::(\w+) ", result.stdout.str(), re.M)
    assert sorted(leaked) == sorted(LEAKS)


def test_the_planted_suite_alone(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_planted=PLANTED)
    result = pytester.runpytest_subprocess(
        "--cuda-leak-check",
        "--cuda-leak-trace",
        "--cuda-memory-report=3",
        "-v",
        "-rf",
        "-p",
        "no:cacheprovider",
        timeout=240,
    )
    _record("alone", result)
    _check_planted(result)
    result.stdout.fnmatch_lines(
        [
            "*= CUDA memory: the 3 largest peaks =*",
            "*1.0 GiB  cuda:0  test_planted.py::test_* (+*",
        ]
    )


def test_the_planted_suite_under_xdist_on_one_gpu(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    pytester.makepyfile(test_planted=PLANTED)
    result = pytester.runpytest_subprocess(
        "-n",
        "2",
        "--cuda-leak-check",
        "--cuda-leak-trace",
        "-rf",
        "-p",
        "no:cacheprovider",
        timeout=240,
    )
    _record("xdist", result)
    _check_planted(result)


def test_without_trace_the_leaks_are_still_caught_by_the_marker(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_marked="""
        import pytest
        import torch

        KEEP = []

        @pytest.mark.cuda_leak_check
        def test_marked_leak():
            KEEP.append(torch.ones(1, device="cuda"))

        def test_unmarked_leak():
            KEEP.append(torch.ones(1, device="cuda"))

        @pytest.mark.cuda_leak_check(mode="warn")
        def test_warned_leak():
            KEEP.append(torch.empty(1024, device="cuda"))
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    _record("marker", result)
    outcomes = result.parseoutcomes()
    assert (outcomes["passed"], outcomes["leaked"]) == (3, 1), outcomes
    result.stdout.fnmatch_lines_random(
        [
            # The run itself names the line and the holder: no re-run.
            "LEAKED test_marked.py::test_marked_leak - 512 B on cuda:0, allocated at "
            "test_marked.py:8 in test_marked_leak, held by test_marked.KEEP[[]0] (module global)",
            "WARNED test_marked.py::test_warned_leak - 4.0 KiB on cuda:0, allocated at "
            "test_marked.py:15 in test_warned_leak, held by test_marked.KEEP[[]2] (module global)",
        ]
    )


KEPT: list[object] = []


def test_no_cuda_leak_names_the_line_and_restores_recording() -> None:
    torch = cuda.torch_module()
    torch.ones(1, device="cuda")
    assert not cuda.memory_history_enabled()
    with pytest.raises(CudaLeakError) as info, no_cuda_leak():
        KEPT.append(torch.ones(1, device="cuda"))  # the leaking line
    source = Path(__file__).read_text().splitlines()
    line = next(i for i, text in enumerate(source, 1) if "# the leaking line" in text)
    first = str(info.value).splitlines()[0]
    assert "left 512 B on cuda:0 allocated (tolerance 0 B)" in first
    # The suite's conftest froze the heap (KEPT among it): the walk down finds it.
    assert (
        f"test_leak_gpu.py:{line} in test_no_cuda_leak_names_the_line_and_restores_recording, "
        "held by " in first
    )
    assert first.endswith("test_leak_gpu.KEPT[0] (module global)"), first
    assert not cuda.memory_history_enabled(), "recording is put back off"
    KEPT.clear()

    with no_cuda_leak() as check:
        a = torch.randn(256, 256, device="cuda")
        (a @ a).sum().item()
        del a
    assert check.result is not None
    assert check.result.clean


def test_no_cuda_leak_leaves_the_users_recording_on() -> None:
    torch = cuda.torch_module()
    torch.cuda.memory._record_memory_history("all", max_entries=1000)
    try:
        with (
            pytest.raises(CudaLeakError, match=r"allocated at .*test_leak_gpu.py:\d+"),
            no_cuda_leak(),
        ):
            KEPT.append(torch.empty(2048, device="cuda"))
        assert cuda.memory_history_enabled()
    finally:
        torch.cuda.memory._record_memory_history(None)
        KEPT.clear()


LIBRARY_AND_CPP = """
import pytest
import torch
import torch.utils.dlpack

CAPSULES = []


@pytest.mark.parametrize("round", [1, 2])
def test_reduce_overhead(round):
    # CUDA graphs: torch.compile keeps static buffers in its graph pool, by design.
    f = torch.compile(lambda x: torch.sin(x) * 2 + 1, mode="reduce-overhead")
    x = torch.randn(1 << 20, device="cuda")
    for _ in range(3):
        y = f(x)
    assert torch.allclose(y, torch.sin(x) * 2 + 1)


def test_lstm_dropout():
    # cuDNN keeps its dropout state (an RNG state) in C++, by design.
    lstm = torch.nn.LSTM(64, 64, num_layers=2, dropout=0.5).cuda()
    out, _ = lstm(torch.randn(8, 4, 64, device="cuda"))
    assert out.shape == (8, 4, 64)


def test_held_in_cpp():
    # A DLPack capsule keeps the tensor on the C++ side: no Python object holds it.
    CAPSULES.append(torch.utils.dlpack.to_dlpack(torch.empty(1 << 20, device="cuda")))
"""


@pytest.mark.parametrize("trace", [True, False], ids=["trace", "rerun"])
def test_library_caches_are_kept_and_the_cpp_side_is_named(
    pytester: pytest.Pytester, trace: bool
) -> None:
    pytester.makepyfile(test_kept=LIBRARY_AND_CPP)
    args = ["--cuda-leak-check", "-v", "-p", "no:cacheprovider"]
    result = pytester.runpytest_subprocess(
        *args, *(["--cuda-leak-trace"] if trace else []), timeout=300
    )
    _record(f"kept_{'trace' if trace else 'rerun'}", result)
    outcomes = result.parseoutcomes()
    assert (outcomes.get("passed"), outcomes.get("leaked")) == (4, 1), outcomes
    leaked = re.findall(r"^LEAKED (\S+)", result.stdout.str(), re.M)
    assert leaked == ["test_kept.py::test_held_in_cpp"]
    result.stdout.fnmatch_lines(
        [
            "LEAKED test_kept.py::test_held_in_cpp - 4.0 MiB on cuda:0, allocated at "
            "test_kept.py:* in test_held_in_cpp, held by a Tensor that no Python object "
            "holds (C++ does, or a running function) (no Python root: C++ holds where the "
            "path starts)",
        ]
    )
    result.stdout.fnmatch_lines(
        ["*4.0 MiB (1 tensor) on cuda:0: a Tensor that no Python object holds (C++ does*"]
    )
