"""``cuda_distributed`` on two real GPUs with NCCL: a DDP training step, a planted rank
failure, a planted hang, a leak and a device-side assert on one rank.

Every test needs two GPUs (``cuda(min_devices=2)``): on a one-GPU machine they skip,
and fail under ``--cuda-require``, so leave this file out of one-GPU checks (as
``scripts/gpu-check.sh`` does). The inner run's report is appended to
``$OUT/pytest_cuda_distributed.txt`` when ``$OUT`` is set, for the closing note.
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda(min_devices=2)

PLANTED = """
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

KEPT = []


def _who_holds(obj, depth=4):
    import gc
    import types

    lines, layer = [], [obj]
    skip = {id(layer)}
    for level in range(depth):
        found = []
        for target in layer:
            for ref in gc.get_referrers(target):
                if id(ref) in skip or isinstance(ref, types.FrameType):
                    continue
                skip.add(id(ref))
                found.append(ref)
                lines.append(f"{'  ' * level}{type(ref).__module__}.{type(ref).__qualname__}")
        layer = found[:8]
    return lines


@pytest.mark.cuda_distributed(world_size=2, timeout=120)
def test_ddp_who_holds_the_weight(cuda_rank):
    import gc
    import weakref

    def step():
        model = torch.nn.Linear(64, 8).to(cuda_rank.device)
        ddp = DDP(model, device_ids=[cuda_rank.device.index])
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ddp(torch.randn(32, 64, device=cuda_rank.device)).square().mean().backward()
        opt.step()
        weights = [torch.empty_like(model.weight) for _ in range(cuda_rank.world_size)]
        dist.all_gather(weights, model.weight.detach())
        return weakref.ref(model.weight), weakref.ref(model.bias)

    weight, bias = step()
    torch.cuda.synchronize()
    gc.collect()
    print("weight alive:", weight() is not None, "bias alive:", bias() is not None)
    if weight() is not None:
        print(chr(10).join(_who_holds(weight())))


@pytest.mark.cuda_distributed(world_size=2, timeout=120)
def test_ddp_step(cuda_rank):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8).to(cuda_rank.device)
    ddp = DDP(model, device_ids=[cuda_rank.device.index])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(1 + cuda_rank.rank)  # each rank its own batch
    x = torch.randn(32, 64, device=cuda_rank.device)
    ddp(x).square().mean().backward()
    opt.step()
    # Gradients were averaged: every rank holds the same weights after the step.
    weights = [torch.empty_like(model.weight) for _ in range(cuda_rank.world_size)]
    dist.all_gather(weights, model.weight.detach())
    assert torch.equal(weights[0], weights[1])
    assert torch.cuda.current_device() == cuda_rank.device.index
    print(f"rank {cuda_rank.rank} on {torch.cuda.get_device_name(cuda_rank.device)}")


@pytest.mark.cuda_distributed(world_size=2, timeout=120)
def test_rank1_fails(cuda_rank):
    t = torch.ones(1, device=cuda_rank.device)
    if cuda_rank.rank == 1:
        raise RuntimeError("planted failure on rank 1")
    dist.all_reduce(t)
    t.item()


@pytest.mark.cuda_distributed(world_size=2, timeout=10)
def test_hang(cuda_rank):
    t = torch.ones(1, device=cuda_rank.device)
    if cuda_rank.rank == 0:
        return  # skips the collective
    dist.all_reduce(t)
    t.item()


@pytest.mark.cuda_distributed(world_size=2, timeout=120)
def test_leak_on_rank1(cuda_rank):
    t = torch.ones(1, device=cuda_rank.device)
    dist.all_reduce(t)
    if cuda_rank.rank == 1:
        KEPT.append(torch.empty(8 << 20, dtype=torch.uint8, device=cuda_rank.device))


@pytest.mark.cuda_distributed(world_size=2, timeout=120)
def test_device_assert_on_rank1(cuda_rank):
    t = torch.zeros(4, device=cuda_rank.device)
    dist.all_reduce(t)
    if cuda_rank.rank == 1:
        t[torch.tensor([10], device=cuda_rank.device)] = 1.0  # out of bounds, asynchronous
