"""Watching one job's ranks across hosts, in a launched run (``--cuda-ranks=env``).

Each host's pytest process runs its own rank of a job in a warm rank process, as one
host's pool does (:mod:`pytest_cuda.distributed.pool`), and watches it through its
files (:class:`~pytest_cuda.distributed.launch.LocalRank`). What crosses hosts goes
through the launcher's store as text (:class:`gpumagic.cuda.RunStore`), under the job's
key:

* ``started/<job>/<rank>``: the rank started its test (a host's pytest process writes it);
* ``outcome/<job>/<rank>``: how it ended (:meth:`RankOutcome.to_dict`, JSON);
* ``stop/<job>``: rank 0's decision to stop the ranks still running (``timeout``,
  ``startup`` or ``failure``): each host then has its rank write its stack, stops it
  and sends its outcome.

Rank 0's pytest process judges (:func:`judge`): it watches every rank, its own through
its files and the others through the store (:class:`RemoteRank`), with the limits one
host's watch has (the start-up limit, the test's timeout counted from when every rank
started, a failure's grace). The other hosts' processes follow (:func:`follow`). A host
that does not answer a stop within :data:`ANSWER_S` is reported lost, and the run ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from typing import TYPE_CHECKING, Any, cast

from gpumagic import cuda
from pytest_cuda.distributed.launch import (
    GOOD_ENDS,
    STACK_WAIT_S,
    LocalRank,
    Watch,
    startup_limit,
    stop_and_read,
    watch_ranks,
)
from pytest_cuda.distributed.ranks import RankOutcome

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_cuda.distributed.forkserver import RankProcess
    from pytest_cuda.distributed.job import RankJob
    from pytest_cuda.distributed.launch import TimedOut
    from pytest_cuda.distributed.world import LaunchedWorld

__all__ = ["ANSWER_S", "Judged", "RemoteRank", "follow", "judge"]

#: How long a host may take to answer rank 0's stop with its rank's outcome (its stack
#: dump included), and how much later than rank 0 a host's own limits run out.
ANSWER_S = 20.0
_POLL_S = 0.01


class RemoteRank:
    """A rank on another host, as rank 0 sees it: through the store."""

    def __init__(self, store: cuda.RunStore, job_key: str, rank: int) -> None:
        self.rank = rank
        self._store = store
        self._job = job_key
        self._started = False
        self.outcome: dict[str, Any] | None = None

    def ended(self) -> bool:
        if self.outcome is None and self._store.has(f"outcome/{self._job}/{self.rank}"):
            self.outcome = json.loads(self._store.get(f"outcome/{self._job}/{self.rank}"))
        return self.outcome is not None

    def ended_well(self) -> bool:
        return self.outcome is not None and self.outcome.get("state") in GOOD_ENDS

    def started(self) -> bool:
        if not self._started:
            self._started = self._store.has(f"started/{self._job}/{self.rank}")
        return self._started


@dataclasses.dataclass
class Judged:
    """Every rank's outcome, the limit that ran out, and the ranks whose hosts did not
    answer (the run ends after this test)."""

    outcomes: list[RankOutcome]
    timed_out: TimedOut
    lost: list[int]


def _placed(outcome: RankOutcome, world: LaunchedWorld) -> RankOutcome:
    outcome.host, outcome.node = world.host, world.node
    return outcome


def judge(
    store: cuda.RunStore,
    proc: RankProcess,
    folder: Path,
    job: RankJob,
    *,
    job_key: str,
    world: LaunchedWorld,
) -> Judged:
    """Rank 0's watch of a job of ``job.spec.world_size`` ranks: its own in ``proc``,
    the others on their hosts."""
    local = LocalRank(folder, world.rank, proc)
    remote = [RemoteRank(store, job_key, rank) for rank in range(1, job.spec.world_size)]
    watch = Watch()
    timed_out: TimedOut = None
    lost_store = False
    try:
        timed_out = watch_ranks([local, *remote], job.spec, watch, startup_limit(job.spec))
        if len(watch.ended) < job.spec.world_size:
            store.set(f"stop/{job_key}", timed_out or "failure")
    except cuda.StoreGone:
        lost_store = True
    outcomes = [_placed(o, world) for o in stop_and_read([local], folder, job, watch)]
    lost: list[int] = []
    deadline = time.monotonic() + STACK_WAIT_S + ANSWER_S
    for view in remote:
        found = None if lost_store else _answer(view, deadline)
        if found is None:
            lost.append(view.rank)
            outcomes.append(_lost(view.rank, store, job))
        else:
            outcomes.append(RankOutcome.from_dict(found))
    return Judged(outcomes, timed_out, lost)


def _answer(view: RemoteRank, deadline: float) -> dict[str, Any] | None:
    """The rank's outcome, waited for until ``deadline``; ``None`` if none came."""
    try:
        while not view.ended():
            if time.monotonic() >= deadline:
                return None
            time.sleep(_POLL_S)
    except cuda.StoreGone:
        return None
    return view.outcome


def _lost(rank: int, store: cuda.RunStore, job: RankJob) -> RankOutcome:
    """A rank whose host did not answer: its pytest process is gone or stuck."""
    host, node = "", None
    with contextlib.suppress(cuda.StoreGone):
        if store.has(f"host/{rank}"):
            found = json.loads(store.get(f"host/{rank}"))
            host, node = str(found["host"]), int(found["node"])
    return RankOutcome(
        rank,
        "cuda" if job.spec.uses_cuda else "cpu",
        "exited",
        message="its host's pytest process did not answer (gone, or stuck)",
        host=host or "an unknown host",
        node=node,
    )


def follow(
    store: cuda.RunStore,
    proc: RankProcess,
    folder: Path,
    job: RankJob,
    *,
    job_key: str,
    world: LaunchedWorld,
) -> tuple[list[RankOutcome], TimedOut]:
    """Another host's watch of its rank: say when it started, stop it when rank 0 says
    so, send its outcome. Its own limits are :data:`ANSWER_S` longer than rank 0's:
    they end the wait only where rank 0 is gone."""
    local = LocalRank(folder, world.rank, proc)
    said_started = False

    def tick() -> TimedOut:
        nonlocal said_started
        if not said_started and local.started():
            store.set(f"started/{job_key}/{world.rank}", "1")
            said_started = True
        if store.has(f"stop/{job_key}"):
            return cast("TimedOut", store.get(f"stop/{job_key}"))
        return None

    spec = dataclasses.replace(job.spec, timeout=job.spec.timeout + ANSWER_S)
    watch = Watch()
    try:
        timed_out = watch_ranks([local], spec, watch, startup_limit(job.spec) + ANSWER_S, tick=tick)
    except cuda.StoreGone:
        timed_out = "failure"
    outcomes = [_placed(o, world) for o in stop_and_read([local], folder, job, watch)]
    # Where rank 0 is gone, the run ends: the next order never comes.
    with contextlib.suppress(cuda.StoreGone):
        store.set(f"outcome/{job_key}/{world.rank}", json.dumps(outcomes[0].to_dict()))
    return outcomes, timed_out
