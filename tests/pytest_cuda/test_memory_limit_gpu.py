"""Memory limits, out-of-memory reports and snapshots on a real GPU (issue 42's "Done
when"): planted suites in fresh pytest processes, alone, under ``-n 2`` on one GPU and
in a ``cuda_distributed`` rank. Each inner run's output goes to
``$OUT/memory_limit_<run>.txt`` when ``$OUT`` is set, for the record. ``%%gpumem
--snapshot`` on a GPU: ``tests/gpumagic/test_memory_gpu.py``.
"""

from __future__ import annotations

import importlib
import os
import pickle
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda

LIMITED = """
import pytest
import torch

GiB = 1 << 30


@pytest.mark.cuda_limit_memory("512MiB")
def test_one_gib_under_512_mib():
    x = torch.empty(GiB, dtype=torch.uint8, device="cuda")  # line: 1 GiB
    assert x.numel() == GiB


@pytest.mark.cuda_limit_memory("2GiB")
def test_one_gib_under_2_gib():
    x = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    assert x.numel() == GiB


@pytest.mark.cuda_limit_memory("1GiB")
def test_temporary_inside_a_steady_state():
    steady = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # line: steady
    temporary = torch.empty(GiB, dtype=torch.uint8, device="cuda")  # line: temporary
    del temporary
    assert steady.numel() == 256 << 20
"""


def _line(source: str, tag: str) -> int:
    # pytester writes the source stripped: line 1 is its first line.
    lines = source.strip().splitlines()
    return next(i for i, text in enumerate(lines, 1) if f"# line: {tag}" in text)


def _record(name: str, result: pytest.RunResult) -> None:
    out = os.environ.get("OUT")
    if out:
        Path(out, f"memory_limit_{name}.txt").write_text(
            "\n".join(result.outlines) + "\n--- stderr ---\n" + "\n".join(result.errlines[-30:])
        )


def _check_limited(result: pytest.RunResult) -> None:
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines_random(
        [
            "CUDA memory limit: test_one_gib_under_512_mib peaked at 1.0 GiB on cuda:0, over "
            "its limit of 512.0 MiB (cuda_limit_memory marker), allocated at "
            f"test_limited.py:{_line(LIMITED, '1 GiB')} in test_one_gib_under_512_mib",
            "CUDA memory limit: test_temporary_inside_a_steady_state peaked at 1.2 GiB on "
            "cuda:0, over its limit of 1.0 GiB (cuda_limit_memory marker), allocated at "
            f"test_limited.py:{_line(LIMITED, 'temporary')} in "
            "test_temporary_inside_a_steady_state",
        ]
    )
    # The temporary is freed before the test ends, yet it is what the peak shows.
    result.stdout.fnmatch_lines(
        [
            "Blocks alive at the peak, by allocating stack (largest first):",
            "  1.0 GiB in 1 block on cuda:0",
            f"    test_limited.py:{_line(LIMITED, 'temporary')} in "
            "test_temporary_inside_a_steady_state",
            "  256.0 MiB in 1 block on cuda:0",
            f"    test_limited.py:{_line(LIMITED, 'steady')} in "
            "test_temporary_inside_a_steady_state",
        ]
    )
    result.stdout.no_fnmatch_line("*test_one_gib_under_2_gib peaked*")


def test_limits_alone(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_limited=LIMITED)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:randomly", timeout=240
    )
    _record("alone", result)
    _check_limited(result)


def test_limits_under_xdist_on_one_gpu(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    pytester.makepyfile(test_limited=LIMITED)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", timeout=240)
    _record("xdist", result)
    _check_limited(result)


def test_the_option_limits_every_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_option="""
        import torch

        def test_big():
            x = torch.empty(768 << 20, dtype=torch.uint8, device="cuda")
            assert x.numel() > 0

        def test_small():
            x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
            assert x.numel() > 0
        """
    )
    result = pytester.runpytest_subprocess(
        "--cuda-limit-memory=512MiB", "-p", "no:cacheprovider", timeout=240
    )
    _record("option", result)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "CUDA memory limit: test_big peaked at 768.0 MiB on cuda:0, over its limit of "
            "512.0 MiB (--cuda-limit-memory), allocated at test_option.py:4 in test_big",
        ]
    )


