"""Start the ranks of a ``cuda_distributed`` test, watch them, stop them, read them back.

Each rank is an interpreter (:mod:`pytest_cuda.distributed.rank_main`) in a session of its own,
with its output in files of the job's folder: fresh for one test (:func:`run_ranks`,
``isolate=True``), or warm ones that a :class:`~pytest_cuda.distributed.pool.RankPool` keeps
(:func:`watch_job` serves both). Each is forked from a fork server that imported torch
already (:mod:`pytest_cuda.distributed.forkserver`), or started afresh where none can
serve. The pytest process hosts the rendezvous store. A rank
that fails gives the others a short grace to finish (a collective whose peer died may
never return); a test that outlives its timeout has every rank still running dump its
Python stack (``SIGUSR1``, faulthandler) before it is killed. Whatever happens, fresh
ranks' process groups are killed before :func:`run_ranks` returns, so no process
outlives its test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from gpumagic import cuda
from pytest_cuda.distributed.forkserver import rank_env, start_rank
from pytest_cuda.distributed.job import JobRun, StorePlace
from pytest_cuda.distributed.rank_main import (
    body_path,
    err_path,
    out_path,
    result_path,
    stack_path,
    started_path,
)
from pytest_cuda.distributed.ranks import FAILURE_GRACE_S, RankOutcome

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

    from pytest_cuda.distributed.forkserver import ForkServers, RankProcess
    from pytest_cuda.distributed.job import RankJob
    from pytest_cuda.distributed.ranks import DistributedSpec

__all__ = [
    "GOOD_ENDS",
    "STACK_WAIT_S",
    "STARTUP_S",
    "LocalRank",
    "RankView",
    "TimedOut",
    "Watch",
    "group_timeout",
    "kill_all",
    "run_ranks",
    "startup_limit",
    "stop_and_read",
    "watch_job",
    "watch_ranks",
    "write_job",
]

#: How long the ranks may take to start (Python, torch, CUDA, the process group's
#: rendezvous) before the test's own timeout starts counting: at least this.
STARTUP_S = 120.0
#: How long a stopped rank may take to write its stack.
STACK_WAIT_S = 3.0
_POLL_S = 0.01
#: The states of a rank that ended well.
GOOD_ENDS = ("passed", "skipped", "xfailed")

#: Which limit ended a watch: the test's timeout, the start-up limit, a failure
#: elsewhere ("failure": another host's rank failed, its grace ran out), or none.
TimedOut = Literal["timeout", "startup", "failure"] | None


def startup_limit(spec: DistributedSpec) -> float:
    """Seconds the ranks may take to start their test: :data:`STARTUP_S`, or the
    test's timeout if that is longer."""
    return max(STARTUP_S, spec.timeout)


def group_timeout(spec: DistributedSpec) -> float:
    """The process group's own timeout for its collectives: past the test's, so the
    launcher's timeout (with every rank's stack) always comes first."""
    return spec.timeout + 60


def write_job(
    job: RankJob,
    folder: Path,
    *,
    port: int,
    cwd: Path,
    job_id: str,
    generation: int,
    group_timeout_s: float,
    warm: bool,
    place: StorePlace | None = None,
    warmup: bool = False,
) -> None:
    """The job's file in ``folder``, which every rank reads: ``job``, run with this
    process's ``sys.path``; ``place``: where the store is (default: this process's, on
    the loopback address); ``warmup``: join the group only, run no test."""
    JobRun(
        job,
        port=port,
        sys_path=tuple(sys.path),
        cwd=str(cwd),
        job_id=job_id,
        generation=generation,
        group_timeout=group_timeout_s,
        startup=startup_limit(job.spec),
        warm=warm,
        place=place or StorePlace(),
        warmup=warmup,
    ).write(folder)


