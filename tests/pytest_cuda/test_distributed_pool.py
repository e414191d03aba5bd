"""Warm ranks (``cuda_distributed`` on the CPU with gloo): reused from test to test,
replaced after a failure, a hang, a death or a test that left state behind, and giving
their cached memory back after each test; forked from a fork server per rank, which
imported torch once a session.

Each planted suite runs for real in two rank processes; every test records the pids of
its ranks, so the tests can tell which tests shared processes. No rank process may
outlive the run. Starting a pair of ranks (two interpreters importing torch) is what
costs: the suites that run in one pytest process run in one session, in the order of
``PLANTED``, and each starts on the warm ranks the one before left.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from gpumagic import cuda
from pytest_cuda.distributed.leftovers import RankState, left_behind
from pytest_cuda.distributed.ranks import DistributedSpec, RankOutcome, verdict

if TYPE_CHECKING:
    import pytest

HEADER = """
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session")
def pids(tmp_path_factory):
    folder = tmp_path_factory.getbasetemp() / "pids"
    folder.mkdir(exist_ok=True)
    return folder


def keep(pids, name, rank):
    (pids / f"{name}-{rank}-{os.getpid()}").touch()


def reduce(rank):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == 3.0
"""


def _numbered(index: int) -> str:
    if index == 5:  # a planted failure on rank 1
        body = '    if cuda_rank.rank == 1:\n        assert index == 6, "planted"\n'
    elif index == 12:  # a planted hang: rank 0 skips the collective
        body = "    if cuda_rank.rank == 0:\n        return\n"
    else:
        body = ""
    timeout = 2 if index == 12 else 30
    return (
        f'\n\n@pytest.mark.cuda_distributed(world_size=2, backend="gloo", timeout={timeout})\n'
        f"def test_{index:02d}(cuda_rank, pids):\n"
        f"    index = {index}\n"
        f'    keep(pids, "test_{index:02d}", cuda_rank.rank)\n'
        f"{body}"
        "    reduce(cuda_rank.rank)\n"
    )


SUITE = HEADER + "".join(_numbered(i) for i in range(1, 21))


def _pids(base: Path) -> dict[str, set[int]]:
    """``{test name: the pids of its ranks}`` (an xdist worker's under its own folder)."""
    found: dict[str, set[int]] = {}
    for path in base.glob("**/pids/*"):
        name, _, pid = path.name.rpartition("-")
        found.setdefault(name.rpartition("-")[0], set()).add(int(pid))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _none_left(pytester: pytest.Pytester) -> None:
    pids = {pid for group in _pids(pytester.path / "base").values() for pid in group}
    assert pids
    assert [pid for pid in pids if _alive(pid)] == []


_SUMMARY = re.compile(r"(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED) (?:\[(\d+)\] )?(\w+)\.py\b")
_OUTCOME = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "XFAIL": "xfailed"}
_OUTCOME |= {"XPASS": "xpassed", "SKIPPED": "skipped"}


def _outcomes(result: pytest.RunResult, module: str) -> dict[str, int]:
    """How the tests of ``module`` ended, counted from the ``-rA`` summary."""
    found: dict[str, int] = {}
    for line in result.outlines:
        match = _SUMMARY.match(line)
        if match and match.group(3) == module:
            outcome = _OUTCOME[match.group(1)]
            found[outcome] = found.get(outcome, 0) + int(match.group(2) or 1)
    return found


