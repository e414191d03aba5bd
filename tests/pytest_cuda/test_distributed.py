"""Multi-rank tests (``cuda_distributed``, ``cuda_rank``) on the CPU with gloo.

The planted suite runs for real: each test's function in two fresh rank processes that
all-reduce through gloo. A planted failure on rank 1 must be reported on rank 1 with its
line; a planted hang (rank 0 skips the collective) must end at the test's timeout with
both ranks' stacks; no rank process, nor one a rank started, may outlive its test. The
NCCL backend's device rules are checked on a made-up machine (see fake_cuda.py); the
same tests on two real GPUs are in ``test_distributed_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import sys
import types
from typing import TYPE_CHECKING

import pytest
from reports import skip_reasons

from fake_cuda import h200s
from pytest_cuda.distributed.job import JOB_FILE, JobRun, RankJob, read_job
from pytest_cuda.distributed.launch import STARTUP_S, write_job
from pytest_cuda.distributed.ranks import (
    DistributedSpec,
    RankOutcome,
    parse_distributed_marker,
    verdict,
)
from pytest_cuda.leaks.engine import LeakSettings

if TYPE_CHECKING:
    from pathlib import Path

    from conftest import FakeGpus

PLANTED = """
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist


def keep_pid(folder, name):
    (folder / f"{name}-{os.getpid()}.pid").write_text(str(os.getpid()))


@pytest.fixture(scope="session")
def pids(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "pids"


@pytest.fixture
def scale():
    return {"factor": 3}


class TestGroup:
    @pytest.mark.parametrize("n", [2])
    @pytest.mark.cuda_distributed(world_size=2, backend="gloo", timeout=30)
    def test_all_reduce(self, cuda_rank, scale, n, pids, tmp_path):
        pids.mkdir(exist_ok=True)
        keep_pid(pids, f"reduce{n}")
        assert cuda_rank.world_size == 2 and str(cuda_rank.device) == "cpu"
        assert os.environ["RANK"] == str(cuda_rank.rank)
        t = torch.tensor([cuda_rank.rank + 1.0]) * scale["factor"] * n
        dist.all_reduce(t, group=cuda_rank.group)
        (tmp_path / f"rank{cuda_rank.rank}").write_text(str(t.item()))
        print(f"rank {cuda_rank.rank} of {cuda_rank.world_size} got {t.item()}")
        assert t.item() == 9.0 * n


@pytest.mark.cuda_distributed(world_size=2, backend="gloo", timeout=30)
def test_rank1_fails(cuda_rank):
    t = torch.ones(1)
    if cuda_rank.rank == 1:
        assert t.item() == 2.0, "planted"
    dist.all_reduce(t)


@pytest.mark.cuda_distributed(world_size=2, backend="gloo", timeout=2)
def test_hang(cuda_rank, pids):
    pids.mkdir(exist_ok=True)
    keep_pid(pids, "hang")
    if cuda_rank.rank == 0:
        return  # skips the collective
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    (pids / f"grandchild-{child.pid}.pid").write_text(str(child.pid))
    dist.all_reduce(torch.ones(1))


@pytest.fixture
def lock():
    return threading.Lock()


@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_unpicklable(cuda_rank, lock):
    pass


def test_rank_without_marker(cuda_rank):
    pass


@pytest.mark.cuda_distributed(world_size=0, backend="gloo")
def test_malformed():
    pass
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - someone else's process now has it
        return True
    # A zombie (exited, not yet reaped by a parent that is gone) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except OSError:  # pragma: no cover - no /proc: trust kill
        return True


def test_gloo_ranks_all_reduce_fail_and_hang_as_reported(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_planted=PLANTED)
    result = pytester.runpytest("-rA", "-p", "no:cacheprovider", "--basetemp", "base")
    result.assert_outcomes(passed=1, failed=3, errors=2)
    out = result.stdout.str()
    # The all-reduce: both ranks' output, as sections of the report.
    result.stdout.fnmatch_lines(
        [
            "*Captured stdout (rank 0) call*",
            "rank 0 of 2 got 18.0",
            "*Captured stdout (rank 1) call*",
            "rank 1 of 2 got 18.0",
        ]
    )
    # The planted failure: rank 1, its line, its assertion explained; rank 0's own
    # failure comes after it.
    result.stdout.fnmatch_lines(
        [
            "test_rank1_fails: rank 1 of 2 failed: AssertionError: planted*at test_planted.py:*",
            "rank 0 (cpu): failed after * (after rank 1 had failed): *",
            "rank 1 (cpu): failed after *: AssertionError: planted*",
            "*assert 1.0 == 2.0*",
        ]
    )
    # The hang: ended at its timeout, both ranks' stacks, rank 1 in the collective.
    result.stdout.fnmatch_lines(
        [
            "test_hang: timed out after 2 s (cuda_distributed timeout): rank 1 never finished",
            "rank 0 (cpu): passed after *, then waited for the other ranks until the "
            "test's timeout of 2 s ran out",
            "  Its Python stack when stopped (most recent call first):",
            "*in wait_for_ranks",
            "rank 1 (cpu): still running after *, the test's timeout of 2 s ran out: stopped.",
            "  Its Python stack when stopped (most recent call first):",
            "*in all_reduce",
            "*test_planted.py*in test_hang",
        ]
    )
    # The frames that only start a rank are left out of its stack.
    assert "rank_main.py" not in result.stdout.str()
    # Bad input: clear errors naming what is wrong.
    result.stdout.fnmatch_lines(
        [
            "*each rank's process; these cannot be:",
            "  fixture 'lock' (lock): cannot pickle '_thread.lock' object",
        ]
    )
    assert (
        "the cuda_rank fixture is given only to tests marked "
        "@pytest.mark.cuda_distributed(world_size=N)" in out
    )
    assert (
        "malformed @pytest.mark.cuda_distributed on test_planted.py::test_malformed: "
        "world_size must be a positive integer, got 0" in out
    )
    # Each rank wrote to the test's own tmp_path: the fixture value is shared.
    written = sorted(p.name for p in pytester.path.glob("base/test_all_reduce_2_0/rank*"))
    assert written == ["rank0", "rank1"]
    # No rank and no process a rank started is left behind.
    pids = [int(p.read_text()) for p in (pytester.path / "base" / "pids").glob("*.pid")]
    assert len(pids) == 2 + 2 + 1, pids
    assert [pid for pid in pids if _alive(pid)] == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 1.5}, "world_size must be a positive integer, got 1.5"),
        ({"backend": ""}, 'backend must be a name such as "nccl" or "gloo", got \'\''),
        ({"timeout": 0}, "timeout must be a number of seconds > 0, got 0"),
        (
            {"ranks": 2},
            "unknown keyword 'ranks'; known: world_size, backend, timeout, fresh_group, isolate",
        ),
    ],
)
def test_malformed_markers_say_what_is_wrong(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_distributed_marker((), kwargs)
    assert str(raised.value) == message


def test_positional_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="keyword arguments only"):
        parse_distributed_marker((2,), {})


