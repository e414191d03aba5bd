"""A launched run on two real GPUs: two torchrun "nodes" on one machine, one GPU each,
NCCL through its network transport (``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1``).

The same checks as ``test_distributed_launched.py``'s gloo run: 10 NCCL tests and 3
ordinary ones give 13 outcomes reported once by rank 0; a failure and a hang on node 1
are reported with node 1's host, rank and stack, and the test after them passes; both
torchrun processes exit as the run did; no process of the run is left. Each test's
time from rank 0's JUnit XML is appended to ``$OUT/launched_ranks_nccl.jsonl`` when
``$OUT`` is set (the time per test once warm, for ``benchmarks/results/``). Needs two
GPUs: skipped (failed under ``--cuda-require``) elsewhere.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import uuid
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path

import pytest
from test_distributed_launched import TORCHRUN, _finish, _left_running, _start_pair

pytestmark = pytest.mark.cuda(min_devices=2)

SUITE = """
import time

import pytest
import torch
import torch.distributed as dist


@pytest.mark.parametrize("i", range(10))
@pytest.mark.cuda_distributed(world_size=2, timeout=60)
def test_all_reduce(cuda_rank, i):
    t = torch.full((1024,), float(cuda_rank.rank + 1), device=cuda_rank.device)
    dist.all_reduce(t)
    assert torch.all(t == 3.0)


def test_plain_a():
    pass


def test_plain_b():
    pass


def test_plain_c():
    pass


@pytest.mark.cuda_distributed(world_size=2, timeout=60)
def test_x_fails_on_node_1(cuda_rank):
    assert cuda_rank.rank == 0, "planted on rank 1"


@pytest.mark.cuda_distributed(world_size=2, timeout=5)
def test_y_hangs_on_node_1(cuda_rank):
    t = torch.ones(1, device=cuda_rank.device)
    if cuda_rank.rank == 1:
        time.sleep(3600)  # planted hang
    dist.all_reduce(t)
    t.item()


@pytest.mark.cuda_distributed(world_size=2, timeout=60)
def test_z_after_the_hang(cuda_rank):
    t = torch.ones(1, device=cuda_rank.device)
    dist.all_reduce(t)
    assert t.item() == 2.0
"""


def test_two_nccl_nodes_one_gpu_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    monkeypatch.setenv("NCCL_SHM_DISABLE", "1")
    mark = uuid.uuid4().hex
    procs = _start_pair(
        tmp_path,
        "--junitxml=report.xml",
        "--cuda-rank-logs=logs",
        mark=mark,
        visible=("0", "1"),
    )
    node0, node1 = _finish(procs)
    assert _left_running(mark) == []
    out = node0.output
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "pytest_cuda_launched_nccl.txt").write_text(out)
    host = socket.gethostname()
    assert "2 failed, 14 passed" in out, out
    assert "passed" not in node1.output, node1.output
    assert (
        f"test_x_fails_on_node_1: rank 1 of 2 on {host} (node 1) failed: "
        "AssertionError: planted on rank 1" in out
    ), out
    assert "test_y_hangs_on_node_1: timed out after 5 s (cuda_distributed timeout)" in out
    assert f"rank 1 on {host} (node 1, cuda:0): still running after" in out, out
    assert "in test_y_hangs_on_node_1" in out, out
    assert node0.returncode == 1
    assert node1.returncode != 0
    _record(tmp_path / "report.xml")


def _record(report: Path) -> None:
    """Each all-reduce test's time (set-up, call and teardown) from rank 0's JUnit XML."""
    out = os.environ.get("OUT")
    if not out:
        return
    times = {
        case.get("name", ""): float(case.get("time", "0"))
        for case in ET.parse(report).getroot().iter("testcase")
    }
    reduce = [t for name, t in sorted(times.items()) if name.startswith("test_all_reduce")]
    warm = sorted(reduce[1:])
    line = {
        "bench": "launched_ranks_nccl",
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "launcher": f"{TORCHRUN.name} --nnodes=2 --nproc-per-node=1 (one machine)",
        "nccl": "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1",
        "tests": len(reduce),
        "unit": "s",
        "first_test": reduce[0] if reduce else None,
        "per_test_median": statistics.median(warm) if warm else None,
        "per_test_max": warm[-1] if warm else None,
    }
    with (Path(out) / "launched_ranks_nccl.jsonl").open("a") as log:
        log.write(json.dumps(line) + "\n")