def _failure_and_hang(result: pytest.RunResult, pids: dict[str, set[int]]) -> None:
    """``SUITE``: a failure and a hang fail alone, the rest pass on warm ranks."""
    assert _outcomes(result, "test_1_suite") == {"passed": 18, "failed": 2}
    result.stdout.fnmatch_lines(
        [
            "test_05: rank 1 of 2 failed: AssertionError: planted at test_1_suite.py:*",
            "rank 0 (cpu): failed after * (after rank 1 had failed): *",
            "rank 1 (cpu): failed after *: AssertionError: planted*",
            "*assert 5 == 6*",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "test_12: timed out after 2 s (cuda_distributed timeout): rank 1 never finished",
            "rank 0 (cpu): passed after *, then waited for the other ranks until the "
            "test's timeout of 2 s ran out",
            "  Its Python stack when stopped (most recent call first):",
            "*in wait_for_ranks",
            "rank 1 (cpu): still running after *, the test's timeout of 2 s ran out: stopped.",
            "  Its Python stack when stopped (most recent call first):",
            "*in all_reduce",
            "*test_1_suite.py*in test_12",
        ]
    )
    failed = {
        line.split("::")[1].split()[0]
        for line in result.outlines
        if line.startswith("FAILED test_1_suite.py")
    }
    assert failed == {"test_05", "test_12"}
    assert len([name for name in pids if name.startswith("test_") and name[5:].isdigit()]) == 20
    # One pair of processes before the failure, one until the hang, one after it.
    runs = [range(1, 6), range(6, 13), range(13, 21)]
    pairs = [{frozenset(pids[f"test_{i:02d}"]) for i in run} for run in runs]
    assert [len(pair) for pair in pairs] == [1, 1, 1]
    assert len({next(iter(pair)) for pair in pairs}) == 3
    assert all(len(next(iter(pair))) == 2 for pair in pairs)


LEFTOVERS = (
    HEADER
    + """

@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_keeps_a_group(cuda_rank, pids):
    keep(pids, "test_keeps_a_group", cuda_rank.rank)
    if cuda_rank.rank == 1:
        dist.new_group([1], use_local_synchronization=True)


@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_flips_tf32(cuda_rank, pids):
    keep(pids, "test_flips_tf32", cuda_rank.rank)
    if cuda_rank.rank == 0:
        torch.backends.cuda.matmul.allow_tf32 = True


@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_sets_env(cuda_rank, pids):
    keep(pids, "test_sets_env", cuda_rank.rank)
    if cuda_rank.rank == 1:
        os.environ["PLANTED_LEFTOVER"] = "1"


@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_turns_grad_off(cuda_rank, pids):
    keep(pids, "test_turns_grad_off", cuda_rank.rank)
    torch.set_grad_enabled(False)


@pytest.mark.cuda_distributed(world_size=2, backend="gloo", fresh_group=True)
def test_own_group_may_keep_subgroups(cuda_rank, pids):
    keep(pids, "test_own_group_may_keep_subgroups", cuda_rank.rank)
    dist.new_group([0, 1])
    reduce(cuda_rank.rank)


@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_clean_after(cuda_rank, pids):
    keep(pids, "test_clean_after", cuda_rank.rank)
    assert not torch.backends.cuda.matmul.allow_tf32
    assert "PLANTED_LEFTOVER" not in os.environ
    assert torch.is_grad_enabled()
    reduce(cuda_rank.rank)
"""
)


def _leftovers(result: pytest.RunResult, pids: dict[str, set[int]]) -> None:
    """``LEFTOVERS``: state left behind fails the test on the rank that left it."""
    assert _outcomes(result, "test_2_leftovers") == {"passed": 2, "failed": 4}
    result.stdout.fnmatch_lines(
        [
            "test_keeps_a_group: rank 1 of 2 failed: left state behind for the next test: "
            "a process group (gloo, ranks [1]) that is still alive",
            "*It left, for the next test on this warm rank:",
            "*  a process group (gloo, ranks [[]1]) that is still alive",
            "*Put it back before the test returns*isolate=True*",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "test_flips_tf32: rank 0 of 2 failed: left state behind for the next test: "
            "torch.backends.cuda.matmul.allow_tf32 = True (it was False)*",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "test_sets_env: rank 1 of 2 failed: left state behind for the next test: "
            "environment variable PLANTED_LEFTOVER='1' (it was not set)",
        ]
    )
    # Both ranks turned grad off: either may be the first to say so, both are listed.
    result.stdout.fnmatch_lines(
        [
            "test_turns_grad_off: rank ? of 2 failed: left state behind for the next test: "
            "torch.is_grad_enabled() = False (it was True)",
        ]
    )
    result.stdout.fnmatch_lines_random(
        [
            f"rank {rank} (cpu): failed after * left state behind for the next test: "
            "torch.is_grad_enabled() = False (it was True)"
            for rank in (0, 1)
        ]
    )
    # Each test that left state had its ranks replaced: every test ran on new ones.
    firsts = [pids[name] for name in ("test_keeps_a_group", "test_flips_tf32", "test_sets_env")]
    assert len({frozenset(p) for p in firsts}) == 3
    assert pids["test_own_group_may_keep_subgroups"] == pids["test_clean_after"]