"""


def _keep(title: str, result: pytest.RunResult) -> None:
    out = os.environ.get("OUT")
    if not out:
        return
    with (Path(out) / "pytest_cuda_distributed.txt").open("a") as log:
        log.write(f"## {title}\n" + "\n".join(result.outlines) + "\n\n")


def test_nccl_ranks_on_two_gpus(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_planted=PLANTED)
    ddp = pytester.runpytest_subprocess(
        "--cuda-devices=0,1", "-rA", "-p", "no:cacheprovider", "-k", "ddp"
    )
    _keep("pytest --cuda-devices=0,1 -k ddp (NCCL, 2 GPUs)", ddp)
    ddp.assert_outcomes(passed=2)
    ddp.stdout.fnmatch_lines(
        [
            "*Captured stdout (rank 0) call*",
            "rank 0 on NVIDIA *",
            "*Captured stdout (rank 1) call*",
            "rank 1 on NVIDIA *",
        ]
    )
    # The parameters themselves are freed when the step's function returns.
    ddp.stdout.fnmatch_lines(["weight alive: False bias alive: False"])
    result = pytester.runpytest_subprocess(
        "--cuda-devices=0,1",
        "--cuda-leak-check",
        "--cuda-leak-trace",
        "-rA",
        "-p",
        "no:cacheprovider",
        "-k",
        "not ddp",
    )
    _keep("pytest --cuda-devices=0,1 --cuda-leak-check --cuda-leak-trace (NCCL, 2 GPUs)", result)
    result.assert_outcomes(failed=3, passed=1)
    assert result.parseoutcomes()["leaked"] == 1
    result.stdout.fnmatch_lines(
        [
            "test_rank1_fails: rank 1 of 2 failed: RuntimeError: planted failure on rank 1 "
            "at test_planted.py:*",
            "rank 0 (cuda:0): still running after *, 5 s after rank 1 failed: stopped.",
            "  Its Python stack when stopped (most recent call first):",
            "*test_planted.py*in test_rank1_fails",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "test_hang: timed out after 10 s (cuda_distributed timeout): rank 1 never finished",
            "rank 0 (cuda:0): passed after *, then waited for the other ranks until *",
            "*in wait_for_ranks",
            "rank 1 (cuda:1): still running after *: stopped.",
            "*test_planted.py*in test_hang",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "LEAKED test_planted.py::test_leak_on_rank1 on rank 1 - 8.0 MiB on cuda:1, "
            "allocated at test_planted.py:* in test_leak_on_rank1, held by "
            "test_planted.KEPT[[]0] (module global)",  # [[]: fnmatch's literal "["
        ]
    )
    result.stdout.fnmatch_lines(
        ["test_device_assert_on_rank1: rank 1 of 2 failed: a CUDA error surfaced after the test*"]
    )


RANK_LEAK = """
import pytest
import torch
import torch.distributed as dist

KEPT = []


@pytest.mark.cuda_distributed(world_size=2, timeout=120)
def test_leaks_on_rank1(cuda_rank):
    dist.all_reduce(torch.ones(1, device=cuda_rank.device))
    if cuda_rank.rank == 1:
        KEPT.append(torch.empty(1 << 20, dtype=torch.uint8, device=cuda_rank.device))


@pytest.mark.cuda_distributed(world_size=2, timeout=120)
def test_after_it(cuda_rank):
    assert not KEPT  # new ranks: the leaking ones were replaced
    dist.all_reduce(torch.ones(1, device=cuda_rank.device))
