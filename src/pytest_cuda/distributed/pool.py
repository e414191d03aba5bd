"""Warm rank processes: started once per (world size, backend, devices), reused by
every ``cuda_distributed`` test that fits, replaced after a test that went wrong.

A :class:`RankPool` keeps ``world_size`` rank processes
(``python -m pytest_cuda.distributed.rank_main --serve``) and the rendezvous store they joined. It
sends each test's job to them (the job folder's path, one line on each rank's stdin)
and watches them with :func:`~pytest_cuda.distributed.launch.watch_job`, as fresh ranks are
watched. The process group is kept from test to test, and numbered: a new number (a
new group, under a new prefix of the store) after a test with ``fresh_group=True``,
for a test whose timeout outlasts the group's, and with new processes. After a test
that failed, timed out, or whose ranks left state or leaked memory behind, the pool kills its
processes; the next test starts new ones. :class:`RankPools` holds one session's
pools (each pytest-xdist worker has its own) and closes them at the session's end.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumagic import cuda
from pytest_cuda.distributed.launch import (
    group_timeout,
    kill_all,
    start_rank,
    startup_limit,
    watch_job,
    write_job,
)

if TYPE_CHECKING:
    import subprocess

    from pytest_cuda.distributed.job import RankJob
    from pytest_cuda.distributed.launch import TimedOut
    from pytest_cuda.distributed.ranks import RankOutcome

__all__ = ["GROUP_TIMEOUT_S", "PoolKey", "RankPool", "RankPools"]

#: A warm group's collectives time out after this, or the test's timeout + 60 s if
#: that is longer: the launcher's own timeout (with every rank's stack) comes first.
GROUP_TIMEOUT_S = 600.0

PoolKey = tuple[int, str, tuple[int, ...]]


class RankPool:
    """The warm ranks of one (world size, backend, devices)."""

    def __init__(self, key: PoolKey, folder: Path) -> None:
        self.key = key
        self.folder = folder
        self.procs: list[subprocess.Popen[bytes]] = []
        self.generation = 0
        self.group_alive = False
        self.group_timeout = 0.0
        self.jobs = 0
        #: How many times its processes were started.
        self.starts = 0
        self._store: Any = None
        self._port = 0

    def run(self, job: RankJob, cwd: Path) -> tuple[list[RankOutcome], TimedOut]:
        """Run one test on the warm ranks (started first if there are none)."""
        if not self._alive():
            self._start(job, cwd)
        needed = group_timeout(job.spec)
        if not self.group_alive or job.spec.fresh_group or needed > self.group_timeout:
            self.generation += 1
            self.group_timeout = max(needed, GROUP_TIMEOUT_S)
        self.jobs += 1
        folder = self.folder / f"job{self.jobs}"
        folder.mkdir(mode=0o700)
        try:
            write_job(
                job,
                folder,
                port=self._port,
                cwd=cwd,
                job_id=str(self.jobs),
                generation=self.generation,
                group_timeout_s=self.group_timeout,
                warm=True,
            )
            for proc in self.procs:
                assert proc.stdin is not None  # started with a pipe
                with contextlib.suppress(BrokenPipeError):  # it died: the watch says so
                    proc.stdin.write(f"{folder}\n".encode())
                    proc.stdin.flush()
            outcomes, timed_out = watch_job(self.procs, folder, job)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        clean = timed_out is None and all(o.reusable for o in outcomes)
        if clean:
            self.group_alive = not job.spec.fresh_group
        else:
            self.close()
        return outcomes, timed_out

    def _alive(self) -> bool:
        return bool(self.procs) and all(proc.poll() is None for proc in self.procs)

    def _start(self, job: RankJob, cwd: Path) -> None:
        self.close()
        self._store, self._port = cuda.host_store(startup_limit(job.spec))
        self.starts += 1
        for rank in range(self.key[0]):
            idle = [self.folder / f"rank{rank}.idle.{kind}" for kind in ("out", "err")]
            with idle[0].open("ab") as out, idle[1].open("ab") as err:
                args = ["--serve", str(self.folder), str(rank)]
                self.procs.append(start_rank(args, out, err, cwd, stdin=True))

    def close(self) -> None:
        """Stop its processes (the next test starts new ones)."""
        for proc in self.procs:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        kill_all(self.procs)
        self.procs = []
        self.group_alive = False
        self._store = None


class RankPools:
    """One session's warm pools, by (world size, backend, devices)."""

    def __init__(self) -> None:
        self.pools: dict[PoolKey, RankPool] = {}
        self._folder: Path | None = None

    def pool(self, job: RankJob) -> RankPool:
        key: PoolKey = (job.spec.world_size, job.spec.backend, job.devices)
        found = self.pools.get(key)
        if found is None:
            if self._folder is None:
                self._folder = Path(tempfile.mkdtemp(prefix="pytest-cuda-ranks-"))
            folder = self._folder / f"pool{len(self.pools)}"
            folder.mkdir(mode=0o700)
            found = self.pools[key] = RankPool(key, folder)
        return found

    def close(self) -> None:
        """Stop every pool's processes and remove their files."""
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