OUTCOMES = (
    HEADER
    + """

@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_skips_everywhere(cuda_rank, pids):
    keep(pids, "test_skips_everywhere", cuda_rank.rank)
    pytest.skip("no dataset here")


@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_skips_on_rank1(cuda_rank, pids):
    keep(pids, "test_skips_on_rank1", cuda_rank.rank)
    if cuda_rank.rank == 1:
        pytest.skip("rank 1 has no shard")


@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_xfails(cuda_rank, pids):
    keep(pids, "test_xfails", cuda_rank.rank)
    pytest.xfail("known bug")


@pytest.mark.cuda_distributed(world_size=2, backend="GLOO")
def test_backend_in_capitals(cuda_rank, pids):
    keep(pids, "test_backend_in_capitals", cuda_rank.rank)
    assert cuda_rank.backend == "gloo"
    reduce(cuda_rank.rank)


@pytest.mark.cuda_distributed(world_size=2, backend="glo")
def test_typo(cuda_rank):
    pass


@pytest.mark.cuda_distributed(world_size=2, backend="gloo", isolate=True)
def test_isolated(cuda_rank, pids):
    keep(pids, "test_isolated", cuda_rank.rank)
    reduce(cuda_rank.rank)


@pytest.mark.cuda_distributed(world_size=2, backend="gloo", fresh_group=True)
def test_fresh_group(cuda_rank, pids):
    keep(pids, "test_fresh_group", cuda_rank.rank)
    reduce(cuda_rank.rank)


@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_after_a_fresh_group(cuda_rank, pids):
    keep(pids, "test_after_a_fresh_group", cuda_rank.rank)
    reduce(cuda_rank.rank)
"""
)


def _outcomes_and_switches(result: pytest.RunResult, pids: dict[str, set[int]]) -> None:
    """``OUTCOMES``: skips, an xfail and backend names keep the warm ranks; ``isolate``
    runs on fresh ones, ``fresh_group`` on the warm ones."""
    assert _outcomes(result, "test_0_outcomes") == {
        "passed": 4,
        "skipped": 2,
        "xfailed": 1,
        "errors": 1,
    }
    result.stdout.fnmatch_lines(
        [
            "SKIPPED * test_0_outcomes.py:*: on every rank: no dataset here",
            "SKIPPED * test_0_outcomes.py:*: skipped on rank 1 only (rank 0 passed): rank 1 "
            "has no shard",
        ],
        consecutive=False,
    )
    result.stdout.fnmatch_lines(
        ["XFAIL test_0_outcomes.py::test_xfails - on every rank: known bug"]
    )
    result.stdout.fnmatch_lines(
        [
            "usage: @pytest.mark.cuda_distributed(backend='glo') on "
            "test_0_outcomes.py::test_typo: torch does not know the backend 'glo'; it knows "
            "gloo, nccl, *",
        ]
    )
    warm = pids["test_skips_everywhere"]
    for name in ("test_skips_on_rank1", "test_xfails", "test_backend_in_capitals"):
        assert pids[name] == warm, name
    assert not pids["test_isolated"] & warm
    assert pids["test_fresh_group"] == pids["test_after_a_fresh_group"] == warm


DEATHS = (
    HEADER
    + """

@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_passes_first(cuda_rank, pids):
    keep(pids, "test_passes_first", cuda_rank.rank)
    reduce(cuda_rank.rank)


@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_exits(cuda_rank, pids):
    keep(pids, "test_exits", cuda_rank.rank)
    if cuda_rank.rank == 1:
        os._exit(3)
    reduce(cuda_rank.rank)


@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_killed(cuda_rank, pids):
    keep(pids, "test_killed", cuda_rank.rank)
    if cuda_rank.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    reduce(cuda_rank.rank)


@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_passes_after(cuda_rank, pids):
    keep(pids, "test_passes_after", cuda_rank.rank)
    reduce(cuda_rank.rank)
"""
)


