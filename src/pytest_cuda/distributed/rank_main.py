"""One rank of ``cuda_distributed`` tests: ``python -m pytest_cuda.distributed.rank_main JOB RANK``
for one test, or ``python -m pytest_cuda.distributed.rank_main --serve POOL RANK`` for a warm rank.

Started by :mod:`pytest_cuda.distributed.launch`, with the pytest process's
``sys.path``. For each test it reads its job (:mod:`pytest_cuda.distributed.job`),
imports the test's module once (with pytest's assertion rewriting, so a failed
``assert`` explains itself as it does in pytest), joins the process group (a warm rank
keeps it from test to test), calls the test function with the fixture values the pytest
process sent and its own ``cuda_rank``, and writes how it ended to ``rank<N>.json`` in
the job's folder. A warm rank gives the CUDA memory its test freed back to the driver
before it writes the result, reads the next job's folder from its stdin, and ends at end
of file. ``SIGUSR1`` makes it write every thread's Python stack to ``rank<N>.stack``
(the launcher's way to show where a hanging rank waits).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import pickle
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    from pytest_cuda.distributed.job import JobRun, RankJob
    from pytest_cuda.distributed.leftovers import RankState
    from pytest_cuda.leaks.engine import LeakCheck
    from pytest_cuda.leaks.limit_watch import LimitWatch

__all__ = [
    "Preloaded",
    "body_path",
    "err_path",
    "main",
    "out_path",
    "result_path",
    "stack_path",
    "started_path",
]


def result_path(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.json"


def stack_path(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.stack"


def out_path(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.out"


def err_path(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.err"


def started_path(folder: Path, rank: int) -> Path:
    """Written when the rank is about to call the test function: its set-up is done."""
    return folder / f"rank{rank}.started"


def body_path(folder: Path, rank: int) -> Path:
    """How the test body ended, for a rank that then waits for the others."""
    return folder / f"rank{rank}.body"


def _write(path: Path, result: dict[str, Any]) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(result))
    partial.replace(path)  # the launcher never reads half a file


class Preloaded(NamedTuple):
    """What a fork server's imports raised and printed before it forked this rank
    (:mod:`pytest_cuda.distributed.forkserver_main`): given back in its first job."""

    raised: list[warnings.WarningMessage]
    stdout: bytes
    stderr: bytes


@dataclass
class _Process:
    """What a rank process keeps from one test to the next."""

    rank: int
    #: The process group generation it is in (the pool numbers them), and the group.
    generation: int | None = None
    group: Any = None
    stack_file: IO[str] | None = None
    preloaded: Preloaded | None = None  # until its first job


def main(argv: list[str], preloaded: Preloaded | None = None) -> int:
    """Run the job, or (``--serve``) each job stdin names; ``preloaded``: forked."""
    serve = argv[1] == "--serve"
    folder, rank = Path(argv[2 if serve else 1]), int(argv[3 if serve else 2])
    process = _Process(rank, preloaded=preloaded)
    if not serve:
        _run_job(folder, process, idle=None)
    else:
        for line in sys.stdin:
            if not _run_job(Path(line.strip()), process, idle=folder):
                break  # as a fresh rank would: its peers see it gone, and it is replaced
    sys.stdout.flush()
    sys.stderr.flush()
    # Not a normal interpreter exit: a rank whose peers failed may block for minutes
    # in a communicator's destructor; the launcher has what it needs.
    os._exit(0)


def _redirect(out: Path, err: Path) -> None:
    """Point this process's stdout and stderr (the file descriptors, so output from C
    code goes there too) at ``out`` and ``err``."""
    sys.stdout.flush()
    sys.stderr.flush()
    for path, fd in ((out, 1), (err, 2)):
        with path.open("ab") as file:
            os.dup2(file.fileno(), fd)


def _run_job(folder: Path, process: _Process, *, idle: Path | None) -> bool:
    """Run the job in ``folder``; a warm rank (``idle``: its pool's folder) sends its
    output to the job's files meanwhile, and to ``idle`` after. Whether the rank may
    run another test: it ended well and left nothing behind."""
    rank = process.rank
    if idle is not None:
        _redirect(out_path(folder, rank), err_path(folder, rank))
    if process.preloaded is not None:  # the first job's output begins with the imports'
        os.write(1, process.preloaded.stdout)  # files: written whole
        os.write(2, process.preloaded.stderr)
    old = process.stack_file
    process.stack_file = stack_path(folder, rank).open("w")  # open for the signal handler
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=process.stack_file, all_threads=True)
    if old is not None:
        old.close()
    from pytest_cuda.distributed.job import read_job

    job_run = read_job(folder)
    sys.path[:] = job_run.sys_path
    if job_run.cwd:
        os.chdir(job_run.cwd)
    world_size = str(job_run.job.spec.world_size)
    local = job_run.place.local_rank
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank if local is None else local),
        WORLD_SIZE=world_size,
        LOCAL_WORLD_SIZE=os.environ.get("LOCAL_WORLD_SIZE", world_size)
        if local is not None
        else world_size,
    )
    result = _Rank(job_run, process, folder).run()
    process.preloaded = None
    if idle is not None:  # the job's output complete before its result
        _redirect(out_path(idle, rank), err_path(idle, rank))
    _write(result_path(folder, rank), result)
    return _may_go_on(result)


def _may_go_on(result: dict[str, Any]) -> bool:
    """Whether a rank may run another test after this result: it ended well and left
    nothing behind, neither state nor leaked memory."""
    leaked = bool((result.get("leak") or {}).get("leaked"))
    good = result["state"] in ("passed", "skipped", "xfailed")
    return good and not result.get("leftovers") and not leaked


class _Rank:
    """One rank's run of one test: set up, the test body, the health check, finishing
    together with the other ranks, what it left behind, the leak check, then (a warm
    rank) the memory it cached given back."""

    def __init__(self, job_run: JobRun, process: _Process, folder: Path) -> None:
        self.job_run = job_run
        self.job = job_run.job
        self.process = process
        self.rank = process.rank
        self.folder = folder
        self.start = time.monotonic()
        self.joined = False
        self.before: RankState | None = None
        self.leak_check: LeakCheck | None = None
        self.limit: LimitWatch | None = None
        preloaded = process.preloaded
        self.warnings: list[warnings.WarningMessage] = list(preloaded.raised if preloaded else ())

    def run(self) -> dict[str, Any]:
        try:
            return self._run()
        finally:
            for check in (self.leak_check, self.limit):  # not judged: the test failed
                if check is not None:
                    check.close()

    def _run(self) -> dict[str, Any]:
        result = self._guarded(self._body)
        if result["state"] == "passed" and self.joined:
            _write(body_path(self.folder, self.rank), self._stamped(result))
            result = self._guarded(self._finish_together)
        elif self.joined:
            with contextlib.suppress(Exception):  # the failure is what gets reported
                from gpumagic import cuda

                cuda.mark_rank_done(self.rank, self.job_run.job_id)  # none need wait for it
            if result["state"] in ("skipped", "xfailed"):
                result["leftovers"] = self._leftovers(groups=True)
        if self.job_run.warm and _may_go_on(result):
            result = self._give_memory_back(result)
        return self._stamped(result)

    def _give_memory_back(self, result: dict[str, Any]) -> dict[str, Any]:
        """Return the blocks torch's allocator cached in this warm rank to the driver,
        before the result says the test ended: the next test, an ordinary one in the
        pytest process included, finds what this test freed free again, whatever the
        order (a warm rank outlives its test; a fresh one's memory goes with its
        process). After the leak check, which reads the allocator, and the leftovers."""
        from gpumagic import cuda

        try:
            cuda.release_cached_blocks(self.job.devices[self.rank : self.rank + 1])
        except Exception as exc:
            return {
                "state": "failed",
                "message": "giving the CUDA memory this rank cached back to the driver "
                f"failed: {type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
                "at": time.monotonic(),
            }
        return result

    def _stamped(self, result: dict[str, Any]) -> dict[str, Any]:
        result["seconds"] = time.monotonic() - self.start
        result["warnings"] = [
            (w.category.__name__, str(w.message), w.filename, w.lineno) for w in self.warnings
        ]
        return result

    def _guarded(self, step: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        try:
            with warnings.catch_warnings(record=True) as recorded:
                warnings.simplefilter("always")
                try:
                    return step()
                finally:
                    self.warnings += recorded
        except BaseException as exc:
            # When it failed (see rank_launch._outcome).
            at = time.monotonic()
            return {**_failure(exc, self.job), "at": at}

    def _join(self, device: Any) -> Any:
        """The process group of this job's generation: the one this process is in, or
        a new one (the old one destroyed first)."""
        from gpumagic import cuda

        job_run, spec, process = self.job_run, self.job.spec, self.process
        place = job_run.place
        cuda.connect_store(job_run.port, spec.world_size, job_run.startup, host=place.host)
        if process.generation == job_run.generation:
            return process.group
        if process.generation is not None:
            process.generation = process.group = None
            cuda.leave_group()
        process.group = cuda.join_group(
            spec.backend,
            self.rank,
            spec.world_size,
            device=device,
            prefix=f"{place.group_prefix}group{job_run.generation}/",
            group_timeout_s=job_run.group_timeout,
        )
        process.generation = job_run.generation
        return process.group

    def _body(self) -> dict[str, Any]:
        from gpumagic import cuda
        from pytest_cuda.distributed.ranks import RankInfo

        job, rank = self.job, self.rank
        if self.job_run.warmup:  # the group only: the ranks' start-up, in the test's set-up
            self._join(cuda.rank_device(job.devices[rank] if job.devices else None))
            self.joined = True
            started_path(self.folder, rank).touch()
            return {"state": "passed"}
        from pytest_cuda.distributed.module_import import import_test_module

        import_test_module(job.module, job.module_file)
        function, kwargs = pickle.loads(job.call)
        device = cuda.rank_device(job.devices[rank] if job.devices else None)
        group = self._join(device)
        self.joined = True
        if job.wants_rank:
            spec = job.spec
            kwargs["cuda_rank"] = RankInfo(rank, spec.world_size, device, spec.backend, group)
        if self.job_run.warm:
            from pytest_cuda.distributed.leftovers import capture

            self.before = capture()
        code = getattr(getattr(function, "__func__", function), "__code__", None)
        outermost = (code.co_filename, code.co_name) if code is not None else None
        if job.limit is not None:  # before the leak check's recording: it keeps the events'
            from pytest_cuda.leaks.limit_watch import LimitWatch

            devices = (job.devices[rank],) if job.devices else None
            self.limit = LimitWatch.recorded(*job.limit, outermost=outermost, devices=devices)
        if job.leak is not None:
            from pytest_cuda.leaks.engine import LeakCheck

            # The same check as the pytest process's, stacks recorded: its stacks are
            # cut at the test function.
            self.leak_check = LeakCheck.alone(job.leak, outermost=outermost)
            self.leak_check.begin()
        started_path(self.folder, rank).touch()
        if self.limit is not None:
            self.limit.begin()
        function(**kwargs)
        del function, kwargs
        # The health check first: an asynchronous error would surface in the leak
        # check's synchronize instead, and be reported as the leak check's.
        error = cuda.async_error()
        if error is not None:
            sticky = " (sticky: this rank's CUDA context is unusable)" if error.sticky else ""
            return {
                "state": "failed",
                "message": f"a CUDA error surfaced after the test body returned{sticky}: "
                f"{error.message.strip().splitlines()[0]}",
                "traceback": error.message,
            }
        root = job.leak.root if job.leak is not None else os.getcwd()
        over = self.limit.failure(f"{job.name} on rank {rank}", root) if self.limit else None
        if over is not None:
            return {"state": "failed", "message": over[0], "traceback": over[1]}
        return {"state": "passed"}

    def _leftovers(self, *, groups: bool) -> list[str]:
        if self.before is None:
            return []
        from pytest_cuda.distributed.leftovers import capture, left_behind

        after = capture()
        if not groups:
            after = type(after)(after.environ, after.flags, self.before.groups)
        return left_behind(self.before, after)

    def _finish_together(self) -> dict[str, Any]:
        """A rank that passed waits for the others before anything else: leaving early
        would break the collectives they may still be in, and hide which rank made them
        wait. Then what it left behind, the group left where this test had it of its
        own, and the leak check: a warm group's buffers were allocated by its warm-up,
        before the leak check's baseline."""
        from gpumagic import cuda

        job_run, spec = self.job_run, self.job.spec
        cuda.mark_rank_done(self.rank, job_run.job_id)
        # Longer than the launcher waits: a rank never leaves before the others finish.
        cuda.wait_for_ranks(spec.world_size, job_run.job_id, spec.timeout + job_run.startup)
        # A test's own group goes with it: groups it kept are no leftover then.
        leaving = (spec.fresh_group or not job_run.warm) and not job_run.warmup
        left = self._leftovers(groups=not leaving)
        if leaving:
            self.process.generation = self.process.group = None
            cuda.leave_group()
        result: dict[str, Any] = _left_behind(left) if left else {"state": "passed"}
        if self.leak_check is not None:
            result["leak"] = self._leak_report(self.leak_check)
        return result

    def _leak_report(self, check: LeakCheck) -> dict[str, Any]:
        """The leak check's verdict, as plain data for the pytest process, which judges
        it with the test's own check (a leak does not fail the rank)."""
        from pytest_cuda.leaks.report import LeakReport

        settings, self.leak_check = self.job.leak, None
        assert settings is not None  # a check was begun for it
        return LeakReport.of(
            check.finish(),
            mode=settings.mode,
            tolerance=settings.tolerance,
            subject=f"{self.job.name} on rank {self.rank}",
            root=settings.root,
            rank=self.rank,
        ).to_dict()


def _left_behind(lines: list[str]) -> dict[str, Any]:
    """The failure of a rank whose test left state behind for the next test."""
    more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
    details = [
        "It left, for the next test on this warm rank:",
        *(f"  {line}" for line in lines),
        "Put it back before the test returns (try/finally, or a fixture), destroy the "
        "process groups it made (dist.destroy_process_group(group)), or mark the test "
        "cuda_distributed(..., isolate=True) to give it fresh rank processes.",
    ]
    return {
        "state": "failed",
        "message": f"left state behind for the next test: {lines[0]}{more}",
        "traceback": "\n".join(details),
    }


def _failure(exc: BaseException, job: RankJob) -> dict[str, Any]:
    """How an exception ended the rank: pytest's outcomes keep their meaning."""
    # By class, not name: pytest's outcome classes say they are in ``builtins``.
    import pytest

    name = type(exc).__name__
    message = str(getattr(exc, "msg", None) or exc)
    if isinstance(exc, pytest.skip.Exception):
        return {"state": "skipped", "message": message}
    if isinstance(exc, pytest.xfail.Exception):
        return {"state": "xfailed", "message": message}
    if name == "CudaLeakError":  # its text is the report; its frames are ours
        first, _, details = message.partition("\n")
        return {"state": "failed", "message": first, "traceback": details}
    from pytest_cuda.repro import failure_site

    shown = _from_test(exc.__traceback__, job.module_file) or exc.__traceback__
    text = "".join(traceback.format_exception(type(exc), exc, shown))
    site = failure_site(exc.__traceback__, in_file=Path(job.module_file), relative_to=Path.cwd())
    where = f"{site.path}:{site.lineno}" if site is not None else ""
    headline = message.strip().splitlines()[0] if message.strip() else ""
    if not isinstance(exc, pytest.fail.Exception):
        headline = f"{name}: {headline}" if headline else name
    return {"state": "failed", "message": headline, "traceback": text, "where": where}


def _from_test(tb: TracebackType | None, path: str) -> TracebackType | None:
    """The traceback from the test module's first frame on (the runner's frames cut)."""
    while tb is not None and tb.tb_frame.f_code.co_filename != path:
        tb = tb.tb_next
    return tb


if __name__ == "__main__":
    main(sys.argv)
