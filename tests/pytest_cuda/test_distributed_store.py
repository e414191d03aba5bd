"""What ``cuda_distributed`` exposes (issue 43): sockets on loopback only, nothing from the
rendezvous store loaded as an object, and private folders (CPU, gloo).

The planted suites run for real in two warm rank processes and read the operating
system's socket tables (``listening.py``, copied next to them) while the ranks are up;
the same check on two GPUs with NCCL is ``test_distributed_gpu.py``'s
``test_nccl_ranks_listen_on_loopback_only``.
"""

from __future__ import annotations

import datetime
import os
import pickle
import stat
from pathlib import Path

import listening
import pytest
import torch.distributed as dist

from gpumagic import cuda
from gpumagic.cuda import process_group
from pytest_cuda.child import Workdirs
from pytest_cuda.distributed.job import JOB_FILE, read_job

pytestmark = pytest.mark.skipif(not listening.readable(), reason="needs /proc/net/tcp (Linux)")

LOOPBACK_SUITE = """
import os
import stat
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import listening


def reduce(cuda_rank):
    t = torch.ones(1, device=cuda_rank.device)
    dist.all_reduce(t)
    assert t.item() == 2.0


def private(folder):
    return stat.S_IMODE(folder.stat().st_mode) == 0o700


@pytest.mark.cuda_distributed(world_size=2{backend})
def test_1_warms_the_ranks(cuda_rank):
    reduce(cuda_rank)
    names = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    print(*(f"{{name}}={{os.environ.get(name)}}" for name in names))


def test_2_the_pytest_process_and_its_ranks_listen_on_loopback_only():
    ranks = listening.ranks_of(os.getpid())
    assert len(ranks) == 2, ranks  # the warm ranks are up
    started = listening.descendants(os.getpid())  # the ranks and their fork servers
    found = listening.listening([os.getpid(), *started])
    print(*found, sep=chr(10))
    assert os.getpid() in {{f.pid for f in found}}  # the rendezvous store
    assert listening.not_on_loopback([os.getpid(), *started]) == []


@pytest.mark.cuda_distributed(world_size=2{backend})
def test_3_a_rank_sees_the_same(cuda_rank):
    reduce(cuda_rank)
    pytest_process = listening.pytest_process()
    ranks = listening.descendants(pytest_process)
    assert os.getpid() in ranks
    assert listening.not_on_loopback([pytest_process, *ranks]) == []
    # Its output goes to the job's folder, in its pool's, in the session's: all private.
    job = Path(os.readlink("/proc/self/fd/1")).parent
    assert job.parent.parent.name.startswith("pytest-cuda-ranks-")
    assert [f for f in (job, job.parent, job.parent.parent) if not private(f)] == []
    dist.barrier()


@pytest.mark.cuda_distributed(world_size=2{backend}, isolate=True)
def test_4_fresh_ranks_too(cuda_rank):
    reduce(cuda_rank)
    pytest_process = listening.pytest_process()
    ranks = listening.descendants(pytest_process)
    assert listening.not_on_loopback([pytest_process, *ranks]) == []
    job = Path(os.readlink("/proc/self/fd/1")).parent
    assert job.name.startswith("pytest-cuda-ranks-") and private(job)
    dist.barrier()
"""


def loopback_suite(backend: str | None) -> str:
    """The planted suite that reads the socket tables; ``backend=None``: NCCL."""
    return LOOPBACK_SUITE.format(backend=f", backend={backend!r}" if backend else "")