def _deaths(result: pytest.RunResult, pids: dict[str, set[int]]) -> None:
    """``DEATHS``: a rank that dies is the headline."""
    assert _outcomes(result, "test_3_deaths") == {"passed": 2, "failed": 2}
    result.stdout.fnmatch_lines(
        [
            "test_exits: rank 1 of 2 failed: exit status 3",
            "rank 0 (cpu): failed after * (after rank 1 had died): *",
            "rank 1 (cpu): the process ended after * without a result (exit status 3)",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "test_killed: rank 0 of 2 failed: killed by SIGKILL",
            "rank 0 (cpu): the process ended after * without a result (killed by SIGKILL)",
            "rank 1 (cpu): failed after * (after rank 0 had died): *",
        ]
    )
    # Its ranks were replaced after each death.
    after = [pids[name] for name in ("test_exits", "test_killed", "test_passes_after")]
    assert len({frozenset(p) for p in after}) == 3


GIVE_BACK = (
    HEADER
    + """

def plant(pids, rank, name, release):
    # The seam's release, replaced in this rank's process by one that notes its calls.
    from gpumagic import cuda

    log = pids.parent / f"{name}-{rank}"

    def noted(devices):
        with log.open("a") as file:
            file.write(f"{list(devices)}\\n")
        release()

    cuda.release_cached_blocks = noted


def nothing():
    pass


def refuse():
    raise RuntimeError("planted: the driver said no")


@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_01_plants(cuda_rank, pids):
    keep(pids, "test_01_plants", cuda_rank.rank)
    plant(pids, cuda_rank.rank, "released", nothing)
    reduce(cuda_rank.rank)


@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_02_skips(cuda_rank, pids):
    keep(pids, "test_02_skips", cuda_rank.rank)
    pytest.skip("no dataset here")


@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_03_refused(cuda_rank, pids):
    keep(pids, "test_03_refused", cuda_rank.rank)
    # Given back after each test that went well, before its result: a line a test.
    assert (pids.parent / f"released-{cuda_rank.rank}").read_text() == "[]\\n[]\\n"
    plant(pids, cuda_rank.rank, "refused", refuse)
    reduce(cuda_rank.rank)


@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_04_after(cuda_rank, pids):
    keep(pids, "test_04_after", cuda_rank.rank)
    reduce(cuda_rank.rank)


@pytest.mark.cuda_distributed(world_size=2, backend="gloo", isolate=True)
def test_05_fresh(cuda_rank, pids):
    keep(pids, "test_05_fresh", cuda_rank.rank)
    plant(pids, cuda_rank.rank, "fresh", nothing)
    reduce(cuda_rank.rank)
"""
)


def _give_back(result: pytest.RunResult, pids: dict[str, set[int]]) -> None:
    """``GIVE_BACK``: after each test that went well, a warm rank gives its cached CUDA
    blocks back (through the seam, for its own device: none under gloo), before its
    result; a rank that cannot fails the test and is replaced. (What each rank's
    planted release noted: :func:`_released`.)"""
    assert _outcomes(result, "test_4_give_back") == {"passed": 3, "skipped": 1, "failed": 1}
    result.stdout.fnmatch_lines(
        [
            "test_03_refused: rank ? of 2 failed: giving the CUDA memory this rank cached "
            "back to the driver failed: RuntimeError: planted: the driver said no",
        ]
    )
    assert pids["test_01_plants"] == pids["test_02_skips"] == pids["test_03_refused"]
    assert pids["test_04_after"].isdisjoint(pids["test_03_refused"])


def _released(base: Path) -> None:
    """``GIVE_BACK``'s planted releases: the refused one was called once on each rank;
    a fresh rank's memory goes with its process (its release is never called)."""
    for rank in (0, 1):
        assert (base / f"refused-{rank}").read_text() == "[]\n"
    assert not list(base.glob("fresh-*"))


