"""The world a launcher started: ``pytest --cuda-ranks=env`` under torchrun, srun or mpirun.

Each process the launcher started is one rank of the run. :func:`launched_world` reads
which one from the launcher's environment variables, in this order:

* torchrun (and anything that sets the same variables): ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node), ``MASTER_ADDR``,
  ``MASTER_PORT``; ``TORCHELASTIC_USE_AGENT_STORE=True`` says torchrun's agent hosts the
  store at that address;
* Slurm's ``srun``: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
  ``SLURM_NTASKS_PER_NODE`` (or ``SLURM_TASKS_PER_NODE``), ``SLURM_NODEID``;
* Open MPI's ``mpirun``: ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``,
  ``OMPI_COMM_WORLD_LOCAL_RANK``, ``OMPI_COMM_WORLD_LOCAL_SIZE``,
  ``OMPI_COMM_WORLD_NODE_RANK``.

Under srun and mpirun the store's address is the user's ``MASTER_ADDR`` and
``MASTER_PORT`` (rank 0 serves it), as for ``torch.distributed``'s ``env://``. Pure:
the standard library only.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["LaunchError", "LaunchedWorld", "launched_world"]

#: ``(launcher, rank, world size, local rank, local world size, node rank)`` variables.
_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"),
    (
        "srun",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "SLURM_NTASKS_PER_NODE",
        "SLURM_NODEID",
    ),
    (
        "mpirun",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "OMPI_COMM_WORLD_NODE_RANK",
    ),
)
_LOOPBACK = ("127.", "localhost", "::1")


class LaunchError(ValueError):
    """The environment does not describe a launched rank; the message says what is missing."""


@dataclass(frozen=True)
class LaunchedWorld:
    """This process's place in the launched world."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int
    #: This host's name, for the reports.
    host: str
    #: The store every rank of the run shares (the launcher's rendezvous address).
    master_addr: str
    master_port: int
    #: Whether the launcher's agent serves the store (torchrun); else rank 0 serves it.
    agent_store: bool
    #: The launcher's restart count: a restarted run uses new keys of the same store.
    attempt: str

    @property
    def serves_store(self) -> bool:
        """Whether this process serves the run's store (rank 0, without an agent's)."""
        return self.rank == 0 and not self.agent_store

    @property
    def on_loopback(self) -> bool:
        """Whether the store is on this host's loopback address (a one-machine rehearsal)."""
        return self.master_addr.startswith(_LOOPBACK)

    def describe(self) -> str:
        """``rank 1 of 2 on host-b (node 1, local rank 0), started by torchrun``."""
        return (
            f"rank {self.rank} of {self.world_size} on {self.host} (node {self.node}, "
            f"local rank {self.local_rank}), started by {self.launcher}"
        )


def launched_world(environ: Mapping[str, str]) -> LaunchedWorld:
    """This process's :class:`LaunchedWorld`, from the first launcher whose rank and
    world size are set; :class:`LaunchError` names what is missing or wrong."""
    for launcher, rank_var, size_var, local_var, local_size_var, node_var in _LAUNCHERS:
        if rank_var not in environ or size_var not in environ:
            continue
        rank = _number(environ, rank_var, launcher)
        size = _number(environ, size_var, launcher)
        if not 0 <= rank < size:
            raise LaunchError(f"{launcher}: {rank_var}={rank} is not below {size_var}={size}")
        local = _number(environ, local_var, launcher) if local_var in environ else 0
        local_size = _local_size(environ, local_size_var, size)
        node = _number(environ, node_var, launcher) if node_var in environ else 0
        addr, port = _master(environ, launcher)
        agent = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        attempt = environ.get("TORCHELASTIC_RESTART_COUNT") or environ.get("SLURM_RESTART_COUNT")
        return LaunchedWorld(
            launcher,
            rank,
            size,
            local,
            local_size,
            node,
            socket.gethostname(),
            addr,
            port,
            agent,
            attempt or "0",
        )
    raise LaunchError(
        "--cuda-ranks=env: no launcher's rank in the environment (RANK and WORLD_SIZE from "
        "torchrun, SLURM_PROCID and SLURM_NTASKS from srun, OMPI_COMM_WORLD_RANK and "
        "OMPI_COMM_WORLD_SIZE from mpirun); start pytest with one of them, e.g. "
        "torchrun --nproc-per-node=2 -m pytest --cuda-ranks=env"
    )


def _number(environ: Mapping[str, str], name: str, launcher: str) -> int:
    text = environ[name].strip()
    if not text.isdigit():
        raise LaunchError(f"{launcher}: {name}={environ[name]!r} is not a number >= 0")
    return int(text)


def _local_size(environ: Mapping[str, str], name: str, size: int) -> int:
    """The ranks on this node (the world's size where unknown); Slurm may write
    ``SLURM_TASKS_PER_NODE=4(x2)``."""
    text = environ.get(name) or environ.get("SLURM_TASKS_PER_NODE", "")
    head = text.split("(")[0].split(",")[0].strip()
    return int(head) if head.isdigit() else size


def _master(environ: Mapping[str, str], launcher: str) -> tuple[str, int]:
    addr = environ.get("MASTER_ADDR", "").strip()
    port = environ.get("MASTER_PORT", "").strip()
    if not addr or not port.isdigit():
        raise LaunchError(
            f"--cuda-ranks=env under {launcher}: set MASTER_ADDR and MASTER_PORT (the address "
            "of the first node and a free port on it) for every rank, as torch.distributed's "
            'env:// needs; e.g. MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" '
            "| head -n 1) MASTER_PORT=29500"
        )
    return addr, int(port)