"""


def test_a_ranks_leak_under_the_default_options_is_leaked_with_its_rank(
    pytester: pytest.Pytester,
) -> None:
    """The default check (no --cuda-leak-trace): a 1 MiB leak on rank 1 is the test's
    LEAKED, naming the rank, its holder and its line, in the summary, the JSON report
    and the JUnit XML (issue 38)."""
    pytester.makepyfile(test_rank_leak=RANK_LEAK)
    result = pytester.runpytest_subprocess(
        "--cuda-leak-check",
        "--cuda-leak-report=leaks.json",
        "--junitxml=junit.xml",
        "-p",
        "no:cacheprovider",
    )
    _keep("pytest --cuda-leak-check --cuda-leak-report --junitxml (NCCL, 2 GPUs)", result)
    assert result.parseoutcomes() == {"passed": 2, "leaked": 1}
    line = "test_rank_leak.py:12 in test_leaks_on_rank1"
    holder = "test_rank_leak.KEPT[0] (module global)"
    result.stdout.fnmatch_lines(
        [
            f"LEAKED test_rank_leak.py::test_leaks_on_rank1 on rank 1 - 1.0 MiB on cuda:1, "
            f"allocated at {line}, held by {holder}",
            "cuda leak check: 2 tests checked, 1 leaked (1.0 MiB on cuda:1 leaked); report "
            "written to leaks.json",
        ]
    )
    rows = json.loads((pytester.path / "leaks.json").read_text())["tests"]
    leaked = [row for row in rows if row["verdict"] == "leaked"]
    assert [(r["nodeid"], r["rank"], r["leaked"], r["line"], r["holder"]) for r in leaked] == [
        ("test_rank_leak.py::test_leaks_on_rank1", 1, {"cuda:1": 1 << 20}, line, holder)
    ]
    assert {(r["nodeid"].split("::")[1], r["rank"]) for r in rows} == {
        (name, rank) for name in ("test_leaks_on_rank1", "test_after_it") for rank in (None, 0, 1)
    }
    cases = ET.parse(pytester.path / "junit.xml").getroot().iter("testcase")
    leaking = next(case for case in cases if case.get("name") == "test_leaks_on_rank1")
    properties = {p.get("name"): p.get("value") for p in leaking.iter("property")}
    assert properties["cuda_leak_verdict"] == "leaked"
    assert properties["cuda_leak_rank1_verdict"] == "leaked"
    assert properties["cuda_leak_rank1_bytes"] == f"cuda:1={1 << 20}"
    assert properties["cuda_leak_rank1_line"] == line
    assert properties["cuda_leak_rank1_holder"] == holder
    assert properties["cuda_leak_rank0_verdict"] in ("clean", "kept")


DDP_UNDER_XDIST = """
import pytest
import torch
import torch.distributed as dist

@pytest.mark.cuda_distributed(world_size=2, timeout=120)
def test_pair(cuda_rank):
    t = torch.ones(1, device=cuda_rank.device)
    dist.all_reduce(t)
    assert t.item() == 2.0
"""


def test_ranks_under_xdist_with_two_devices_per_worker(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_pair=DDP_UNDER_XDIST)
    result = pytester.runpytest_subprocess(
        "-n", "1", "--cuda-devices=0,1", "--cuda-devices-per-worker=2", "-p", "no:cacheprovider"
    )
    _keep("pytest -n 1 --cuda-devices=0,1 --cuda-devices-per-worker=2", result)
    result.assert_outcomes(passed=1)


WARM = """
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

KEPT = []


def keep_pid(cuda_rank, name):
    print(f"pid {name} rank {cuda_rank.rank} {os.getpid()}")


@pytest.mark.cuda_distributed(world_size=2, timeout=60)
def test_01_barrier_all_reduce(cuda_rank):
    keep_pid(cuda_rank, "01")
    dist.barrier()
    t = torch.full((1024,), float(cuda_rank.rank + 1), device=cuda_rank.device)
    dist.all_reduce(t)
    assert torch.all(t == 3.0)


@pytest.mark.cuda_distributed(world_size=2, timeout=60)
def test_02_ddp_step(cuda_rank):
    keep_pid(cuda_rank, "02")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8).to(cuda_rank.device)
    ddp = DDP(model, device_ids=[cuda_rank.device.index])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ddp(torch.randn(32, 64, device=cuda_rank.device)).square().mean().backward()
    opt.step()
    weights = [torch.empty_like(model.weight) for _ in range(cuda_rank.world_size)]
    dist.all_gather(weights, model.weight.detach())
    assert torch.equal(weights[0], weights[1])


@pytest.mark.cuda_distributed(world_size=2, timeout=60)
def test_03_keeps_memory_on_rank1(cuda_rank):
    keep_pid(cuda_rank, "03")
    t = torch.ones(1, device=cuda_rank.device)
    dist.all_reduce(t)
    if cuda_rank.rank == 1:
        KEPT.append(torch.empty(8 << 20, dtype=torch.uint8, device=cuda_rank.device))


@pytest.mark.cuda_distributed(world_size=2, timeout=60)
def test_04_after_the_leak(cuda_rank):
    keep_pid(cuda_rank, "04")
    assert not KEPT  # new ranks: the module was imported again
    dist.barrier()


@pytest.mark.cuda_distributed(world_size=2, timeout=60)
def test_05_fails_on_rank1(cuda_rank):
    keep_pid(cuda_rank, "05")
    t = torch.ones(1, device=cuda_rank.device)
    if cuda_rank.rank == 1:
        raise RuntimeError("planted failure on rank 1")
    dist.all_reduce(t)
    t.item()