FORKED = (
    HEADER
    + """

def parent(pid):
    with open(f"/proc/{pid}/stat") as stat:
        found = int(stat.read().rpartition(")")[2].split()[1])
    with open(f"/proc/{found}/cmdline", "rb") as cmdline:
        return found, b"pytest_cuda.distributed.forkserver_main" in cmdline.read()


@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_forked_by_a_server_each(cuda_rank, pids):
    keep(pids, "test_forked_by_a_server_each", cuda_rank.rank)
    server, forked = parent(os.getpid())
    assert forked
    # Each rank's own server: its own seed of str hashes, as a process of its own has.
    mine = torch.tensor([float(server), float(hash("pytest_cuda") % 1000003)], dtype=torch.float64)
    both = [torch.zeros(2, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(both, mine)
    assert both[0][0] != both[1][0]
    if "PYTHONHASHSEED" not in os.environ:
        assert both[0][1] != both[1][1]


@pytest.mark.cuda_distributed(world_size=2, backend="gloo", timeout=20)
def test_its_server_ends(cuda_rank, pids):
    keep(pids, "test_its_server_ends", cuda_rank.rank)
    if cuda_rank.rank == 0:
        os.kill(parent(os.getpid())[0], signal.SIGKILL)
        time.sleep(60)  # no rank ends: the pytest process kills the server's
    reduce(cuda_rank.rank)


@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_after_its_server(cuda_rank, pids):
    keep(pids, "test_after_its_server", cuda_rank.rank)
    assert parent(os.getpid())[1]
    reduce(cuda_rank.rank)
"""
)


def _forked(result: pytest.RunResult, pids: dict[str, set[int]]) -> None:
    """``FORKED``: each rank forked by a server of its own (its own ``str`` hash seed);
    a server that ends has its ranks killed, reported so, and the next test gets a new
    server and new ranks."""
    assert _outcomes(result, "test_5_forked") == {"passed": 2, "failed": 1}
    result.stdout.fnmatch_lines(
        [
            "test_its_server_ends: rank 0 of 2 failed: killed by SIGKILL",
            "rank 0 (cpu): the process ended after * without a result (killed by SIGKILL)",
        ]
    )
    assert pids["test_forked_by_a_server_each"] == pids["test_its_server_ends"]
    assert pids["test_after_its_server"].isdisjoint(pids["test_its_server_ends"])


def _no_server_left() -> None:
    """The session's fork servers ended with it."""
    children = []
    for task in Path("/proc/self/task").iterdir():
        children += (task / "children").read_text().split()
    servers = []
    for pid in children:
        with contextlib.suppress(OSError):
            if b"forkserver_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                servers.append(pid)
    assert servers == []


#: The planted suites of one session, in the order they run, and what each must show.
PLANTED = {
    "test_0_outcomes": (OUTCOMES, _outcomes_and_switches),
    "test_1_suite": (SUITE, _failure_and_hang),
    "test_2_leftovers": (LEFTOVERS, _leftovers),
    "test_3_deaths": (DEATHS, _deaths),
    "test_4_give_back": (GIVE_BACK, _give_back),
    "test_5_forked": (FORKED, _forked),
}


def test_warm_ranks_are_kept_through_passes_and_replaced_after_what_went_wrong(
    pytester: pytest.Pytester,
) -> None:
    """Every planted suite in one session: each suite's outcomes and reports, and which
    tests shared rank processes, as if it had run alone."""
    pytester.makepyfile(**{name: source for name, (source, _) in PLANTED.items()})
    result = pytester.runpytest("-rA", "-p", "no:cacheprovider", "--basetemp", "base")
    result.assert_outcomes(passed=31, failed=10, skipped=3, xfailed=1, errors=1)
    pids = _pids(pytester.path / "base")
    for _, check in PLANTED.values():
        check(result, pids)
    _released(pytester.path / "base")
    # The warm ranks one suite left are the next one's.
    assert pids["test_after_a_fresh_group"] == pids["test_01"]
    assert pids["test_20"] == pids["test_keeps_a_group"]
    assert pids["test_clean_after"] == pids["test_passes_first"]
    assert pids["test_passes_after"] == pids["test_01_plants"]
    assert pids["test_04_after"] == pids["test_forked_by_a_server_each"]
    _none_left(pytester)
    _no_server_left()


PAIRS = HEADER + "".join(
    f"""

@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_{i}(cuda_rank, pids):
    keep(pids, "test_{i}", cuda_rank.rank)
    reduce(cuda_rank.rank)
"""
    for i in range(4)
)


