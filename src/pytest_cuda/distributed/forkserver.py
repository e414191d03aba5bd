"""Starting a rank process: forked from a fork server that imported torch once a
session (:func:`start_rank`), or started afresh where none can fork it.

Importing torch is most of what starting a rank costs (over a second of CPU a
process), and a session starts ranks many times: a warm pool's after each test that
went wrong, fresh ones for each ``isolate=True`` test. A fork server
(:mod:`pytest_cuda.distributed.forkserver_main`) imports what a rank imports, once, and
forks each new rank from there; it never creates a CUDA context (which a fork would
not carry over), so each rank creates its own, as a rank started afresh does.

One server per rank number: a forked rank shares its server's seed of Python's
``str`` hashes, so the ranks of one test, forked from different servers, order sets of
strings differently, as processes of their own would (a test whose ranks run their
collectives in the order of a set fails here, as under torchrun). A server serves one
environment, working directory and ``sys.path``: where they change, the next rank
gets a new server. Where no server can serve (not Linux; or it failed, or did not
answer in time), :func:`start_rank` starts ``python -m pytest_cuda.distributed.rank_main``
itself. A server that ends while ranks it forked run cannot say how they end: they are
killed (their whole session), and reported so.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from gpumagic import cuda
from pytest_cuda.distributed.forkserver_main import MAX_MESSAGE, RANK_MODULE

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

__all__ = [
    "ForkServer",
    "ForkServers",
    "ForkedRank",
    "RankProcess",
    "can_fork",
    "rank_env",
    "start_rank",
]

#: Variables left out of a server's key: pytest sets ``PYTEST_CURRENT_TEST`` at each
#: phase of each test, and nothing a rank imports reads it (each rank gets its own value).
_VOLATILE = frozenset({"PYTEST_CURRENT_TEST"})
_SERVER_MODULE = "pytest_cuda.distributed.forkserver_main"

Key = tuple[str, tuple[str, ...], tuple[tuple[str, str], ...]]


class RankProcess(Protocol):
    """A rank's process as the launcher uses it: a :class:`subprocess.Popen`, or a
    :class:`~pytest_cuda.distributed.forkserver.ForkedRank`."""

    pid: int
    returncode: int | None
    stdin: IO[bytes] | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...


def rank_env(*, loopback: bool = True) -> dict[str, str]:
    """A rank process's environment: this process's, with this package first on
    ``PYTHONPATH`` and unbuffered output (a killed rank's output is all in its files);
    ``loopback``: its backend's sockets on this host's loopback interface (every rank
    on this host), else where the user's environment says (ranks on several hosts)."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if loopback:
        env.update(cuda.rank_environment(env))  # gloo's and NCCL's sockets on loopback
    return env


def start_rank(
    args: list[str],
    out: IO[bytes],
    err: IO[bytes],
    cwd: Path,
    *,
    rank: int,
    env: dict[str, str],
    stdin: bool = False,
    servers: ForkServers | None = None,
    limit_s: float = 120.0,
) -> RankProcess:
    """Rank ``rank``'s process, ``python -m pytest_cuda.distributed.rank_main ARGS``, in
    a session of its own, with ``env`` (:func:`rank_env`); ``stdin``: a pipe for its
    jobs (a warm rank), else none. Forked by its fork server in ``servers`` (which
    gets ``limit_s`` seconds to answer), or started afresh where none can fork it."""
    if servers is not None:
        forked = servers.start(rank, args, out, err, stdin=stdin, cwd=cwd, env=env, limit_s=limit_s)
        if forked is not None:
            return forked
    return subprocess.Popen(
        [sys.executable, "-m", RANK_MODULE, *args],
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=out,
        stderr=err,
        cwd=cwd,
        env=env,
        start_new_session=True,
    )


def can_fork() -> bool:
    """Whether ranks may be forked from fork servers on this system (Linux)."""
    return sys.platform == "linux" and hasattr(socket, "send_fds")


class ForkedRank:
    """A rank a fork server forked, as the launcher uses a :class:`subprocess.Popen`:
    ``pid`` (the leader of a session of its own), ``stdin``, ``poll()``, ``wait()``,
    ``returncode``; its server tells it when the rank ended."""

    def __init__(
        self, server: ForkServer, pid: int, args: list[str], stdin: IO[bytes] | None
    ) -> None:
        self.pid = pid
        self.args = args
        self.stdin = stdin
        self.returncode: int | None = None
        self._server = server

    def poll(self) -> int | None:
        if self.returncode is None:
            self._server.pump(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._server.pump(left)
        return self.returncode


class ForkServer:
    """One fork server process (:mod:`pytest_cuda.distributed.forkserver_main`) and
    the ranks it forked, through its end of a socket pair."""

    def __init__(self, cwd: Path, env: Mapping[str, str]) -> None:
        self.link, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", _SERVER_MODULE, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd=cwd,
                env=dict(env),
                start_new_session=True,  # a Ctrl-C in the terminal is pytest's to handle
            )
        self.ranks: dict[int, ForkedRank] = {}
        self._replies: deque[dict[str, Any]] = deque()
        self.lost = False
        self._send({"sys_path": list(sys.path)})

    def start(
        self,
        args: list[str],
        out: IO[bytes],
        err: IO[bytes],
        *,
        stdin: bool,
        cwd: Path,
        env: Mapping[str, str],
        limit_s: float,
    ) -> ForkedRank | None:
        """Fork ``python -m pytest_cuda.distributed.rank_main ARGS`` (its output in
        ``out`` and ``err``; ``stdin``: a pipe for its jobs, else none); ``None`` where
        the server is gone, or did not answer within ``limit_s`` (then it is stopped)."""
        if stdin:
            theirs, ours = os.pipe()
        else:
            theirs, ours = os.open(os.devnull, os.O_RDONLY), -1
        request = {"args": args, "cwd": str(cwd), "env": dict(env)}
        try:
            sent = self._send(request, [theirs, out.fileno(), err.fileno()])
        finally:
            os.close(theirs)
        reply = self._reply(limit_s) if sent else None
        if reply is None or "pid" not in reply:
            if ours >= 0:
                os.close(ours)
            if reply is None:
                self.close(wait_s=0)
            return None
        pipe = os.fdopen(ours, "wb") if ours >= 0 else None
        rank = self.ranks[reply["pid"]] = ForkedRank(self, int(reply["pid"]), args, pipe)
        return rank

    def pump(self, timeout: float | None) -> None:
        """Read what the server said, waiting up to ``timeout`` seconds (``None``: as
        long as it takes) for its first message."""
        if self.lost:
            return
        ready, _, _ = select.select([self.link], [], [], timeout)
        while ready:
            try:
                message = self.link.recv(MAX_MESSAGE, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                message = b""
            if not message:
                self._lose()
                return
            said = json.loads(message)
            if "exited" in said:
                rank = self.ranks.pop(int(said["exited"]), None)
                if rank is not None:
                    rank.returncode = int(said["code"])
            else:
                self._replies.append(said)

    def busy(self) -> bool:
        """Whether a rank it forked is still running."""
        self.pump(0)
        return bool(self.ranks)

    def close(self, wait_s: float = 10) -> None:
        """Stop the server: it ends when its end of the socket closes, or it is killed
        after ``wait_s`` seconds."""
        self.link.close()
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._lose()

    def _send(self, message: dict[str, Any], fds: Iterable[int] = ()) -> bool:
        try:
            socket.send_fds(self.link, [json.dumps(message).encode()], list(fds))
        except OSError:
            self._lose()
            return False
        return True

    def _reply(self, limit_s: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + limit_s
        while not self._replies:
            left = deadline - time.monotonic()
            if self.lost or left <= 0:
                return None
            self.pump(left)
        return self._replies.popleft()

    def _lose(self) -> None:
        """The server is gone: the ranks it forked can no longer be told ended, so
        they are killed (their whole session), and reported so."""
        self.lost = True
        for pid, rank in self.ranks.items():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            rank.returncode = -signal.SIGKILL
        self.ranks.clear()


class ForkServers:
    """One session's fork servers, by rank number."""

    def __init__(self) -> None:
        self._servers: dict[int, tuple[Key, ForkServer]] = {}
        #: Servers of an environment since replaced, kept while their ranks run.
        self._retired: list[ForkServer] = []

    def prepare(self, ranks: Iterable[int], cwd: Path, env: Mapping[str, str]) -> None:
        """Start the servers these ranks will be forked from, if they are not running,
        so that their imports run side by side."""
        if can_fork():
            for rank in ranks:
                self._server(rank, cwd, env)

    def start(
        self,
        rank: int,
        args: list[str],
        out: IO[bytes],
        err: IO[bytes],
        *,
        stdin: bool,
        cwd: Path,
        env: Mapping[str, str],
        limit_s: float,
    ) -> ForkedRank | None:
        """Fork rank ``rank`` from its server (see :meth:`ForkServer.start`); ``None``
        where it cannot be forked: the caller starts it itself."""
        if not can_fork():
            return None
        server = self._server(rank, cwd, env)
        forked = server.start(args, out, err, stdin=stdin, cwd=cwd, env=env, limit_s=limit_s)
        if server.lost:
            self._servers.pop(rank, None)  # the next rank gets a new server
        return forked

    def close(self) -> None:
        """Stop every server."""
        for _, server in self._servers.values():
            server.close()
        for server in self._retired:
            server.close()
        self._servers.clear()
        self._retired.clear()

    def _server(self, rank: int, cwd: Path, env: Mapping[str, str]) -> ForkServer:
        key: Key = (
            str(cwd),
            tuple(sys.path),
            tuple(sorted((k, v) for k, v in env.items() if k not in _VOLATILE)),
        )
        found = self._servers.get(rank)
        if found is not None and found[0] == key and not found[1].lost:
            return found[1]
        if found is not None:
            self._retired.append(found[1])
        self._retire()
        server = ForkServer(cwd, env)
        self._servers[rank] = (key, server)
        return server

    def _retire(self) -> None:
        """Stop the replaced servers none of whose ranks still runs."""
        for server in [s for s in self._retired if not s.busy()]:
            server.close()
            self._retired.remove(server)