@pytest.mark.cuda_distributed(world_size=2, timeout=60)
def test_06_after_the_failure(cuda_rank):
    keep_pid(cuda_rank, "06")
    dist.all_reduce(torch.ones(1, device=cuda_rank.device))


@pytest.mark.cuda_distributed(world_size=2, timeout=60)
def test_07_flips_tf32_on_rank0(cuda_rank):
    keep_pid(cuda_rank, "07")
    if cuda_rank.rank == 0:
        torch.backends.cuda.matmul.allow_tf32 = True


@pytest.mark.cuda_distributed(world_size=2, timeout=10)
def test_08_hangs(cuda_rank):
    keep_pid(cuda_rank, "08")
    t = torch.ones(1, device=cuda_rank.device)
    if cuda_rank.rank == 0:
        return  # skips the collective
    dist.all_reduce(t)
    t.item()


@pytest.mark.cuda_distributed(world_size=2, timeout=60, fresh_group=True)
def test_09_after_the_hang_fresh_group(cuda_rank):
    keep_pid(cuda_rank, "09")
    dist.all_reduce(torch.ones(1, device=cuda_rank.device))


@pytest.mark.cuda_distributed(world_size=2, timeout=60)
def test_10_last(cuda_rank):
    keep_pid(cuda_rank, "10")
    dist.barrier()
    dist.all_reduce(torch.ones(1, device=cuda_rank.device))
"""


def _pids(result: pytest.RunResult) -> dict[str, set[int]]:
    found: dict[str, set[int]] = {}
    for line in result.outlines:
        words = line.split()
        if len(words) == 5 and words[0] == "pid" and words[2] == "rank":
            found.setdefault(words[1], set()).add(int(words[4]))
    return found


def test_warm_nccl_ranks_contain_failures_and_report_leftovers(pytester: pytest.Pytester) -> None:
    """Ten tests on one pair of warm NCCL ranks: the collectives pass under the leak
    check (the library's own buffers are the group's warm-up's, not a test's), a
    planted leak, failure, flag and hang fail on their rank, and the ranks are replaced
    after each of them only."""
    pytester.makepyfile(test_warm=WARM)
    result = pytester.runpytest_subprocess(
        "--cuda-devices=0,1",
        "--cuda-leak-check",
        "--cuda-leak-trace",
        "-rA",
        "-p",
        "no:cacheprovider",
    )
    _keep("pytest --cuda-devices=0,1 --cuda-leak-check --cuda-leak-trace (warm NCCL)", result)
    outcomes = {
        line.split("::")[1].split()[0]: line.split()[0]
        for line in result.outlines
        if line.startswith(("PASSED", "FAILED"))
    }
    assert outcomes == {
        "test_01_barrier_all_reduce": "PASSED",
        "test_02_ddp_step": "PASSED",
        "test_03_keeps_memory_on_rank1": "PASSED",  # and LEAKED at its teardown
        "test_04_after_the_leak": "PASSED",
        "test_05_fails_on_rank1": "FAILED",
        "test_06_after_the_failure": "PASSED",
        "test_07_flips_tf32_on_rank0": "FAILED",
        "test_08_hangs": "FAILED",
        "test_09_after_the_hang_fresh_group": "PASSED",
        "test_10_last": "PASSED",
    }
    result.stdout.fnmatch_lines(
        [
            "LEAKED test_warm.py::test_03_keeps_memory_on_rank1 on rank 1 - 8.0 MiB on "
            "cuda:1, allocated at test_warm.py:* in test_03_keeps_memory_on_rank1, held by "
            "test_warm.KEPT[[]0] (module global)",  # [[]: fnmatch's literal "["
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "test_05_fails_on_rank1: rank 1 of 2 failed: RuntimeError: planted failure on "
            "rank 1 at test_warm.py:*",
            "rank 0 (cuda:0): still running after *, 5 s after rank 1 failed: stopped.",
            "*test_warm.py*in test_05_fails_on_rank1",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "test_07_flips_tf32_on_rank0: rank 0 of 2 failed: left state behind for the "
            "next test: torch.backends.cuda.matmul.allow_tf32 = True (it was False)*",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "test_08_hangs: timed out after 10 s (cuda_distributed timeout): rank 1 never finished",
            "rank 0 (cuda:0): passed after *, then waited for the other ranks until *",
            "*in wait_for_ranks",
            "rank 1 (cuda:1): still running after *: stopped.",
            "*test_warm.py*in test_08_hangs",
        ]
    )
    assert "Guessing device ID" not in result.stdout.str()
    # Warm: tests 01-03 on one pair, then a new pair after each test that went wrong.
    pids = {name: frozenset(found) for name, found in _pids(result).items()}
    assert all(len(found) == 2 for found in pids.values()), pids
    runs = [("01", "02", "03"), ("04", "05"), ("06", "07"), ("08",), ("09", "10")]
    pairs = [{pids[name] for name in run} for run in runs]
    assert [len(pair) for pair in pairs] == [1] * len(runs), pids
    assert len({next(iter(pair)) for pair in pairs}) == len(runs), pids


GIVE_BACK = """
import pytest
import torch

