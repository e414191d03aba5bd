"""A launched run, ``pytest --cuda-ranks=env``: two torchrun "nodes" on this machine.

Each node is its own ``torchrun --nnodes=2 --nproc-per-node=1 --node-rank=N`` with the
rendezvous on 127.0.0.1 (torchrun's static rendezvous: node 0's agent serves the store),
as two hosts would run it; the ranks talk through gloo. The runs are real: the pairs of
torchrun processes start together and each pair is checked for what its report says,
what node 1 printed (nothing), how both exited, and that no process of the run is left.
The launcher's environment itself (torchrun, srun, mpirun) is read by plain calls.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import NamedTuple

import pytest

from pytest_cuda.distributed.world import LaunchError, launched_world

TORCHRUN = Path(sys.executable).with_name("torchrun")

GOOD = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.parametrize("i", range(10))
@pytest.mark.cuda_distributed(world_size=2, backend="gloo", timeout=60)
def test_pair(cuda_rank, i):
    t = torch.tensor([cuda_rank.rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == 3.0


def test_plain_a():
    pass


def test_plain_b():
    pass


def test_plain_c():
    pass
"""

BAD = """
import os
import time

import pytest
import torch
import torch.distributed as dist


def reduce(rank):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.cuda_distributed(world_size=2, backend="gloo", timeout=2)
def test_1_hangs_on_node_1(cuda_rank):
    if cuda_rank.rank == 1:
        time.sleep(3600)  # planted hang
    reduce(cuda_rank.rank)


@pytest.mark.cuda_distributed(world_size=2, backend="gloo", timeout=60)
def test_2_fails_on_node_1(cuda_rank):
    assert cuda_rank.rank == 0, "planted on rank 1"


@pytest.fixture
def dataset():
    if os.environ["GROUP_RANK"] == "1":
        raise RuntimeError("no dataset on node 1")


@pytest.mark.cuda_distributed(world_size=2, backend="gloo", timeout=60)
def test_2b_set_up_fails_on_node_1(cuda_rank, dataset):
    pass


@pytest.mark.cuda_distributed(world_size=2, backend="gloo", timeout=60)
def test_3_after_the_hang(cuda_rank):
    assert reduce(cuda_rank.rank) == 3.0


@pytest.mark.cuda_distributed(world_size=3, backend="gloo")
def test_4_more_ranks_than_launched(cuda_rank):
    pass


def test_5_plain():
    pass
"""

# Counts this pytest process's rank processes when a test's call starts: the ranks'
# start-up belongs to the first test's set-up (issue 40).
STARTUP_CONFTEST = """
from pathlib import Path

import pytest


def _rank_processes():
    pids = []
    for task in Path("/proc/self/task").iterdir():
        pids += (task / "children").read_text().split()
    return [pid for pid in pids if b"rank_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    print(f"RANKS WHEN {item.name} IS CALLED: {len(_rank_processes())}")
"""

OTHER = """
import os


def test_everywhere():
    pass


if os.environ["SLURM_PROCID"] == "1":

    def test_only_on_rank_1():
        pass
"""