def test_which_backends_need_a_gpu() -> None:
    assert DistributedSpec(backend="nccl").uses_cuda
    assert not DistributedSpec(backend="gloo").uses_cuda
    assert DistributedSpec(backend="cpu:gloo,cuda:nccl").uses_cuda


def test_a_rank_that_died_is_reported_with_its_exit() -> None:
    outcomes = [
        RankOutcome(0, "cuda:0", "passed", seconds=1.0, waiting=True, stack=""),
        RankOutcome(
            1, "cuda:1", "exited", seconds=0.5, message="killed by SIGSEGV", stderr="boom\n"
        ),
    ]
    result = verdict(outcomes, DistributedSpec(), timed_out=None, name="test_x")
    assert result.outcome == "failed"
    assert result.text.splitlines()[0] == "test_x: rank 1 of 2 failed: killed by SIGSEGV"
    assert "rank 1 (cuda:1): the process ended after 0.5 s without a result" in result.text
    assert "    boom" in result.text


def test_the_first_rank_to_fail_is_the_one_that_failed_first(tmp_path: Path) -> None:
    # Rank 1 fails; rank 0 fails 0.2 s later because rank 1 went away. The launcher
    # saw both end in the same poll: the ranks' own times decide which came first.
    from pytest_cuda.distributed.launch import _outcome
    from pytest_cuda.distributed.rank_main import result_path

    start = 100.0
    failures = {0: ("RuntimeError: Connection closed by peer", 101.7), 1: ("planted", 101.5)}
    for rank, (message, at) in failures.items():
        record = {"state": "failed", "message": message, "at": at}
        result_path(tmp_path, rank).write_text(json.dumps(record))
    ended = types.SimpleNamespace(returncode=1)
    outcomes = [
        _outcome(  # type: ignore[arg-type]
            tmp_path, rank, ended, "cpu", stopped=False, start=start, ended=102.0, decided=102.0
        )
        for rank in (0, 1)
    ]
    assert [round(o.finished_at, 3) for o in outcomes] == [1.7, 1.5]
    result = verdict(outcomes, DistributedSpec(backend="gloo"), timed_out=None, name="t")
    assert result.text.splitlines()[0] == "t: rank 1 of 2 failed: planted"


