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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumagic import cuda
from pytest_cuda.distributed.forkserver import ForkServers, rank_env, start_rank
from pytest_cuda.distributed.job import StorePlace
from pytest_cuda.distributed.launch import (
    group_timeout,
    kill_all,
    startup_limit,
    watch_job,
    write_job,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from pytest_cuda.distributed.forkserver import RankProcess
    from pytest_cuda.distributed.job import RankJob
    from pytest_cuda.distributed.launch import TimedOut
    from pytest_cuda.distributed.ranks import DistributedSpec, RankOutcome

__all__ = ["GROUP_TIMEOUT_S", "Plan", "PoolKey", "Ran", "RankPool", "RankPools"]

#: A warm group's collectives time out after this, or the test's timeout + 60 s if
#: that is longer: the launcher's own timeout (with every rank's stack) comes first.
GROUP_TIMEOUT_S = 600.0

PoolKey = tuple[int, str, tuple[int, ...]]
#: Every rank's outcome, and which time limit ran out, if one did.
Ran = tuple[list["RankOutcome"], "TimedOut"]


@dataclass(frozen=True)
class Plan:
    """What a pool does before a test: start new processes, join a new group."""

    #: Start new rank processes (the old ones, if any, stopped first).
    restart: bool
    #: The process group's generation for the test, and its timeout.
    generation: int
    group_timeout: float
    #: Join that group first (a warm-up job), in the test's set-up.
    join: bool


class RankPool:
    """The warm ranks of one (world size, backend, devices).

    The ranks start, and join the test's process group, in the test's set-up
    (:meth:`prepare`, a warm-up job that runs no test): its call (:meth:`run`) is its
    body's alone, and its timeout counts from when every rank started the body.
    """

    def __init__(self, key: PoolKey, folder: Path, servers: ForkServers | None = None) -> None:
        self.key = key
        self.folder = folder
        #: Where its processes are forked from (``None``: each started afresh).
        self.servers = servers
        self.procs: list[RankProcess] = []
        self.generation = 0
        self.group_alive = False
        self.group_timeout = 0.0
        #: The jobs sent to its ranks (tests and warm-ups), and the tests among them.
        self.jobs = 0
        self.tests = 0
        #: How many times its processes were started.
        self.starts = 0
        self._store: Any = None
        self._port = 0
        #: The spec the ranks were prepared for by :meth:`prepare` (``None``: not yet).
        self._prepared: DistributedSpec | None = None

    def plan(self, job: RankJob) -> Plan:
        """What :meth:`prepare` does for ``job``: new processes where there are none, a
        new group where the ranks have none, the test asks for a fresh one, or its
        timeout outlasts the group's."""
        restart = not self._alive()
        alive = self.group_alive and not restart
        needed = group_timeout(job.spec)
        join = not alive or job.spec.fresh_group or needed > self.group_timeout
        if not join:
            return Plan(restart, self.generation, self.group_timeout, join=False)
        return Plan(restart, self.generation + 1, max(needed, GROUP_TIMEOUT_S), join=True)

    def prepare(self, job: RankJob, cwd: Path, plan: Plan | None = None) -> Ran | None:
        """Start the ranks and have them join the test's group, as ``plan`` says
        (default: :meth:`plan`). ``None`` when they are ready; else the warm-up's
        outcomes (its ranks then stopped, for the next test to start new ones)."""
        plan = plan or self.plan(job)
        if plan.restart or not self._alive():
            self._start(job, cwd)
        self.generation, self.group_timeout = plan.generation, plan.group_timeout
        self._prepared = job.spec
        if not plan.join:
            return None
        self.group_alive = False
        outcomes, timed_out = self._job(job, cwd, warmup=True)
        if timed_out is None and all(o.reusable for o in outcomes):
            self.group_alive = True
            return None
        self.close()
        return outcomes, timed_out

    def run(self, job: RankJob, cwd: Path) -> Ran:
        """Run one test on the warm ranks (prepared first, if :meth:`prepare` was not
        called for it)."""
        if self._prepared != job.spec:
            failed = self.prepare(job, cwd)
            if failed is not None:
                return failed
        self._prepared = None
        outcomes, timed_out = self._job(job, cwd, warmup=False)
        clean = timed_out is None and all(o.reusable for o in outcomes)
        if clean and not job.spec.isolate:
            self.group_alive = not job.spec.fresh_group
        else:
            self.close()
        return outcomes, timed_out

    def _job(self, job: RankJob, cwd: Path, *, warmup: bool) -> Ran:
        """Send one job (a test, or a warm-up) to the ranks and watch it to its end."""
        self.jobs += 1
        self.tests += not warmup
        folder = self.folder / f"job{self.jobs}"
        folder.mkdir(mode=0o700)
        try:
            write_job(
                job,
                folder,
                port=self._port,
                cwd=cwd,
                job_id=self.job_id(warmup=warmup),
                generation=self.generation,
                group_timeout_s=self.group_timeout,
                warm=True,
                place=self.place(),
                warmup=warmup,
            )
            for proc in self.procs:
                assert proc.stdin is not None  # started with a pipe
                with contextlib.suppress(BrokenPipeError):  # it died: the watch says so
                    proc.stdin.write(f"{folder}\n".encode())
                    proc.stdin.flush()
            return self.watch(folder, job)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    # What a launched run's pool (several hosts) does its own way.

    def ranks(self) -> range | tuple[int, ...]:
        """The ranks this host runs: every rank of the pool."""
        return range(self.key[0])

    def job_id(self, *, warmup: bool) -> str:
        """The job's name among its ranks' jobs: the test's number, or a warm-up's."""
        return f"warmup{self.jobs}" if warmup else str(self.tests)

    def place(self) -> StorePlace:
        """Where the ranks' store is: this process's."""
        return StorePlace()

    def on_loopback(self) -> bool:
        """Whether every rank is on this host: their backends' sockets on loopback."""
        return True

    def open_store(self, job: RankJob) -> int:
        """Serve the ranks' store from this process, on the loopback address; its port."""
        self._store, port = cuda.host_store(startup_limit(job.spec))
        return int(port)

    def watch(self, folder: Path, job: RankJob) -> Ran:
        """Watch this host's ranks run the job in ``folder``."""
        return watch_job(self.procs, folder, job, ranks=list(self.ranks()))

    def _alive(self) -> bool:
        return bool(self.procs) and all(proc.poll() is None for proc in self.procs)

    def _start(self, job: RankJob, cwd: Path) -> None:
        self.close()
        self._port = self.open_store(job)
        self.starts += 1
        env = rank_env(loopback=self.on_loopback())
        if self.servers is not None:
            self.servers.prepare(self.ranks(), cwd, env)
        for rank in self.ranks():
            idle = [self.folder / f"rank{rank}.idle.{kind}" for kind in ("out", "err")]
            with idle[0].open("ab") as out, idle[1].open("ab") as err:
                args = ["--serve", str(self.folder), str(rank)]
                self.procs.append(
                    start_rank(
                        args,
                        out,
                        err,
                        cwd,
                        rank=rank,
                        env=env,
                        stdin=True,
                        servers=self.servers,
                        limit_s=startup_limit(job.spec),
                    )
                )

    def close(self) -> None:
        """Stop its processes (the next test starts new ones)."""
        for proc in self.procs:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        kill_all(self.procs)
        self.procs = []
        self.group_alive = False
        self._prepared = None
        self._store = None


class RankPools:
    """One session's warm pools, by (world size, backend, devices), and the fork
    servers their ranks and fresh ones are forked from; ``make`` builds a pool
    (default: :class:`RankPool`)."""

    def __init__(self, make: Callable[[PoolKey, Path, ForkServers], RankPool] = RankPool) -> None:
        self.pools: dict[PoolKey, RankPool] = {}
        self.servers = ForkServers()
        self._folder: Path | None = None
        self._make = make

    def pool(self, job: RankJob) -> RankPool:
        key: PoolKey = (job.spec.world_size, job.spec.backend, job.devices)
        found = self.pools.get(key)
        if found is None:
            if self._folder is None:
                self._folder = Path(tempfile.mkdtemp(prefix="pytest-cuda-ranks-"))
            folder = self._folder / f"pool{len(self.pools)}"
            folder.mkdir(mode=0o700)
            found = self.pools[key] = self._make(key, folder, self.servers)
        return found

    def close(self) -> None:
        """Stop every pool's processes, then the fork servers, and remove their files."""
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
        self.servers.close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