def run_ranks(
    job: RankJob, folder: Path, *, cwd: Path, servers: ForkServers | None = None
) -> tuple[list[RankOutcome], TimedOut]:
    """Run the job's ranks, in fresh processes (forked by ``servers`` where they can),
    to their end: every rank's outcome, and which time limit ran out, if one did
    (``"startup"``: the ranks did not all start their test in time)."""
    store, port = cuda.host_store(startup_limit(job.spec))
    write_job(
        job,
        folder,
        port=port,
        cwd=cwd,
        job_id="0",
        generation=0,
        group_timeout_s=group_timeout(job.spec),
        warm=False,
    )
    procs: list[RankProcess] = []
    env = rank_env(loopback=True)
    ranks = range(job.spec.world_size)
    if servers is not None:
        servers.prepare(ranks, cwd, env)
    try:
        for rank in ranks:
            with out_path(folder, rank).open("wb") as out, err_path(folder, rank).open("wb") as err:
                args = [str(folder), str(rank)]
                procs.append(
                    start_rank(
                        args,
                        out,
                        err,
                        cwd,
                        rank=rank,
                        env=env,
                        servers=servers,
                        limit_s=startup_limit(job.spec),
                    )
                )
        return watch_job(procs, folder, job)
    finally:
        kill_all(procs)
        del store


class LocalRank:
    """A rank process of this host, as the watch sees it: through its job's files."""

    def __init__(self, folder: Path, rank: int, proc: RankProcess) -> None:
        self.folder = folder
        self.rank = rank
        self.proc = proc

    def ended(self) -> bool:
        return result_path(self.folder, self.rank).exists() or self.proc.poll() is not None

    def ended_well(self) -> bool:
        return _json(result_path(self.folder, self.rank)).get("state") in GOOD_ENDS

    def started(self) -> bool:
        return started_path(self.folder, self.rank).exists()


class RankView(Protocol):
    """A rank as a watch sees it: this host's (:class:`LocalRank`) or another's."""

    rank: int

    def ended(self) -> bool: ...
    def ended_well(self) -> bool: ...
    def started(self) -> bool: ...


@dataclass
class Watch:
    """When each rank started its test and ended, as the watch saw it
    (``time.monotonic()``)."""

    start: float = field(default_factory=time.monotonic)
    started: dict[int, float] = field(default_factory=dict)
    ended: dict[int, float] = field(default_factory=dict)


def watch_job(
    procs: Sequence[RankProcess],
    folder: Path,
    job: RankJob,
    *,
    ranks: Sequence[int] | None = None,
) -> tuple[list[RankOutcome], TimedOut]:
    """Watch the ranks run the job in ``folder`` to their end: a rank ends with its
    result, or when its process does. Ranks still running at a time limit, or after a
    failure's grace, write their stacks and are killed (every rank of ``procs``: the
    caller starts new ones). ``ranks``: each process's rank (default: its position)."""
    local = [
        LocalRank(folder, rank, proc)
        for rank, proc in zip(ranks or range(len(procs)), procs, strict=True)
    ]
    watch = Watch()
    timed_out = watch_ranks(local, job.spec, watch, startup_limit(job.spec))
    return stop_and_read(local, folder, job, watch), timed_out


def stop_and_read(
    local: Sequence[LocalRank], folder: Path, job: RankJob, watch: Watch
) -> list[RankOutcome]:
    """Stop the ``local`` ranks still running (their stacks first), then read how
    each ended."""
    decided = time.monotonic()  # what a stopped rank says after this, the stop made
    stopped = [view for view in local if view.rank not in watch.ended]
    if stopped:
        _dump_stacks([view.proc for view in stopped], [view.rank for view in stopped], folder)
        kill_all([view.proc for view in local])
    stop = time.monotonic()
    outcomes = []
    for view in local:
        device = f"cuda:{job.devices[view.rank]}" if job.devices else "cpu"
        outcome = _outcome(
            folder,
            view.rank,
            view.proc,
            device,
            stopped=view in stopped,
            start=watch.start,
            ended=watch.ended.get(view.rank, stop),
            decided=decided,
        )
        if outcome.state in ("stopped", "exited"):
            # From when it started its test: its start-up is not the test's (issue 40).
            began = watch.started.get(view.rank, watch.start) - watch.start
            outcome.seconds = max(0.0, outcome.finished_at - began)
        outcomes.append(outcome)
    return outcomes


