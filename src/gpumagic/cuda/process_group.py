"""``torch.distributed`` for tests that run in several processes, one rank each.

The pytest process hosts the rendezvous (:func:`host_store`, a ``TCPStore`` on a free
localhost port that the operating system picks, so no two tests race for a port);
each rank process joins the process group through it (:func:`join_group`) and leaves
it (:func:`leave_group`). Hosting the store imports torch but creates no CUDA context.
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
    "host_store",
    "join_group",
    "leave_group",
    "mark_rank_done",
    "rank_device",
    "wait_for_ranks",
]

HOST = "127.0.0.1"
_DONE = "pytest_cuda/done/"
#: This rank's client of the test's store, once it joined the group.
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


def join_group(
    backend: str,
    rank: int,
    world_size: int,
    port: int,
    *,
    store_timeout_s: float,
    group_timeout_s: float,
) -> Any:
    """Initialise the default process group through the store at ``port``; its group."""
    dist = _distributed()
    store = dist.TCPStore(
        HOST, port, world_size, False, datetime.timedelta(seconds=store_timeout_s)
    )
    _STORES[:] = [store]
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=group_timeout_s),
    )
    return dist.group.WORLD


def mark_rank_done(rank: int) -> bool:
    """Tell the other ranks this one is done (through the store, not a collective, so
    it cannot be mistaken for a collective they wait in); ``False`` before joining."""
    if not _STORES:
        return False
    _STORES[0].set(f"{_DONE}{rank}", "1")
    return True


def wait_for_ranks(world_size: int, timeout_s: float) -> None:
    """Wait until every rank said it is done (:func:`mark_rank_done`)."""
    keys = [f"{_DONE}{rank}" for rank in range(world_size)]
    _STORES[0].wait(keys, datetime.timedelta(seconds=timeout_s))


def leave_group() -> None:
    """Destroy the default process group, if this process has one."""
    dist = _distributed()
    if dist.is_initialized():
        dist.destroy_process_group()
