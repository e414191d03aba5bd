"""A launched run (``pytest --cuda-ranks=env``): the pytest processes of every rank, and
what they tell each other through the launcher's store.

Every process that torchrun, ``srun`` or ``mpirun`` started runs pytest on the same
tests (:meth:`LaunchedRun.check_collection` compares them). Rank 0 runs the session as
one pytest process does; the others follow its orders (``order/<rank>/<k>``: run the
test at this index, with this plan for its warm ranks; or end, with the exit status).
Each host keeps one warm rank process per pool (:class:`LaunchedPool`, its launcher's
rank, on its local rank's device), in process groups formed through the launcher's
store; rank 0 judges each job (:func:`~pytest_cuda.distributed.world_watch.judge`), the
others follow it (:func:`~pytest_cuda.distributed.world_watch.follow`). Every key is
under ``pytest_cuda/run<attempt>/``: a run the launcher restarted uses fresh keys.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import TYPE_CHECKING

from gpumagic import cuda
from pytest_cuda.distributed.job import StorePlace
from pytest_cuda.distributed.launch import STARTUP_S, group_timeout
from pytest_cuda.distributed.pool import GROUP_TIMEOUT_S, Plan, RankPool
from pytest_cuda.distributed.world_watch import follow, judge

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    import pytest

    from pytest_cuda.distributed.forkserver import ForkServers
    from pytest_cuda.distributed.job import RankJob
    from pytest_cuda.distributed.pool import PoolKey, Ran
    from pytest_cuda.distributed.world import LaunchedWorld

__all__ = ["COLLECT_S", "LaunchedPool", "LaunchedRun", "Order", "prepare_launched"]

#: How long rank 0 waits for every rank's collection, and a rank for rank 0's verdict.
COLLECT_S = 600.0
#: How long rank 0 waits, at its end, for the other ranks to read the end.
BYE_S = 30.0
#: How many differing test ids a collection error names.
SHOWN_IDS = 10
#: Another rank looks for rank 0's next order this often: soon after the last one, then
#: less and less often while rank 0 runs other tests.
_FIRST_PAUSE_S = 0.002
_LAST_PAUSE_S = 0.2


@dataclasses.dataclass(frozen=True)
class Order:
    """Rank 0's order to another rank: run the test at ``index`` (job ``number``, with
    ``plan`` for its warm ranks), or end the run (``index`` -1, ``exitstatus``)."""

    index: int
    nodeid: str = ""
    number: int = 0
    plan: Plan | None = None
    exitstatus: int = 0

    def to_text(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_text(cls, text: str) -> Order:
        data = json.loads(text)
        plan = Plan(**data["plan"]) if data.get("plan") else None
        return cls(data["index"], data["nodeid"], data["number"], plan, data["exitstatus"])


class LaunchedRun:
    """This pytest process's part of a launched run, and its link to the others."""

    def __init__(self, world: LaunchedWorld, store: cuda.RunStore) -> None:
        self.world = world
        self.store = store
        #: Rank 0: the orders sent to each rank so far, and the jobs numbered so far.
        self._sent: dict[int, int] = {}
        self._jobs = 0
        #: Another rank: the orders read so far, and how rank 0 said the run ended.
        self._read = 0
        self.exitstatus: int | None = None
        #: Rank 0: the ranks whose hosts stopped answering (the run ends).
        self.lost: list[int] = []

    @classmethod
    def open(cls, world: LaunchedWorld) -> LaunchedRun:
        """Reach the launcher's store (rank 0 serves it where no agent does) and say
        which host this rank is on."""
        store = cuda.open_run_store(
            world.master_addr,
            world.master_port,
            serve=world.serves_store,
            world_size=world.world_size,
            timeout_s=STARTUP_S,
            prefix=f"pytest_cuda/run{world.attempt}/",
        )
        store.set(f"host/{world.rank}", json.dumps({"host": world.host, "node": world.node}))
        return cls(world, store)

    @property
    def first(self) -> bool:
        return self.world.rank == 0

    def describe(self, rank: int) -> str:
        """``rank 1 on host-b (node 1)``."""
        found = json.loads(self.store.get(f"host/{rank}"))
        return f"rank {rank} on {found['host']} (node {found['node']})"

    # Collection.

    def check_collection(self, ids: Sequence[str]) -> str | None:
        """Compare this rank's collected test ids with every rank's (rank 0 compares and
        says; the others wait for its word): ``None`` when they are the same, else the
        error, naming the differing ids."""
        self.store.set(f"ids/{self.world.rank}", json.dumps(list(ids)))
        if not self.first:
            if not self.store.wait(["collected"], COLLECT_S):
                return f"rank 0 did not compare the collections within {COLLECT_S:g} s"
            return self.store.get("collected") or None
        others = [f"ids/{rank}" for rank in range(1, self.world.world_size)]
        if not self.store.wait(others, COLLECT_S):
            missing = [key for key in others if not self.store.has(key)]
            error: str | None = f"{', '.join(missing)}: no collection within {COLLECT_S:g} s"
        else:
            error = self._differences(list(ids))
        self.store.set("collected", error or "")
        return error

    def _differences(self, ids: list[str]) -> str | None:
        for rank in range(1, self.world.world_size):
            theirs = json.loads(self.store.get(f"ids/{rank}"))
            if theirs == ids:
                continue
            only_0 = [i for i in ids if i not in set(theirs)]
            only_r = [i for i in theirs if i not in set(ids)]
            shown = [f"  only on rank 0: {i}" for i in only_0[:SHOWN_IDS]]
            shown += [f"  only on rank {rank}: {i}" for i in only_r[:SHOWN_IDS]]
            if not shown:
                shown = ["  the same tests, in another order"]
            return (
                f"--cuda-ranks=env: {self.describe(rank)} collected other tests than "
                f"{self.describe(0)}; every rank of a launched run must collect the same "
                "tests (the same files, options and environment):\n" + "\n".join(shown)
            )
        return None

    # Orders.

    def next_job(self) -> int:
        self._jobs += 1
        return self._jobs

    def send(self, rank: int, order: Order) -> None:
        """Rank 0: send ``order`` to ``rank``."""
        count = self._sent.get(rank, 0)
        self.store.set(f"order/{rank}/{count}", order.to_text())
        self._sent[rank] = count + 1

    def receive(self) -> Order | None:
        """Another rank: rank 0's next order, waited for as long as rank 0 runs
        (``None``: the run ended)."""
        key = f"order/{self.world.rank}/{self._read}"
        pause = _FIRST_PAUSE_S
        # Looked for, not waited for: a store's wait that times out has torch print two
        # warnings, every time, while rank 0 runs its ordinary tests.
        while not self.store.has(key):
            if self.store.has("end"):
                self.exitstatus = int(self.store.get("end"))
                return None
            time.sleep(pause)
            pause = min(pause * 2, _LAST_PAUSE_S)
        self._read += 1
        order = Order.from_text(self.store.get(key))
        if order.index < 0:
            self.exitstatus = order.exitstatus
            return None
        return order

    def end(self, exitstatus: int) -> None:
        """Rank 0: end every other rank's run with this exit status, and wait (a
        while) until each read it: a store rank 0 serves ends with its process."""
        self.store.set("end", str(int(exitstatus)))
        for rank in range(1, self.world.world_size):
            self.send(rank, Order(-1, exitstatus=int(exitstatus)))
        byes = [f"bye/{rank}" for rank in range(1, self.world.world_size)]
        self.store.wait(byes, BYE_S)

    def bye(self) -> None:
        """Another rank: rank 0 may end now."""
        self.store.set(f"bye/{self.world.rank}", "1")