def watch_ranks(
    views: Sequence[RankView],
    spec: DistributedSpec,
    watch: Watch,
    startup: float,
    *,
    tick: Callable[[], TimedOut] | None = None,
) -> TimedOut:
    """Wait for every rank: until the start-up limit while they set up, then until the
    test's timeout, counted from when every rank started the test, or until a
    failure's grace runs out. ``tick``, called at each look, may end the watch with a
    reason of its own (another host decided)."""
    startup_deadline = time.monotonic() + startup
    deadline: float | None = None
    failed_at: float | None = None
    while True:
        now = time.monotonic()
        for view in views:
            if view.rank not in watch.started and view.started():
                watch.started[view.rank] = now
            if view.rank not in watch.ended and view.ended():
                watch.ended[view.rank] = now
                watch.started.setdefault(view.rank, now)
                if failed_at is None and not view.ended_well():
                    failed_at = now
        if len(watch.ended) == len(views):
            return None
        if tick is not None and (told := tick()) is not None:
            return told
        if failed_at is not None:
            if now >= failed_at + FAILURE_GRACE_S:
                return None
        elif deadline is None:
            if len(watch.started) == len(views):
                deadline = now + spec.timeout
            elif now >= startup_deadline:
                return "startup"
        elif now >= deadline:
            return "timeout"
        time.sleep(_POLL_S)


def _dump_stacks(procs: Sequence[RankProcess], ranks: list[int], folder: Path) -> None:
    """Ask each rank still running (``procs``, of ``ranks``) for its Python stack; wait
    until each wrote it."""
    if not ranks or not hasattr(signal, "SIGUSR1"):
        return
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGUSR1)
    deadline = time.monotonic() + STACK_WAIT_S
    sizes: dict[int, int] = {}
    while time.monotonic() < deadline:
        now = {rank: _size(stack_path(folder, rank)) for rank in ranks}
        if all(now.values()) and now == sizes:
            return  # every rank wrote something, and nothing more since the last look
        sizes = now
        time.sleep(0.05)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def kill_all(procs: Sequence[RankProcess]) -> None:
    """Kill every rank's session (the rank and anything it started), then reap them."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _outcome(
    folder: Path,
    rank: int,
    proc: RankProcess,
    device: str,
    *,
    stopped: bool,
    start: float,
    ended: float,
    decided: float,
) -> RankOutcome:
    """How ``rank`` ended, from its files. ``finished_at`` (seconds since ``start``):
    when the rank says it failed (``time.monotonic()``, one clock for every process of
    the host), else ``ended``, when the launcher saw it end; a rank that failed
    because another did may end within the same poll. A stopped rank's failure dated
    after ``decided`` (when the launcher chose to stop the ranks still running) is the
    stop's doing: a peer killed or dumping its stack breaks the collective this rank
    was waiting in; the rank was still running at the limit, and is reported so."""
    out = _read(out_path(folder, rank))
    err = _read(err_path(folder, rank))
    stack = _read(stack_path(folder, rank)) if stopped else ""
    result = _json(result_path(folder, rank))
    if stopped and float(result.get("at", decided - 1)) >= decided:
        result = {}
    # Without a result, a body record: its test body ended well and it waited for the
    # others, until it was stopped.
    record = result or _json(body_path(folder, rank))
    if record:
        waiting = stopped and not result
        return RankOutcome(
            rank,
            device,
            record["state"],
            seconds=float(record.get("seconds", 0.0)),
            message=record.get("message", ""),
            traceback=record.get("traceback", ""),
            where=record.get("where", ""),
            stdout=out,
            stderr=err,
            warnings=[tuple(w) for w in record.get("warnings", [])],
            waiting=waiting,
            stack=stack if waiting else "",
            finished_at=float(record.get("at", ended)) - start,
            leftovers=list(record.get("leftovers", [])),
            leak=result.get("leak"),
        )
    if stopped:
        started = started_path(folder, rank).exists()
        return RankOutcome(
            rank,
            device,
            "stopped",
            stack=stack,
            stdout=out,
            stderr=err,
            started=started,
            finished_at=ended - start,
        )
    code = proc.returncode
    how = _exit_text(code)
    return RankOutcome(
        rank,
        device,
        "exited",
        message=how,
        stdout=out,
        stderr=err,
        finished_at=ended - start,
    )


def _json(path: Path) -> dict[str, Any]:
    try:
        found: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"