RANKS = """
import pytest
import torch


@pytest.mark.cuda_distributed(world_size=1, backend="nccl", timeout=120)
@pytest.mark.cuda_limit_memory("256MiB")
def test_rank_over(cuda_rank):
    x = torch.empty(512 << 20, dtype=torch.uint8, device=cuda_rank.device)  # line: rank
    assert x.numel() > 0
"""


def test_a_rank_is_held_to_the_limit_on_its_device(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_ranks=RANKS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    _record("ranks", result)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*rank 0 (cuda:0): failed after *: CUDA memory limit: test_rank_over on rank 0 "
            "peaked at 5* MiB on cuda:0, over its limit of 256.0 MiB (cuda_limit_memory "
            f"marker), allocated at test_ranks.py:{_line(RANKS, 'rank')} in test_rank_over*",
        ]
    )


OOM = """
import pytest
import torch


@pytest.fixture
def allocated_at_setup():
    return torch.cuda.memory_allocated()


def test_oom():
    held = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # line: held
    free, total = torch.cuda.mem_get_info()
    torch.empty(2 * total, dtype=torch.uint8, device="cuda")  # line: oom


def test_next_starts_with_the_memory_back(allocated_at_setup):
    assert allocated_at_setup == 0
"""


def test_an_oom_names_the_largest_blocks_and_their_holders(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_oom=OOM)
    # The leak check records the allocating lines; the holders need no recording (and
    # --cuda-leak-trace lifts the holder search's time limit).
    result = pytester.runpytest_subprocess(
        "--cuda-leak-check",
        "--cuda-leak-trace",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        timeout=240,
    )
    _record("oom", result)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*- CUDA out of memory -*",
            "test_oom ran out of CUDA memory: CUDA out of memory. Tried to allocate *",
            "cuda:0: 1.0 GiB allocated by tensors, * reserved by torch's caching allocator, *",
            "Largest blocks alive, by allocating stack (largest first):",
            "  1.0 GiB in 1 block on cuda:0",
            f"    test_oom.py:{_line(OOM, 'held')} in test_oom",
            "Who holds them (largest first):",
            f"  1.0 GiB (1 tensor) on cuda:0: held (local variable of test_oom at "
            f"test_oom.py:{_line(OOM, 'oom')})",
        ]
    )


def test_cuda_oom_skip_skips_it(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_oom=OOM)
    result = pytester.runpytest_subprocess(
        "--cuda-oom=skip", "-rs", "-p", "no:cacheprovider", "-p", "no:randomly", timeout=240
    )
    _record("oom_skip", result)
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(
        ["SKIPPED [[]1] test_oom.py:*: test_oom ran out of CUDA memory: CUDA out of memory. *"]
    )


SNAPSHOT = """
import pytest
import torch

KEEP = []


@pytest.mark.cuda_limit_memory("256MiB")
def test_over_and_kept():
    KEEP.append(torch.empty(512 << 20, dtype=torch.uint8, device="cuda"))


@pytest.mark.cuda_leak_check
def test_leaks():
    KEEP.append(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
"""


def test_the_snapshots_open_with_torchs_memory_viz(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_snap=SNAPSHOT)
    # --cuda-leak-trace: the holder search without its time limit.
    result = pytester.runpytest_subprocess(
        "--cuda-memory-snapshot=snaps",
        "--cuda-leak-trace",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        timeout=240,
    )
    _record("snapshot", result)
    outcomes = result.parseoutcomes()
    assert (outcomes.get("failed"), outcomes.get("leaked")) == (1, 1), outcomes
    _memory_viz = importlib.import_module("torch.cuda._memory_viz")  # torch's own reader
    folder = pytester.path / "snaps"
    for name, holder in [
        ("test_snap.py_test_over_and_kept", "test_snap.KEEP[0] (module global)"),
        ("test_snap.py_test_leaks", "test_snap.KEEP[1] (module global)"),
    ]:
        with (folder / f"{name}.pickle").open("rb") as file:
            snapshot = pickle.load(file)
        flamegraph = _memory_viz.memory(snapshot, format_flamegraph=lambda text: text)
        assert f"held by:0:{holder}" in flamegraph, flamegraph[:2000]
        by_segment = _memory_viz.segments(snapshot, format_flamegraph=lambda text: text)
        assert f"held by:0:{holder}" in by_segment
        assert "Active Memory Timeline" in _memory_viz.trace_plot(snapshot)
        assert (folder / f"{name}.json").exists()
