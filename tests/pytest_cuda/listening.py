"""The TCP sockets that processes listen on, as the operating system lists them (Linux).

Reads ``/proc/net/tcp`` and ``/proc/net/tcp6`` for the sockets in the LISTEN state and
matches them to processes through the socket inodes in ``/proc/<pid>/fd``. Standard
library only: the planted suites copy this file next to their tests, so a test in the
pytest process, or in a rank, can read the tables while warm ranks are up.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Listening",
    "descendants",
    "listening",
    "not_on_loopback",
    "pytest_process",
    "ranks_of",
    "readable",
]

PROC = Path("/proc")
#: What the command line of a rank started afresh, and of a fork server (and of the
#: ranks it forked), holds.
_RANK = b"pytest_cuda.distributed.rank_main"
_SERVER = b"pytest_cuda.distributed.forkserver_main"
#: ``st`` of a socket in the LISTEN state, in /proc/net/tcp's hexadecimal.
_LISTEN = "0A"


@dataclass(frozen=True)
class Listening:
    """One listening socket: the process that holds it, its address and port."""

    pid: int
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int

    @property
    def on_loopback(self) -> bool:
        mapped = getattr(self.address, "ipv4_mapped", None)
        return bool((mapped or self.address).is_loopback)

    def __str__(self) -> str:
        host = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        return f"pid {self.pid} listens on {host}:{self.port}"


def readable() -> bool:
    """Whether this system has the tables (Linux)."""
    return (PROC / "net" / "tcp").is_file()


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``0100007F`` → 127.0.0.1: the kernel prints each 32-bit word in host order."""
    words = [int(text[i : i + 8], 16) for i in range(0, len(text), 8)]
    packed = b"".join(struct.pack("=I", word) for word in words)
    family = socket.AF_INET if len(packed) == 4 else socket.AF_INET6
    return ipaddress.ip_address(socket.inet_ntop(family, packed))


def _socket_inodes(pid: int) -> set[str]:
    found: set[str] = set()
    try:
        fds = list((PROC / str(pid) / "fd").iterdir())
    except OSError:  # the process ended
        return found
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[len("socket:[") : -1])
    return found


def listening(pids: list[int]) -> list[Listening]:
    """Every TCP socket (IPv4 and IPv6) that one of ``pids`` listens on."""
    owners = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    found = []
    for table in ("tcp", "tcp6"):
        path = PROC / "net" / table
        if not path.is_file():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != _LISTEN or fields[9] not in owners:
                continue
            address, port = fields[1].split(":")
            found.append(Listening(owners[fields[9]], _address(address), int(port, 16)))
    return found


def _parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
    return parents


def _command(pid: int) -> bytes:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


def descendants(pid: int) -> list[int]:
    """The processes started by ``pid``, and by them, and so on (not ``pid`` itself)."""
    parents = _parents()
    found: list[int] = []
    layer = [pid]
    while layer:
        layer = [child for child, parent in parents.items() if parent in layer]
        found += layer
    return found


def ranks_of(pid: int) -> list[int]:
    """The rank processes of the pytest process ``pid``: those it started, and those
    its fork servers forked (not the servers)."""
    parents = _parents()
    children = [child for child, parent in parents.items() if parent == pid]
    servers = [child for child in children if _SERVER in _command(child)]
    forked = [child for child, parent in parents.items() if parent in servers]
    return [child for child in children if _RANK in _command(child)] + forked


def pytest_process() -> int:
    """In a rank: the pytest process that runs it (its parent, or its fork server's)."""
    parent = os.getppid()
    if _SERVER in _command(parent):
        return _parents()[parent]
    return parent


def not_on_loopback(pids: list[int]) -> list[str]:
    """One line per socket of ``pids`` that listens on anything but loopback."""
    return [str(found) for found in listening(pids) if not found.on_loopback]