def test_each_xdist_worker_keeps_its_own_pool(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_planted=PAIRS)
    result = pytester.runpytest("-n", "2", "-p", "no:cacheprovider", "--basetemp", "base")
    result.assert_outcomes(passed=4)
    pids = _pids(pytester.path / "base")
    assert len(pids) == 4
    # Two workers, each with one pair of warm ranks (a worker may have run every test).
    assert len({frozenset(p) for p in pids.values()}) <= 2
    assert all(len(p) == 2 for p in pids.values())
    _none_left(pytester)


def _state(**changes: dict[str, str]) -> RankState:
    base = {
        "environ": {"HOME": "/root"},
        "flags": {"torch.backends.cudnn.benchmark": "False"},
        "groups": {1: "gloo, ranks [0, 1]"},
    }
    return RankState(**{**base, **changes})  # type: ignore[arg-type]


def test_left_behind_says_what_changed_and_how() -> None:
    before = _state()
    after = _state(
        environ={"FOO": "1"},
        flags={"torch.backends.cudnn.benchmark": "True"},
        groups={1: "gloo, ranks [0, 1]", 2: "gloo, ranks [1]"},
    )
    assert left_behind(before, after) == [
        "a process group (gloo, ranks [1]) that is still alive",
        "torch.backends.cudnn.benchmark = True (it was False)",
        "environment variable FOO='1' (it was not set)",
        "environment variable HOME unset (it was '/root')",
    ]
    assert left_behind(before, _state()) == []


def test_a_cache_directory_torch_sets_on_import_is_not_a_leftover(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # DDP's constructor imports torch._dynamo, which sets TORCHINDUCTOR_CACHE_DIR to its
    # default; a compiled kernel's first run sets TRITON_CACHE_DIR under it. The next
    # test sees what it would have without them. Any other value is the test's.
    monkeypatch.setattr(cuda, "torch_default_cache_dir", lambda: "/tmp/torchinductor_me")
    before = _state()
    after = _state(
        environ={
            "HOME": "/root",
            "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_me",
            "TRITON_CACHE_DIR": "/tmp/torchinductor_me/triton/1",
        }
    )
    assert left_behind(before, after) == []
    elsewhere = _state(
        environ={"HOME": "/root", "TORCHINDUCTOR_CACHE_DIR": "/elsewhere", "TRITON_CACHE_DIR": "/t"}
    )
    assert left_behind(before, elsewhere) == [
        "environment variable TORCHINDUCTOR_CACHE_DIR='/elsewhere' (it was not set)",
        "environment variable TRITON_CACHE_DIR='/t' (it was not set)",
    ]
    changed = _state(environ={"HOME": "/root", "TORCHINDUCTOR_CACHE_DIR": "/elsewhere"})
    assert left_behind(after, changed) == [
        "environment variable TORCHINDUCTOR_CACHE_DIR='/elsewhere' "
        "(it was '/tmp/torchinductor_me')",
        "environment variable TRITON_CACHE_DIR unset (it was '/tmp/torchinductor_me/triton/1')",
    ]


def test_a_peer_error_just_before_the_death_is_not_the_headline() -> None:
    spec = DistributedSpec(backend="gloo")
    dead = RankOutcome(1, "cpu", "exited", message="exit status 3", finished_at=1.0)
    reset = RankOutcome(0, "cpu", "failed", message="Connection reset by peer", finished_at=0.98)
    result = verdict([reset, dead], spec, timed_out=None, name="t")
    assert result.text.splitlines()[0] == "t: rank 1 of 2 failed: exit status 3"
    assert "rank 0 (cpu): failed after 0.0 s (after rank 1 had died)" in result.text
    # An error well before the death came first: it is the headline.
    early = RankOutcome(0, "cpu", "failed", message="ValueError: bad shard", finished_at=0.1)
    result = verdict([early, dead], spec, timed_out=None, name="t")
    assert result.text.splitlines()[0] == "t: rank 0 of 2 failed: ValueError: bad shard"


def test_importing_the_pool_imports_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, pytest_cuda.distributed.pool, pytest_cuda.distributed.leftovers, "
        "pytest_cuda.plugin; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ
    )
    assert out.stdout.strip() == "False"