class LaunchedPool(RankPool):
    """One host's warm rank of a pool of a launched run: the launcher's rank, on the
    store every host shares, its jobs numbered by rank 0's orders."""

    def __init__(
        self, key: PoolKey, folder: Path, run: LaunchedRun, servers: ForkServers | None = None
    ) -> None:
        super().__init__(key, folder, servers)
        self.launched = run
        #: The number of the job rank 0 ordered (set before each test).
        self.number = 0
        self._warmup = False

    def plan(self, job: RankJob) -> Plan:
        """As one host's pool plans, but ``isolate=True`` gets new processes (on every
        host) and a group of its own: a launched run cannot start fresh ranks apart."""
        if not job.spec.isolate:
            return super().plan(job)
        timeout = max(group_timeout(job.spec), GROUP_TIMEOUT_S)
        return Plan(restart=True, generation=self.generation + 1, group_timeout=timeout, join=True)

    def ranks(self) -> tuple[int, ...]:
        return (self.launched.world.rank,)

    def job_id(self, *, warmup: bool) -> str:
        return f"{self.launched.store.prefix}{self.number}/{'warmup' if warmup else 'test'}"

    def place(self) -> StorePlace:
        world = self.launched.world
        return StorePlace(
            host=self.launched.store.host,
            group_prefix=f"{self.launched.store.prefix}pool-{self.key[0]}-{self.key[1]}/",
            local_rank=world.local_rank,
        )

    def on_loopback(self) -> bool:
        """A rehearsal on one machine (the store on a loopback address) keeps the
        backends' sockets on loopback; ranks on several hosts use the interfaces their
        environment names."""
        return self.launched.world.on_loopback

    def open_store(self, job: RankJob) -> int:
        return self.launched.store.port

    def watch(self, folder: Path, job: RankJob) -> Ran:
        run, key = self.launched, self.job_id(warmup=self._warmup)
        if run.first:
            judged = judge(run.store, self.procs[0], folder, job, job_key=key, world=run.world)
            run.lost += judged.lost
            return judged.outcomes, judged.timed_out
        return follow(run.store, self.procs[0], folder, job, job_key=key, world=run.world)

    def _job(self, job: RankJob, cwd: Path, *, warmup: bool) -> Ran:
        self._warmup = warmup
        return super()._job(job, cwd, warmup=warmup)


def prepare_launched(
    item: pytest.Item, pool: LaunchedPool, job: RankJob, cwd: Path, order: Order | None
) -> Ran | None:
    """The set-up of a ``cuda_distributed`` test in a launched run: rank 0 plans its
    ranks' start and group and orders the others to run the test too; another rank
    follows ``order``. Then the warm-up, as on one host."""
    run = pool.launched
    if run.first:
        plan = pool.plan(job)
        pool.number = run.next_job()
        index = _index(item)
        for rank in range(1, job.spec.world_size):
            run.send(rank, Order(index, item.nodeid, pool.number, plan))
        return pool.prepare(job, cwd, plan)
    assert order is not None  # another rank runs a test only when ordered to
    pool.number = order.number
    return pool.prepare(job, cwd, order.plan)


def _index(item: pytest.Item) -> int:
    return item.session.items.index(item)