def test_a_failure_the_stop_caused_is_reported_as_still_running(tmp_path: Path) -> None:
    """A rank still running at the timeout whose collective broke while the launcher
    stopped its peers (the peer's stack dump, then its kill) is reported as stopped,
    with its stack: its failure came after the stop was decided. One that failed
    before stays failed."""
    from pytest_cuda.distributed.launch import _outcome
    from pytest_cuda.distributed.rank_main import result_path, stack_path, started_path

    decided = 1000.0
    stack_path(tmp_path, 1).write_text('  File "test_planted.py", line 111 in test_12\n')
    started_path(tmp_path, 1).write_text("")
    broken = {"state": "failed", "message": "RuntimeError: Connection closed by peer"}
    proc = types.SimpleNamespace(returncode=None)
    for at, state in ((decided + 0.1, "stopped"), (decided - 0.5, "failed")):
        result_path(tmp_path, 1).write_text(json.dumps({**broken, "at": at}))
        outcome = _outcome(
            tmp_path,
            1,
            proc,  # type: ignore[arg-type]
            "cpu",
            stopped=True,
            start=0.0,
            ended=decided,
            decided=decided,
        )
        assert outcome.state == state
        assert ("test_12" in outcome.stack) == (state == "stopped")


def test_a_skipped_rank_skips_the_test_saying_which() -> None:
    outcomes = [
        RankOutcome(0, "cpu", "passed"),
        RankOutcome(1, "cpu", "skipped", message="needs a file"),
    ]
    result = verdict(outcomes, DistributedSpec(backend="gloo"), timed_out=None, name="t")
    assert (result.outcome, result.text) == (
        "skipped",
        "skipped on rank 1 only (rank 0 passed): needs a file",
    )
    every = [RankOutcome(r, "cpu", "skipped", message="needs a file") for r in (0, 1)]
    result = verdict(every, DistributedSpec(backend="gloo"), timed_out=None, name="t")
    assert (result.outcome, result.text) == ("skipped", "on every rank: needs a file")


NCCL_TESTS = """
import pytest

@pytest.mark.cuda_distributed(world_size=2)
def test_pair(cuda_rank):
    pass
"""


def test_too_few_devices_skips_with_the_reason(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus(h200s(1))
    pytester.makepyfile(NCCL_TESTS)
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=1)
    ((reason, _),) = skip_reasons(result).items()
    assert reason.startswith("needs 2 CUDA devices, 1 available: 0 NVIDIA H200")


def test_too_few_devices_fails_under_cuda_require(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus(h200s(2))
    pytester.makepyfile(NCCL_TESTS)
    result = pytester.runpytest("--cuda-require", "--cuda-devices=0")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*needs 2 CUDA devices, 1 selected by --cuda-devices=0*"])


def test_an_xdist_worker_with_too_few_devices_is_a_usage_error(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus(h200s(2))
    pytester.makepyfile(NCCL_TESTS)
    result = pytester.runpytest_subprocess("-n", "2", "--cuda-devices=0,1")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*usage: a cuda_distributed test with world_size=2 needs "
            "--cuda-devices-per-worker=2 or more under pytest-xdist; xdist worker gw* owns 1*"
        ]
    )


def test_marker_and_fixture_are_documented(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(
        [
            '@pytest.mark.cuda_distributed(world_size=2, backend="nccl", timeout=60, '
            "fresh_group=False, isolate=False): run *"
        ]
    )
    result = pytester.runpytest("--fixtures")
    result.stdout.fnmatch_lines(["cuda_rank -- *", "    This rank of a ``cuda_distributed`` test*"])


def test_the_job_a_rank_reads_is_the_frozen_one_the_launcher_wrote(tmp_path: Path) -> None:
    job = RankJob(
        name="test_x[2]",
        module="test_x",
        module_file=str(tmp_path / "test_x.py"),
        call=b"call",
        wants_rank=True,
        spec=DistributedSpec(world_size=2, backend="gloo", timeout=5.0),
        devices=(),
        leak=LeakSettings(0, "fail", search_s=0.3, root=str(tmp_path)),
    )
    write_job(
        job,
        tmp_path,
        port=1234,
        cwd=tmp_path,
        job_id="3",
        generation=2,
        group_timeout_s=65.0,
        warm=True,
    )
    read = read_job(tmp_path)
    assert read == JobRun(
        job,
        port=1234,
        sys_path=tuple(sys.path),
        cwd=str(tmp_path),
        job_id="3",
        generation=2,
        group_timeout=65.0,
        startup=STARTUP_S,
        warm=True,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        read.port = 1  # type: ignore[misc]


def test_a_job_file_of_another_kind_is_named(tmp_path: Path) -> None:
    (tmp_path / JOB_FILE).write_bytes(pickle.dumps({"name": "test_x"}))
    with pytest.raises(TypeError, match=r"job\.pickle holds a dict, not a JobRun: the rank and"):
        read_job(tmp_path)
