"""The job of a ``cuda_distributed`` test's ranks, as every rank reads it.

:class:`RankJob` is what the test is (its module, its pickled call, its marker, its
devices, its leak check and memory limit); :class:`JobRun` is one run of it by a set of
rank processes (the store's port, the process group's generation and timeout, warm or fresh ranks).
The launcher (:mod:`pytest_cuda.distributed.launch`) writes a :class:`JobRun` to the
job's folder, a private temporary directory; each rank
(:mod:`pytest_cuda.distributed.rank_main`) reads it back with :func:`read_job`. The
file is a pickle: the test's call is one already, and nothing but this package's own
processes reads it. A pickle runs code when loaded, so it travels only through a file
in a folder of this user's that no one else may write to (mode 0700), which
:func:`read_job` checks before loading; nothing the processes exchange through the
rendezvous store or a socket is a pickle (issue 43). Importing this module imports
nothing but the standard library.
"""

from __future__ import annotations

import os
import pickle
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_cuda.distributed.ranks import DistributedSpec
    from pytest_cuda.leaks.engine import LeakSettings

__all__ = ["JOB_FILE", "JobRun", "RankJob", "StorePlace", "read_job"]

#: The job's file in its folder.
JOB_FILE = "job.pickle"


@dataclass(frozen=True)
class RankJob:
    """What every rank needs to know of the test: its module and pickled call, the
    group to form, the devices, and the leak check."""

    #: The test's name (``test_x[param]``), for the leak check's messages.
    name: str
    #: The test module's name, as pytest imported it, and its file.
    module: str
    module_file: str
    #: ``pickle.dumps((function, kwargs))``: the test function and its fixture values.
    call: bytes
    #: Whether the function takes ``cuda_rank``.
    wants_rank: bool
    spec: DistributedSpec
    #: One device index per rank (empty for a backend on the CPU).
    devices: tuple[int, ...]
    #: How the pytest process checks the test for leaks, for each rank to check itself
    #: the same way (``None``: the leak check does not apply to it).
    leak: LeakSettings | None
    #: The test's CUDA memory limit, ``(bytes, where it comes from)``: each rank's peak
    #: on its own device is held to it (``None``: no limit).
    limit: tuple[int, str] | None = None


@dataclass(frozen=True)
class StorePlace:
    """Where a job's ranks find their store and their keys in it: the pytest process's
    store on the loopback address, or a launched run's (``--cuda-ranks=env``)."""

    host: str = "127.0.0.1"
    #: The prefix of the process group's keys (each generation under its own).
    group_prefix: str = "pytest_cuda/"
    #: The launcher's local rank of a launched run's rank (``LOCAL_RANK``), else
    #: ``None``: the rank's number.
    local_rank: int | None = None


@dataclass(frozen=True)
class JobRun:
    """One run of a :class:`RankJob` by a set of rank processes."""

    job: RankJob
    #: The rendezvous store's port on localhost.
    port: int
    #: The pytest process's ``sys.path`` and working directory, for the test's imports.
    sys_path: tuple[str, ...]
    cwd: str
    #: The job's number among its ranks' jobs (the store's keys for finishing together).
    job_id: str
    #: The process group's generation: a rank in another one joins a new group.
    generation: int
    #: Seconds the process group's collectives may take before they time out.
    group_timeout: float
    #: Seconds the ranks may take to set up (Python, torch, the rendezvous).
    startup: float
    #: Warm ranks, kept for the next test (else fresh ones for this test alone).
    warm: bool
    place: StorePlace = StorePlace()
    #: Join the process group only, and run no test: the warm-up of a test's set-up,
    #: so that the ranks' start-up is not charged to its call (issue 40).
    warmup: bool = False

    def write(self, folder: Path) -> None:
        """Write this run to ``folder``'s :data:`JOB_FILE`."""
        (folder / JOB_FILE).write_bytes(pickle.dumps(self))


def read_job(folder: Path) -> JobRun:
    """The :class:`JobRun` in ``folder``; :class:`PermissionError` if the folder is not
    private to this user (checked before the pickle is loaded), :class:`TypeError` if
    the file holds another object (a launcher of another version)."""
    _check_private(folder)
    found = pickle.loads((folder / JOB_FILE).read_bytes())
    if not isinstance(found, JobRun):
        raise TypeError(
            f"{folder / JOB_FILE} holds a {type(found).__qualname__}, not a JobRun: "
            "the rank and its launcher come from different versions of pytest_cuda"
        )
    return found


def _check_private(folder: Path) -> None:
    """Refuse a folder that another user owns or may write to: whoever can write the
    job file there chooses the code that loading it runs."""
    info = folder.stat()
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != os.getuid() or mode & 0o077:
        raise PermissionError(
            f"{folder} is not private to this user (owner uid {info.st_uid}, mode "
            f"{mode:04o}; this rank runs as uid {os.getuid()}): a rank loads its job, a "
            "pickle, only from a folder of its own user's with mode 0700"
        )
