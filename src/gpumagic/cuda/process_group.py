"""``torch.distributed`` for tests that run in several processes, one rank each.

The pytest process hosts the rendezvous (:func:`host_store`, a ``TCPStore`` on a free
port of the loopback address that the operating system picks, so no two tests race for
a port); each rank process connects to it once (:func:`connect_store`), then joins a
process group through it (:func:`join_group`, warmed up by one barrier and one
all-reduce) and leaves it (:func:`leave_group`). Warm ranks keep their group from test
to test and rebuild it under a new prefix of the store, so no group reads another's
rendezvous keys. Hosting the store imports torch but creates no CUDA context.

Nothing listens beyond this host (issue 43): the store serves a socket bound to
``127.0.0.1`` (given ``127.0.0.1``, torch's own server would listen on every
interface), and the ranks' backends are pointed at the loopback interface
(:func:`rank_environment`). What this module writes to the store is plain text, and what
it reads back is compared with that text, never loaded as an object.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import TYPE_CHECKING, Any

from gpumagic.cuda.discovery import CudaUnavailable, torch_module

if TYPE_CHECKING:
    from collections.abc import Mapping
    from types import ModuleType

    import torch

__all__ = [
    "HOST",
    "UnexpectedStoreValue",
    "connect_store",
    "host_store",
    "join_group",
    "known_backends",
    "leave_group",
    "live_groups",
    "mark_rank_done",
    "preload_distributed",
    "rank_device",
    "rank_environment",
    "unknown_backends",
    "wait_for_ranks",
]

HOST = "127.0.0.1"
_DONE = "pytest_cuda/done/"
#: What a rank writes under its done key (:func:`mark_rank_done`).
_DONE_VALUE = b"1"
#: The variables that pick the network interface of gloo's and NCCL's own sockets.
_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
#: This rank's client of the store, once it connected.
_STORES: list[Any] = []


def _distributed() -> ModuleType:
    torch = torch_module()
    dist: ModuleType = torch.distributed
    if not dist.is_available():
        raise CudaUnavailable(
            f"this torch build ({torch.__version__}) has no torch.distributed; "
            "install a build with distributed support"
        )
    return dist


def preload_distributed() -> None:
    """Import torch and ``torch.distributed``, what every rank process imports first,
    in a process that forks rank processes from then on. Creates no CUDA context and
    asks no driver (neither survives a fork): importing torch does neither.
    :class:`CudaUnavailable` where this torch has no ``torch.distributed``."""
    _distributed()


def known_backends() -> tuple[str, ...]:
    """The backend names this torch knows (its own and registered ones), lower case."""
    names: list[str] = list(_distributed().Backend.backend_list)
    return tuple(name for name in names if name not in ("undefined", "fake"))


def unknown_backends(backend: str) -> list[str]:
    """The names in ``backend`` (``"gloo"``, ``"cpu:gloo,cuda:nccl"``) that torch does
    not know; compared as torch compares them, in lower case."""
    known = set(known_backends())
    names = [part.rpartition(":")[2].strip() for part in backend.lower().split(",")]
    return [name for name in names if name not in known]


class UnexpectedStoreValue(RuntimeError):
    """A key of the rendezvous store holds what no rank of this session wrote there."""


def host_store(timeout_s: float) -> tuple[Any, int]:
    """A rendezvous store served from this process on ``127.0.0.1`` only, and its port
    (picked free).

    The store's server is handed a socket already listening on the loopback address
    (``master_listen_fd``): asked for ``127.0.0.1``, torch's server binds every
    interface, so anyone on the network could write the rendezvous keys. The server
    gets a duplicate of the socket and closes it with the store.
    """
    dist = _distributed()
    with socket.create_server((HOST, 0)) as listener:
        port = listener.getsockname()[1]
        store = dist.TCPStore(
            HOST,
            port,
            None,
            True,
            datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=os.dup(listener.fileno()),
        )
    return store, int(store.port)


def rank_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a rank process on this host needs on top of ``environ`` so that
    gloo's and NCCL's own sockets listen on the loopback interface: one for each of
    ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` not set in ``environ`` (a value
    the user set is kept), none where this host has no interface named ``lo`` or
    ``lo0``. No torch."""
    names = {name for _, name in socket.if_nameindex()}
    loopback = next((name for name in ("lo", "lo0") if name in names), None)
    if loopback is None:
        return {}
    # NCCL matches interface names by prefix; "=" asks for this one alone.
    values = {"GLOO_SOCKET_IFNAME": loopback, "NCCL_SOCKET_IFNAME": f"={loopback}"}
    return {name: values[name] for name in _INTERFACE_VARIABLES if not environ.get(name)}