class Node(NamedTuple):
    returncode: int
    output: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_pair(
    folder: Path, *args: str, mark: str, visible: tuple[str, str] | None = None
) -> list[subprocess.Popen[str]]:
    """Two torchrun "nodes" running ``pytest --cuda-ranks=env ARGS`` in ``folder``;
    ``visible``: each node's ``CUDA_VISIBLE_DEVICES``."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["I40_RUN_MARK"] = mark  # every process of the run inherits it
    command = [
        str(TORCHRUN),
        "--nnodes=2",
        "--nproc-per-node=1",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
    ]
    pytest_args = ["-m", "pytest", "-p", "no:cacheprovider", "--cuda-ranks=env", *args]
    return [
        subprocess.Popen(
            [*command, f"--node-rank={node}", *pytest_args],
            cwd=folder,
            env=env if visible is None else {**env, "CUDA_VISIBLE_DEVICES": visible[node]},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]


def _start_as_srun(folder: Path, *args: str, mark: str) -> list[subprocess.Popen[str]]:
    """Two pytest processes with the variables ``srun`` gives its tasks (no agent: rank
    0's pytest process serves the store at ``MASTER_ADDR:MASTER_PORT``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env |= {
        "I40_RUN_MARK": mark,
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_LOCALID": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--cuda-ranks=env"]
    return [
        subprocess.Popen(
            [*command, *args],
            cwd=folder,
            env={**env, "SLURM_PROCID": str(rank), "SLURM_NODEID": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]


def _finish(procs: list[subprocess.Popen[str]]) -> list[Node]:
    nodes = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=240)  # a guard against a hang, not a timing
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        nodes.append(Node(proc.returncode, out))
    return nodes


def _left_running(mark: str) -> list[str]:
    """The processes still running whose environment holds ``mark``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f"I40_RUN_MARK={mark}".encode() in environ.split(b"\0"):
            found.append(f"{entry.name}: {cmdline}")
    return found


@pytest.fixture
def runs(tmp_path: Path) -> dict[str, list[Node]]:
    """Three launched runs, started together: all passing and a hang and a failure on
    node 1 (two torchrun "nodes" each), and node 1 collecting another test (two
    pytest processes with ``srun``'s variables: rank 0 serves the store)."""
    if not TORCHRUN.exists():
        pytest.skip(f"torchrun is not installed next to {sys.executable}")
    if not Path("/proc/self/task").exists():
        pytest.skip("the processes of a run are found through /proc")
    started = {}
    marks = {}
    for name, text in {"good": GOOD, "bad": BAD, "other": OTHER}.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / f"test_{name}.py").write_text(text)
        marks[name] = uuid.uuid4().hex
        if name == "good":
            started[name] = _start_pair(folder, "--cuda-rank-logs=logs", mark=marks[name])
        elif name == "bad":
            (folder / "conftest.py").write_text(STARTUP_CONFTEST)
            started[name] = _start_pair(folder, "-s", mark=marks[name])
        else:
            started[name] = _start_as_srun(folder, mark=marks[name])
    found = {name: _finish(procs) for name, procs in started.items()}
    for name, mark in marks.items():
        assert _left_running(mark) == [], name
    return found


def test_two_torchrun_nodes(runs: dict[str, list[Node]], tmp_path: Path) -> None:
    """One test, three launched runs started together (each pair of processes costs
    its start-up: Python, torch, the rendezvous)."""
    # All pass: 13 outcomes, reported once, by rank 0; node 1 quiet; both exit 0.
    node0, node1 = runs["good"]
    assert "13 passed" in node0.output, node0.output
    assert "cuda ranks: 2 started by torchrun; this is rank 0 of 2" in node0.output
    assert "passed" not in node1.output, node1.output
    assert (node0.returncode, node1.returncode) == (0, 0), node0.output + node1.output
    log = (tmp_path / "good" / "logs" / "rank1.log").read_text()
    assert "this is rank 1 of 2" in log
    assert "10 passed" in log, log

    # A hang, then a failure, on node 1; the test after them passes on new ranks.
    node0, node1 = runs["bad"]
    out = node0.output
    host = socket.gethostname()
    # The ranks started in the first test's set-up: its call found its rank running.
    assert "RANKS WHEN test_1_hangs_on_node_1 IS CALLED: 1" in out, out
    assert (
        f"test_1_hangs_on_node_1: timed out after 2 s (cuda_distributed timeout): "
        f"rank 0 on {host} (node 0), rank 1 on {host} (node 1) never finished" in out
    ), out
    assert f"rank 1 on {host} (node 1, cpu): still running after" in out, out
    assert 'test_bad.py", line 19 in test_1_hangs_on_node_1' in out, out  # node 1's stack
    assert (
        f"test_2_fails_on_node_1: rank 1 of 2 on {host} (node 1) failed: "
        "AssertionError: planted on rank 1 at test_bad.py:" in out
    ), out
    # A fixture that fails on node 1 alone: rank 0 is told, and does not wait for it.
    assert (
        f"test_2b_set_up_fails_on_node_1 (starting its ranks): rank 1 of 2 on {host} (node 1) "
        "failed: its setup failed on this rank: RuntimeError: no dataset on node 1" in out
    ), out
    assert "time.sleep(3600)" not in node1.output  # node 1 reports nothing itself
    assert "2 failed, 2 passed, 1 skipped, 1 error" in out, out
    assert node0.returncode == 1, out
    assert node1.returncode != 0, node1.output

    # Node 1 collected another test: one clear error, on every node.
    node0, node1 = runs["other"]
    assert "cuda ranks: 2 started by srun; this is rank 0 of 2" in node0.output
    assert f"rank 1 on {host} (node 1) collected other tests than rank 0 on {host} (node 0)" in (
        node0.output
    ), node0.output
    assert "only on rank 1: test_other.py::test_only_on_rank_1" in node0.output
    assert node0.returncode != 0
    assert node1.returncode != 0


TORCHRUN_ENV = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "node-a",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RESTART_COUNT": "2",
}


def test_torchrun_s_variables_name_the_rank() -> None:
    world = launched_world(TORCHRUN_ENV)
    assert (world.launcher, world.rank, world.world_size) == ("torchrun", 3, 8)
    assert (world.local_rank, world.local_world_size, world.node) == (1, 2, 1)
    assert (world.master_addr, world.master_port, world.attempt) == ("node-a", 29500, "2")
    assert world.agent_store
    assert not world.serves_store
    assert not world.on_loopback


def test_srun_s_variables_name_the_rank_and_rank_0_serves_the_store() -> None:
    world = launched_world(
        {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "16",
            "SLURM_LOCALID": "0",
            "SLURM_TASKS_PER_NODE": "8(x2)",
            "SLURM_NODEID": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
        }
    )
    assert (world.launcher, world.rank, world.world_size, world.local_world_size) == (
        "srun",
        0,
        16,
        8,
    )
    assert world.serves_store
    assert world.on_loopback


def test_mpirun_s_variables_name_the_rank() -> None:
    world = launched_world(
        {
            "OMPI_COMM_WORLD_RANK": "5",
            "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            "OMPI_COMM_WORLD_NODE_RANK": "1",
            "MASTER_ADDR": "node-a",
            "MASTER_PORT": "29500",
        }
    )
    assert (world.launcher, world.rank, world.local_rank, world.node) == ("mpirun", 5, 1, 1)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({}, "--cuda-ranks=env: no launcher's rank in the environment (RANK and WORLD_SIZE"),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"},
            "--cuda-ranks=env under srun: set MASTER_ADDR and MASTER_PORT",
        ),
        ({**TORCHRUN_ENV, "RANK": "8"}, "torchrun: RANK=8 is not below WORLD_SIZE=8"),
        ({**TORCHRUN_ENV, "RANK": "one"}, "torchrun: RANK='one' is not a number >= 0"),
    ],
)
def test_a_missing_or_wrong_variable_is_named(environ: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchError) as caught:
        launched_world(environ)
    assert str(caught.value).startswith(message), caught.value


def test_without_a_launcher_the_option_is_a_usage_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("--cuda-ranks=env")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --cuda-ranks=env: no launcher's rank in the environment*"])


def test_with_xdist_the_option_is_a_usage_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("--cuda-ranks=env", "-n", "1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --cuda-ranks=env runs one pytest process per rank*"])