from gpumagic import cuda

# NVML's free memory (every process's use counted), read when pytest imports this module,
# before any rank starts (each rank imports it again, and does not use its reading).
FREE_BEFORE = [cuda.nvml_memory_info(device).free for device in cuda.devices()[:2]]
#: What the warm ranks' CUDA contexts, NCCL's buffers and this process's context may hold
#: after the first test: far less than the memory it freed.
CONTEXTS = 4 << 30


@pytest.mark.cuda_distributed(world_size=2, timeout=120)
def test_1_fills_and_frees_the_gpu(cuda_rank):
    free, _ = torch.cuda.mem_get_info(cuda_rank.device)
    block = torch.empty(int(free * 0.85), dtype=torch.uint8, device=cuda_rank.device)
    block.fill_(1)
    del block
    # Freed, and kept by torch's allocator for this rank's next test.
    cached = torch.cuda.memory_reserved(cuda_rank.device)
    print(f"rank {cuda_rank.rank} on {cuda_rank.device}: {cached / 2**30:.1f} GiB cached")
    assert cached >= int(free * 0.85)


@pytest.mark.cuda(min_memory=int(FREE_BEFORE[0] * 0.7))
def test_2_needs_most_of_it():
    free = [cuda.nvml_memory_info(device).free for device in cuda.devices()[:2]]
    print(f"free before: {FREE_BEFORE}, after the ranks' test: {free}")
    assert all(now >= before - CONTEXTS for before, now in zip(FREE_BEFORE, free))
    block = torch.empty(int(FREE_BEFORE[0] * 0.7), dtype=torch.uint8, device="cuda:0")
    block.fill_(1)
"""


@pytest.mark.gpu_timing  # alone: it fills the GPUs' memory, and reads it with NVML
def test_warm_ranks_give_memory_back_for_the_next_test(pytester: pytest.Pytester) -> None:
    """A warm-rank test that fills most of each GPU and frees it, then an ordinary test
    that needs most of cuda:0 (``cuda(min_memory=...)``), with the default options: the
    second runs, whatever ran before it, because the warm ranks gave their cached blocks
    back when the first ended (issue 38)."""
    pytester.makepyfile(test_give_back=GIVE_BACK)
    result = pytester.runpytest_subprocess("-rA", "-p", "no:cacheprovider")
    _keep("pytest (warm NCCL ranks fill the GPUs, then cuda(min_memory=...))", result)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "rank 0 on cuda:0: * GiB cached",
            "rank 1 on cuda:1: * GiB cached",
            "PASSED test_give_back.py::test_1_fills_and_frees_the_gpu",
            "PASSED test_give_back.py::test_2_needs_most_of_it",
        ]
    )


def test_nccl_ranks_listen_on_loopback_only(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While warm NCCL ranks are up on two GPUs, neither the pytest process (the
    rendezvous store) nor a rank (NCCL's bootstrap and proxy) listens beyond loopback,
    as the operating system lists them; fresh ranks (``isolate=True``) the same
    (issue 43; the gloo run is ``test_distributed_store.py``'s)."""
    from test_distributed_store import loopback_suite, plant_listening

    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    plant_listening(pytester)
    pytester.makepyfile(test_planted=loopback_suite(None))
    result = pytester.runpytest_subprocess("--cuda-devices=0,1", "-rA", "-p", "no:cacheprovider")
    _keep("pytest --cuda-devices=0,1 (NCCL ranks: what listens, from /proc/net/tcp)", result)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(
        [
            "*Captured stdout (rank 0) call*",
            "GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME==lo",
            "*Captured stdout call*",
            "pid * listens on 127.0.0.1:*",
        ]
    )