def plant_listening(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(listening=Path(listening.__file__).read_text())


def test_the_check_sees_a_store_that_listens_on_every_interface() -> None:
    # Asked for 127.0.0.1, torch's own server listens on every interface: the check of
    # the suite above would catch the plugin going back to it.
    timeout = datetime.timedelta(seconds=10)
    everywhere = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    store, port = cuda.host_store(10)
    mine = {found.port: found for found in listening.listening([os.getpid()])}
    assert not mine[everywhere.port].on_loopback
    assert str(mine[port].address) == "127.0.0.1"
    del everywhere, store
    # The store closes the socket it was handed: a pool that restarts leaves none open.
    assert port not in {found.port for found in listening.listening([os.getpid()])}


class Planted:
    """Loading this pickle creates the file ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


PICKLE_SUITE = """
import datetime
import os
import pickle

import pytest
import torch
import torch.distributed as dist

import listening

MARKER = os.path.abspath("unpickled")


class Planted:
    def __reduce__(self):
        return (open, (MARKER, "w"))


@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_1_plants_a_pickle(cuda_rank):
    if cuda_rank.rank == 0:
        # As any process on the host could: find the store's port, connect, write.
        (found,) = listening.listening([listening.pytest_process()])
        timeout = datetime.timedelta(seconds=30)
        client = dist.TCPStore(str(found.address), found.port, None, False, timeout)
        for job in ("2", "3"):
            for rank in (0, 1):
                client.set(f"pytest_cuda/done/{job}/{rank}", pickle.dumps(Planted()))
    dist.barrier()


@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_2_finishes_where_the_pickle_is(cuda_rank):
    dist.barrier()


@pytest.mark.cuda_distributed(world_size=2, backend="gloo")
def test_3_on_new_ranks(cuda_rank):
    dist.barrier()
    assert not os.path.exists(MARKER)
"""


def test_warm_ranks_listen_on_loopback_only_and_load_no_pickle_from_the_store(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both planted suites in one session (a pytest process and its ranks each import
    torch): the pickle's first, whose job numbers it plants, then the socket tables'
    on the warm ranks its last test left."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth9")  # the user's own: kept
    plant_listening(pytester)
    pytester.makepyfile(test_1_pickle=PICKLE_SUITE, test_2_loopback=loopback_suite("gloo"))
    result = pytester.runpytest_subprocess("-rA", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=6, failed=1)
    result.stdout.fnmatch_lines(
        [
            "test_2_finishes_where_the_pickle_is: rank ? of 2 failed: UnexpectedStoreValue: "
            "the rendezvous store's key 'pytest_cuda/done/2/?' holds * bytes that no rank "
            "wrote (a rank writes b'1'): another process wrote to this session's store; "
            "the value was not read further",
        ]
    )
    assert not (pytester.path / "unpickled").exists()
    result.stdout.fnmatch_lines(
        [
            "*Captured stdout (rank 0) call*",
            "GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=eth9",
            "*Captured stdout call*",
            "pid * listens on 127.0.0.1:*",
        ]
    )
    assert [line for line in result.outlines if line.startswith("FAILED")] == [
        line for line in result.outlines if line.startswith("FAILED test_1_pickle.py::test_2_")
    ]


def test_done_keys_are_compared_as_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store, port = cuda.host_store(10)
    client = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
    monkeypatch.setattr(process_group, "_STORES", [client])
    marker = tmp_path / "unpickled"
    client.set("pytest_cuda/done/7/1", pickle.dumps(Planted(marker)))
    assert cuda.mark_rank_done(0, "7")
    with pytest.raises(cuda.UnexpectedStoreValue, match=r"key 'pytest_cuda/done/7/1' holds"):
        cuda.wait_for_ranks(2, "7", 10)
    with pytest.raises(cuda.UnexpectedStoreValue, match=r"key 'pytest_cuda/done/7/1' holds"):
        cuda.mark_rank_done(1, "7")
    assert not marker.exists()
    # Ranks that wrote their own keys finish together.
    assert cuda.mark_rank_done(0, "8")
    assert cuda.mark_rank_done(1, "8")
    cuda.wait_for_ranks(2, "8", 10)
    del client, store


def test_a_rank_loads_its_job_only_from_a_private_folder(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    folder = tmp_path / "job"
    folder.mkdir(mode=0o700)
    (folder / JOB_FILE).write_bytes(pickle.dumps(Planted(marker)))
    folder.chmod(0o770)
    with pytest.raises(PermissionError, match=r"job is not private to this user \(.*mode 0770"):
        read_job(folder)
    assert not marker.exists()
    folder.chmod(0o700)  # private: loaded (and not a JobRun)
    with pytest.raises(TypeError):
        read_job(folder)
    assert marker.exists()


def test_rank_environment_points_gloo_and_nccl_at_loopback() -> None:
    assert cuda.rank_environment({}) == {
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "=lo",
    }
    assert cuda.rank_environment({"NCCL_SOCKET_IFNAME": "ib0"}) == {"GLOO_SOCKET_IFNAME": "lo"}
    assert cuda.rank_environment({"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "ib"}) == {}


def test_a_child_work_directory_is_private() -> None:
    workdirs = Workdirs()
    try:
        path = workdirs.new("rerun")
        modes = {stat.S_IMODE(p.stat().st_mode) for p in (path, path.parent)}
        assert modes == {0o700}
    finally:
        workdirs.remove()