def rank_device(device_index: int | None) -> torch.device:
    """``cuda:<index>`` made this process's current device, or ``cpu`` for ``None``."""
    module = torch_module()
    if device_index is None:
        device: torch.device = module.device("cpu")
        return device
    module.cuda.set_device(device_index)
    device = module.device("cuda", device_index)
    return device  # noqa: RET504 -- typed: torch_module() is a ModuleType


def connect_store(port: int, world_size: int, timeout_s: float, *, host: str = HOST) -> None:
    """Connect this rank to the store at ``host:port`` (once per process): the pytest
    process's on this host, or a launched run's (:mod:`gpumagic.cuda.run_store`)."""
    if _STORES:
        return
    dist = _distributed()
    store = dist.TCPStore(host, port, world_size, False, datetime.timedelta(seconds=timeout_s))
    _STORES[:] = [store]


def join_group(
    backend: str,
    rank: int,
    world_size: int,
    *,
    device: torch.device,
    prefix: str,
    group_timeout_s: float,
) -> Any:
    """Initialise the default process group through the connected store, under
    ``prefix``; its group, warmed up.

    A CUDA ``device`` is passed as ``device_id`` (the group is bound to it, and NCCL
    need not guess it from the rank). The warm-up (a barrier, then an all-reduce of one
    element on ``device``) makes the library allocate what it keeps for the group's
    life before a test's leak baseline is read, not during the test.
    """
    dist = _distributed()
    torch = torch_module()
    store = dist.PrefixStore(prefix, _STORES[0])
    bound = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=group_timeout_s),
        **bound,
    )
    dist.barrier()
    dist.all_reduce(torch.zeros(1, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return dist.group.WORLD


def live_groups() -> dict[int, str]:
    """Every process group alive in this process, by ``id``: its backend and ranks."""
    dist = _distributed()
    if not dist.is_initialized():
        return {}
    groups: dict[int, str] = {}
    for group in list(dist.distributed_c10d._world.pg_map):
        try:
            ranks = dist.get_process_group_ranks(group)
            backend = dist.get_backend(group)
        except (RuntimeError, ValueError):  # being torn down
            continue
        groups[id(group)] = f"{backend}, ranks {ranks}"
    return groups


def mark_rank_done(rank: int, job: str) -> bool:
    """Tell the other ranks this one is done with ``job`` (through the store, not a
    collective, so it cannot be mistaken for a collective they wait in); ``False``
    before connecting. :class:`UnexpectedStoreValue` if the key already holds something
    else (each job's keys are new: only another process can have written it)."""
    if not _STORES:
        return False
    key = f"{_DONE}{job}/{rank}"
    found = bytes(_STORES[0].compare_set(key, "", _DONE_VALUE.decode()))
    _check_done(key, found)
    return True


def wait_for_ranks(world_size: int, job: str, timeout_s: float) -> None:
    """Wait until every rank said it is done with ``job`` (:func:`mark_rank_done`);
    :class:`UnexpectedStoreValue` if a rank's key holds anything but what ranks write."""
    keys = [f"{_DONE}{job}/{rank}" for rank in range(world_size)]
    store = _STORES[0]
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    for key in keys:
        _check_done(key, bytes(store.get(key)))


def _check_done(key: str, found: bytes) -> None:
    """``found`` is compared as bytes, never decoded into an object."""
    if found != _DONE_VALUE:
        raise UnexpectedStoreValue(
            f"the rendezvous store's key {key!r} holds {len(found)} bytes that no rank "
            f"wrote (a rank writes {_DONE_VALUE!r}): another process wrote to this "
            "session's store; the value was not read further"
        )


def leave_group() -> None:
    """Destroy the default process group (and every other), if this process has one."""
    dist = _distributed()
    if dist.is_initialized():
        dist.destroy_process_group()
