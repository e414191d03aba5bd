"""A fork server: ``python -m pytest_cuda.distributed.forkserver_main FD``, one per rank
number of a session, started by :mod:`pytest_cuda.distributed.forkserver`.

It imports what a rank process imports first (torch, ``torch.distributed``, pytest's
assertion rewriting, the rank's own modules), once, with the ``sys.path`` the pytest
process sends, and creates no CUDA context and asks no driver (neither survives a
fork). Then, for each request on its socket (``FD``: one end of a socket pair, the
pytest process holds the other), it forks a rank: a new session, the request's
standard input, output and error, working directory and environment, then
:func:`pytest_cuda.distributed.rank_main.main`, as ``python -m
pytest_cuda.distributed.rank_main ARGS`` would run it, without importing torch again.
The warnings and output of the import are the rank's own: each rank gives them back
in its first job, where a rank that imported torch itself would have raised them. It
answers each request with the rank's pid, tells the pytest process each rank's exit
status (the ranks are its children), and ends when the pytest process closes its end
of the socket. Where the import fails, each rank is ``python -m
pytest_cuda.distributed.rank_main`` executed afresh, and meets the failure itself.

The protocol, one JSON object a message (a ``SOCK_SEQPACKET`` socket pair):

* in: ``{"sys_path": [...]}`` first, then ``{"args": [...], "cwd": ..., "env": {...}}``
  with three file descriptors (the rank's stdin, stdout and stderr);
* out: ``{"pid": N}`` or ``{"error": TEXT}`` for each request, in order, and
  ``{"exited": N, "code": C}`` when rank ``N`` ended (``C`` as
  :attr:`subprocess.Popen.returncode` says it: negative for a signal).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import tempfile
import traceback
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_cuda.distributed.rank_main import Preloaded

__all__ = ["MAX_MESSAGE", "RANK_MODULE", "main"]

#: The longest message either side sends (a request carries the rank's environment).
MAX_MESSAGE = 1 << 20
#: What each rank runs.
RANK_MODULE = "pytest_cuda.distributed.rank_main"


def main(argv: list[str]) -> int:
    link = socket.socket(fileno=int(argv[1]))
    first = link.recv(MAX_MESSAGE)
    if not first:
        return 0
    preloaded = _preload(json.loads(first)["sys_path"])
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up fd wakes the loop
    signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    closing = (link.fileno(), wake_read, wake_write)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the pytest process is gone
        while True:
            ready, _, _ = select.select([link.fileno(), wake_read], [], [])
            if wake_read in ready:
                os.read(wake_read, 4096)
                _reap(link)
            if link.fileno() in ready:
                message, fds, _, _ = socket.recv_fds(link, MAX_MESSAGE, 3)
                if not message:
                    break  # the pytest process is done, or gone: its ranks end on their own
                _answer(link, json.loads(message), fds, preloaded, closing)
    return 0


def _answer(
    link: socket.socket,
    request: dict[str, Any],
    fds: list[int],
    preloaded: Preloaded | None,
    closing: tuple[int, ...],
) -> None:
    """Fork the rank ``request`` asks for; send its pid, or why there is none."""
    try:
        reply: dict[str, Any] = {"pid": _fork(request, fds, preloaded, closing)}
    except OSError as exc:
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        for fd in fds:
            os.close(fd)
    link.send(json.dumps(reply).encode())


def _preload(sys_path: list[str]) -> Preloaded | None:
    """Import what every rank imports first, with the rank's ``sys.path``; the
    warnings and output of the import, for each rank to give back. ``None`` where the
    import failed: each rank then starts afresh, and fails as it would have."""
    from pytest_cuda.distributed.rank_main import Preloaded

    sys.path[:] = sys_path
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        saved = [os.dup(1), os.dup(2)]
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            with warnings.catch_warnings(record=True) as recorded:
                warnings.simplefilter("always")  # as the rank records its job's
                _import_what_a_rank_imports()
        except Exception:
            return None
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, saved_fd in zip((1, 2), saved, strict=True):
                os.dup2(saved_fd, fd)
                os.close(saved_fd)
        out.seek(0)
        err.seek(0)
        return Preloaded(list(recorded), out.read(), err.read())


def _import_what_a_rank_imports() -> None:
    """torch and ``torch.distributed`` (no CUDA context), pytest and the rank's modules."""
    from gpumagic import cuda

    cuda.preload_distributed()
    import _pytest.assertion.rewrite  # noqa: F401 -- the test module's import uses it

    import pytest_cuda.distributed.job
    import pytest_cuda.distributed.leftovers
    import pytest_cuda.distributed.module_import
    import pytest_cuda.distributed.ranks  # noqa: F401 -- imports pytest

    if cuda.is_initialized():  # a CUDA context would not survive the fork
        raise RuntimeError("importing torch created a CUDA context")


def _reap(link: socket.socket) -> None:
    """Tell the pytest process of every rank that ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        link.send(json.dumps({"exited": pid, "code": code}).encode())


def _fork(
    request: dict[str, Any], fds: list[int], preloaded: Preloaded | None, closing: tuple[int, ...]
) -> int:
    """Fork one rank; its pid once it is the leader of a session of its own (the
    launcher kills a rank's whole session)."""
    if len(fds) != 3:
        raise OSError(f"a request carries 3 file descriptors, this one {len(fds)}")
    sys.stdout.flush()
    sys.stderr.flush()
    ready_read, ready_write = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns of a fork in a process with threads: numpy's BLAS pool,
        # which it stops around a fork. The ranks' warnings are their own.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os.close(ready_read)
        _become_rank(request, fds, preloaded, (*closing, ready_write), ready_write)
    os.close(ready_write)
    with os.fdopen(ready_read, "rb") as ready:
        started = ready.read(1)
    if not started:  # it died before its setsid: its exit status comes all the same
        raise OSError(f"the rank process {pid} ended as it started")
    return pid


def _become_rank(
    request: dict[str, Any],
    fds: list[int],
    preloaded: Preloaded | None,
    closing: tuple[int, ...],
    ready: int,
) -> None:
    """In the forked child: become the rank ``request`` asks for. Never returns."""
    code = 1
    try:
        os.setsid()
        os.write(ready, b"1")
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in {*fds, *closing} - {0, 1, 2}:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _reseed()
        argv = [sys.executable, "-m", RANK_MODULE, *request["args"]]
        if preloaded is None:
            os.execv(sys.executable, argv)
        from pytest_cuda.distributed import rank_main

        sys.argv = [str(rank_main.__file__), *request["args"]]
        sys.modules["__main__"] = rank_main  # as ``python -m`` runs it
        rank_main.main(sys.argv, preloaded)  # ends the process itself
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reseed() -> None:
    """A forked process's random state is its server's: Python's ``random`` draws a new
    seed at the fork; numpy's global generator, where the import seeded one, draws one
    here, as a process of its own would have."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def _exit_code(exc: SystemExit) -> int:
    """The exit status the interpreter gives a ``SystemExit``."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    with contextlib.suppress(Exception):
        print(exc.code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    # Not a normal interpreter exit: nothing here needs one, and tearing torch's
    # modules down costs a third of a second.
    os._exit(main(sys.argv))
