"""The launcher's store, as the pytest processes of a launched run share it.

Under ``pytest --cuda-ranks=env`` (torchrun, ``srun``, ``mpirun``) every pytest process
of the run reaches one ``TCPStore`` at the launcher's ``MASTER_ADDR:MASTER_PORT``:
torchrun's agent serves it (``TORCHELASTIC_USE_AGENT_STORE``), else rank 0's process
does, as ``torch.distributed``'s ``env://`` rendezvous would. The store must be
reachable from every node, so a served one listens where ``MASTER_ADDR`` says, not on
the loopback address alone (the launcher's rendezvous does the same).

:class:`RunStore` passes plain text only: what it reads back is never loaded as an
object (issue 43). Importing this module imports nothing; :func:`open_run_store`
imports torch but creates no CUDA context.
"""

from __future__ import annotations

import datetime
from typing import Any

from gpumagic.cuda.discovery import CudaUnavailable, torch_module

__all__ = ["RunStore", "StoreGone", "open_run_store"]


class StoreGone(RuntimeError):
    """The store stopped answering: the process (or agent) that served it is gone."""


class RunStore:
    """Text under keys of a shared store, every key under one prefix."""

    def __init__(self, store: Any, prefix: str, *, host: str, port: int) -> None:
        self._store = store
        self.prefix = prefix
        #: Where the store is, for the rank processes to connect to it too.
        self.host = host
        self.port = port

    def set(self, key: str, text: str) -> None:
        """Write ``text`` under ``key``."""
        self._call("set", self.prefix + key, text)

    def get(self, key: str) -> str:
        """The text under ``key`` (waits for it within the store's timeout)."""
        return bytes(self._call("get", self.prefix + key)).decode("utf-8", errors="replace")

    def has(self, *keys: str) -> bool:
        """Whether every one of ``keys`` is set (no wait)."""
        return bool(self._call("check", [self.prefix + key for key in keys]))

    def wait(self, keys: list[str], timeout_s: float) -> bool:
        """Wait until every one of ``keys`` is set: ``True``, or ``False`` when
        ``timeout_s`` ran out first."""
        wanted = [self.prefix + key for key in keys]
        try:
            self._store.wait(wanted, datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # torch's DistStoreError is one; so is a dead server
            if self._timed_out(exc):
                return False
            raise StoreGone(f"the run's store stopped answering: {exc}") from None
        return True

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._store, name)(*args)
        except RuntimeError as exc:
            raise StoreGone(f"the run's store stopped answering: {exc}") from None

    @staticmethod
    def _timed_out(exc: RuntimeError) -> bool:
        text = str(exc).lower()
        return "timeout" in text or "timed out" in text


def open_run_store(
    host: str, port: int, *, serve: bool, world_size: int, timeout_s: float, prefix: str
) -> RunStore:
    """The launched run's store at ``host:port``: served from this process when
    ``serve`` (rank 0 without a launcher's agent), else a client of it."""
    torch = torch_module()
    dist = torch.distributed
    if not dist.is_available():
        raise CudaUnavailable(
            f"this torch build ({torch.__version__}) has no torch.distributed; "
            "install a build with distributed support"
        )
    store = dist.TCPStore(
        host,
        port,
        world_size if serve else None,
        serve,
        datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return RunStore(store, prefix, host=host, port=port)
