"""Made-up GPUs for plugin tests on machines without them: NVML's answers, nothing more.

A planted suite's ``conftest.py`` calls :func:`install` at import (pytest process and
xdist workers): :mod:`gpumagic.cuda`'s discovery then reads the NVML library and torch's
version file from the machine in ``$PYTEST_CUDA_FAKE_GPUS`` and runs for real on top
(``CUDA_VISIBLE_DEVICES`` in all its forms, selection, pinning). No CUDA work is faked.
The JSON: ``{"torch": "2.11.0+cu130", "cuda": "13.0", "driver": "580.95.05", "boards":
[board(0), …]}``; ``"cuda": null`` is a CPU-only torch, ``"boards": []`` a driver
without GPUs.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any

ENV = "PYTEST_CUDA_FAKE_GPUS"


GIB = 1024**3
H200_TOTAL = 150_754_820_096  # what NVML reports for an H200 (140.4 GiB)


def board(
    i: int,
    name: str = "NVIDIA H200",
    *,
    total: int = H200_TOTAL,
    free: int | None = None,
    capability: tuple[int, int] = (9, 0),
    migs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One made-up board, ``GPU-fake-<i>``."""
    return {
        "name": name,
        "uuid": f"GPU-fake-{i}",
        "total": total,
        "free": total - GIB if free is None else free,
        "capability": list(capability),
        "migs": migs or [],
    }


def h200s(count: int) -> list[dict[str, Any]]:
    return [board(i) for i in range(count)]


CPU_BUILD = {"boards": [], "cuda": None, "torch": "2.11.0+cpu"}
CPU_BUILD_REASON = "torch 2.11.0+cpu was built without CUDA (a CPU-only build)"


class NVMLError(Exception):
    """Raised where real NVML raises (no MIG mode, unknown handle)."""


@dataclass
class Board:
    name: str
    uuid: str
    total: int
    free: int
    capability: tuple[int, int]
    migs: list[Board] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Board:
        return cls(
            name=data["name"],
            uuid=data["uuid"],
            total=int(data["total"]),
            free=int(data.get("free", data["total"])),
            capability=(int(data["capability"][0]), int(data["capability"][1])),
            migs=[cls.from_json(m) for m in data.get("migs", [])],
        )


class FakeNVML:
    """The pynvml calls :mod:`gpumagic.cuda` makes, answered from a list of boards."""

    NVMLError = NVMLError

    def __init__(self, boards: list[Board], driver: str) -> None:
        self.boards = boards
        self.driver = driver

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        return len(self.boards)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Board:
        return self.boards[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes) -> Board:
        wanted = uuid.decode()
        for board in self.boards:
            for candidate in (board, *board.migs):
                if candidate.uuid == wanted:
                    return candidate
        raise NVMLError(f"no device {wanted}")

    def nvmlDeviceGetName(self, handle: Board) -> str:
        return handle.name

    def nvmlDeviceGetUUID(self, handle: Board) -> bytes:
        return handle.uuid.encode()

    def nvmlDeviceGetMemoryInfo(self, handle: Board) -> SimpleNamespace:
        used = handle.total - handle.free
        return SimpleNamespace(total=handle.total, free=handle.free, used=used)

    def nvmlDeviceGetCudaComputeCapability(self, handle: Board) -> tuple[int, int]:
        return handle.capability

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Board) -> int:
        if not handle.migs:
            raise NVMLError("MIG mode is not enabled")
        return len(handle.migs)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Board, index: int) -> Board:
        return handle.migs[index]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Board) -> list[Any]:
        return []


def install() -> None:
    """Point :mod:`gpumagic.cuda`'s discovery at the machine in ``$PYTEST_CUDA_FAKE_GPUS``."""
    from gpumagic import cuda
    from gpumagic.cuda import discovery

    spec = json.loads(os.environ[ENV])
    nvml = FakeNVML([Board.from_json(b) for b in spec["boards"]], spec.get("driver", "580.95.05"))
    versions = {"torch": spec.get("torch", "2.11.0+cu130"), "cuda": spec.get("cuda", "13.0")}
    discovery._nvml = lambda: nvml  # type: ignore[assignment]
    discovery._torch_version_file = lambda: dict(versions)  # type: ignore[assignment]
    cuda.reset_status_cache()


@dataclass(frozen=True)
class StandInDevice:
    """What ``torch.device("cuda", 1)`` is to the plugin's fixtures: a type, an index and
    the text ``cuda:1``."""

    type: str
    index: int | None = None

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


def install_torch_stand_in() -> None:
    """A stand-in for torch in ``sys.modules``, for planted runs about which devices each
    xdist worker gets: the real torch costs 1.6 s of CPU per process, and the fixtures
    only build device objects (the real ones: test_plugin_gpu.py on a GPU)."""
    if "torch" in sys.modules:
        return
    torch = ModuleType("torch")
    torch.device = StandInDevice  # type: ignore[attr-defined]
    torch.cuda = SimpleNamespace(is_initialized=lambda: False)  # type: ignore[attr-defined]
    sys.modules["torch"] = torch
