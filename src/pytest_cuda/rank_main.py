"""One rank of a ``cuda_distributed`` test: ``python -m pytest_cuda.rank_main JOB RANK``.

Started by :mod:`pytest_cuda.rank_launch`, in a fresh interpreter with the pytest
process's ``sys.path``. It imports the test's module (with pytest's assertion
rewriting, so a failed ``assert`` explains itself as it does in pytest), joins the
process group, calls the test function with the fixture values the pytest process
sent and its own ``cuda_rank``, and writes how it ended to ``rank<N>.json`` in the
job's folder. ``SIGUSR1`` makes it write every thread's Python stack to
``rank<N>.stack`` (the launcher's way to show where a hanging rank waits).
"""

from __future__ import annotations

import ast
import contextlib
import faulthandler
import importlib
import importlib.util
import json
import os
import pickle
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType, TracebackType

    from pytest_cuda.leaks import NoCudaLeak

__all__ = ["JOB_FILE", "body_path", "main", "result_path", "stack_path", "started_path"]

JOB_FILE = "job.pickle"


def result_path(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.json"


def stack_path(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.stack"


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


def main(argv: list[str]) -> int:
    folder, rank = Path(argv[1]), int(argv[2])
    stack_file = stack_path(folder, rank).open("w")  # kept open for the signal handler
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    job: dict[str, Any] = pickle.loads((folder / JOB_FILE).read_bytes())
    sys.path[:] = job["sys_path"]
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(job["world_size"]),
        LOCAL_WORLD_SIZE=str(job["world_size"]),
    )
    _Rank(job, rank, folder).run()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not a normal interpreter exit: a rank whose peers failed may block for minutes
    # in a communicator's destructor; the launcher has what it needs.
    os._exit(0)


class _Rank:
    """One rank's run: set up, the test body, the health check, finishing together with
    the other ranks, then the leak check once the process group is gone."""

    def __init__(self, job: dict[str, Any], rank: int, folder: Path) -> None:
        self.job = job
        self.rank = rank
        self.folder = folder
        self.start = time.monotonic()
        self.joined = False
        self.leak_check: NoCudaLeak | None = None
        self.warnings: list[warnings.WarningMessage] = []

    def run(self) -> None:
        result = self._guarded(self._body)
        if result["state"] == "passed" and self.joined:
            _write(body_path(self.folder, self.rank), self._stamped(result))
            result = self._guarded(self._finish_together)
        elif self.joined:
            with contextlib.suppress(Exception):  # the failure is what gets reported
                from gpumagic import cuda

                cuda.mark_rank_done(self.rank)  # the others need not wait for this one
        _write(result_path(self.folder, self.rank), self._stamped(result))

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

    def _body(self) -> dict[str, Any]:
        from gpumagic import cuda
        from pytest_cuda.distributed import RankInfo

        job, rank = self.job, self.rank
        _import_test_module(job["module"], job["module_file"])
        function, kwargs = pickle.loads(job["call"])
        devices: list[int] = job["devices"]
        device = cuda.rank_device(devices[rank] if devices else None)
        group = cuda.join_group(
            job["backend"],
            rank,
            job["world_size"],
            job["port"],
            store_timeout_s=job["startup"],
            group_timeout_s=job["timeout"] + 60,
        )
        self.joined = True
        if job["wants_rank"]:
            kwargs["cuda_rank"] = RankInfo(rank, job["world_size"], device, job["backend"], group)
        if job["leak"] is not None:
            from pytest_cuda.leaks import NoCudaLeak

            tolerance, mode, trace = job["leak"]
            subject = f"{job['name']} on rank {rank}"
            self.leak_check = NoCudaLeak(tolerance, mode, trace, subject=subject)
            self.leak_check.__enter__()
        started_path(self.folder, rank).touch()
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
        return {"state": "passed"}

    def _finish_together(self) -> dict[str, Any]:
        """A rank that passed waits for the others before the group is destroyed:
        leaving early would break the collectives they may still be in, and hide which
        rank made them wait. The leak check comes after: what the process group keeps
        (buffers of its last collectives) is the group's, and goes with it."""
        from gpumagic import cuda

        cuda.mark_rank_done(self.rank)
        # Longer than the launcher waits: a rank never leaves before the others finish.
        cuda.wait_for_ranks(self.job["world_size"], self.job["timeout"] + self.job["startup"])
        cuda.leave_group()
        if self.leak_check is not None:
            self.leak_check.__exit__(None, None, None)
        return {"state": "passed"}


def _failure(exc: BaseException, job: dict[str, Any]) -> dict[str, Any]:
    """How an exception ended the rank: pytest's outcomes keep their meaning."""
    name = type(exc).__name__
    module = type(exc).__module__
    message = str(getattr(exc, "msg", None) or exc)
    if module.startswith("_pytest") and name == "Skipped":
        return {"state": "skipped", "message": message}
    if module.startswith("_pytest") and name == "XFailed":
        return {"state": "xfailed", "message": message}
    if name == "CudaLeakError":  # its text is the report; its frames are ours
        first, _, details = message.partition("\n")
        return {"state": "failed", "message": first, "traceback": details}
    from pytest_cuda.repro import failure_site

    shown = _from_test(exc.__traceback__, job["module_file"]) or exc.__traceback__
    text = "".join(traceback.format_exception(type(exc), exc, shown))
    site = failure_site(exc.__traceback__, in_file=Path(job["module_file"]), relative_to=Path.cwd())
    where = f"{site.path}:{site.lineno}" if site is not None else ""
    headline = message.strip().splitlines()[0] if message.strip() else ""
    if not (module.startswith("_pytest") and name == "Failed"):
        headline = f"{name}: {headline}" if headline else name
    return {"state": "failed", "message": headline, "traceback": text, "where": where}


def _from_test(tb: TracebackType | None, path: str) -> TracebackType | None:
    """The traceback from the test module's first frame on (the runner's frames cut)."""
    while tb is not None and tb.tb_frame.f_code.co_filename != path:
        tb = tb.tb_next
    return tb


def _import_test_module(name: str, path: str) -> ModuleType:
    """The test module under the name pytest gave it, so pickled references resolve."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    package = name.rpartition(".")[0]
    if package:
        importlib.import_module(package)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the test module {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    run = _rewritten(path) or spec.loader.exec_module
    try:
        run(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _rewritten(path: str) -> Callable[[ModuleType], None] | None:
    """Running the module with pytest's assertion rewriting, where pytest offers it."""
    try:
        from _pytest.assertion.rewrite import rewrite_asserts

        source = Path(path).read_bytes()
        tree = ast.parse(source, filename=path)
        rewrite_asserts(tree, source, path)
        code = compile(tree, path, "exec", dont_inherit=True)
    except Exception:
        return None

    def run(module: ModuleType) -> None:
        exec(code, module.__dict__)

    return run


if __name__ == "__main__":
    main(sys.argv)
