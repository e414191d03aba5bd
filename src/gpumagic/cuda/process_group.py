"""``torch.distributed`` for tests that run in several processes, one rank each.

The pytest process hosts the rendezvous (:func:`host_store`, a ``TCPStore`` on a free
localhost port that the operating system picks, so no two tests race for a port);
each rank process connects to it once (:func:`connect_store`), then joins a process
group through it (:func:`join_group`, warmed up by one barrier and one all-reduce) and
leaves it (:func:`leave_group`). Warm ranks keep their group from test to test and
rebuild it under a new prefix of the store, so no group reads another's rendezvous
keys. Hosting the store imports torch but creates no CUDA context.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

from gpumagic.cuda.discovery import CudaUnavailable, torch_module

if TYPE_CHECKING:
    from types import ModuleType

    import torch

__all__ = [
    "HOST",
    "connect_store",
    "host_store",
    "join_group",
    "known_backends",
    "leave_group",
    "live_groups",
    "mark_rank_done",
    "rank_device",
    "unknown_backends",
    "wait_for_ranks",
]

HOST = "127.0.0.1"
_DONE = "pytest_cuda/done/"
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


def host_store(timeout_s: float) -> tuple[Any, int]:
    """A rendezvous store served from this process, and its port (picked free)."""
    dist = _distributed()
    store = dist.TCPStore(
        HOST,
        0,
        None,
        True,
        datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return store, int(store.port)


def rank_device(device_index: int | None) -> torch.device:
    """``cuda:<index>`` made this process's current device, or ``cpu`` for ``None``."""
    module = torch_module()
    if device_index is None:
        device: torch.device = module.device("cpu")
        return device
    module.cuda.set_device(device_index)
    device = module.device("cuda", device_index)
    return device  # noqa: RET504 -- typed: torch_module() is a ModuleType


def connect_store(port: int, world_size: int, timeout_s: float) -> None:
    """Connect this rank to the store at ``port`` (once per process)."""
    if _STORES:
        return
    dist = _distributed()
    store = dist.TCPStore(HOST, port, world_size, False, datetime.timedelta(seconds=timeout_s))
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
    before connecting."""
    if not _STORES:
        return False
    _STORES[0].set(f"{_DONE}{job}/{rank}", "1")
    return True


def wait_for_ranks(world_size: int, job: str, timeout_s: float) -> None:
    """Wait until every rank said it is done with ``job`` (:func:`mark_rank_done`)."""
    keys = [f"{_DONE}{job}/{rank}" for rank in range(world_size)]
    _STORES[0].wait(keys, datetime.timedelta(seconds=timeout_s))


def leave_group() -> None:
    """Destroy the default process group (and every other), if this process has one."""
    dist = _distributed()
    if dist.is_initialized():
        dist.destroy_process_group()
