"""Which CUDA devices a test run may use, and how they are shared out to xdist workers.

Pure logic: the facts come from :func:`gpumagic.cuda.status` (discovery without a CUDA
context) and the rules live here, so they are testable on any machine.

Device indices are positions in the *visible* set, i.e. what torch calls ``cuda:i`` in
this process. An outer ``CUDA_VISIBLE_DEVICES`` (indices, ``GPU-…`` UUIDs or ``MIG-…``
instances) is respected: a worker's own ``CUDA_VISIBLE_DEVICES`` is written in the
outer variable's own terms, so ``cuda:1`` under ``CUDA_VISIBLE_DEVICES=5,7`` becomes
``7`` and never physical GPU 1 (the bug of triton-lang/triton#11831).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumagic.devices import DeviceSpecError, parse_device_spec, parse_visible_devices

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gpumagic.devices import CudaStatus, DeviceInfo

__all__ = [
    "DeviceRequest",
    "SelectionError",
    "WorkerPlan",
    "device_names",
    "group_devices",
    "parse_device_request",
    "select_devices",
    "visible_devices_value",
]


class SelectionError(ValueError):
    """A device selection that cannot be honoured; the message says what exists."""


@dataclass(frozen=True)
class DeviceRequest:
    """What the user asked for: indices into the visible devices, or ``None`` for all.

    ``source`` names where it came from, as the user wrote it (``--cuda-devices=0,1``,
    ``PYTEST_CUDA_DEVICES=0,1``, ``cuda_devices = 0,1 (ini)``), for error messages.
    """

    indices: tuple[int, ...] | None
    source: str


def parse_device_request(text: str, source: str) -> DeviceRequest:
    """``"0,1"`` → indices ``(0, 1)``; ``"all"`` → every visible device.

    The grammar is :func:`gpumagic.devices.parse_device_spec`'s, without ``cpu``.
    Raises :class:`SelectionError` for an empty list, an entry that is not an index
    (``N`` or ``cuda:N``), a repeated index and ``cpu``.
    """
    try:
        spec = parse_device_spec(text, where=source, place="--cuda-devices")
    except DeviceSpecError as exc:
        raise SelectionError(str(exc)) from None
    return DeviceRequest(spec.indices, source)


def device_names(devices: Sequence[DeviceInfo]) -> str:
    """``"0 NVIDIA H200, 1 NVIDIA H200"``."""
    return ", ".join(f"{d.index} {d.name}" for d in devices)


def _shows(status: CudaStatus) -> str:
    count = len(status.devices)
    noun = "device" if count == 1 else "devices"
    hidden = ""
    if status.visible_devices_env is not None:
        hidden = f" (CUDA_VISIBLE_DEVICES={status.visible_devices_env!r})"
    return f"this machine shows {count} {noun}{hidden}: {device_names(status.devices)}"


def select_devices(request: DeviceRequest, status: CudaStatus) -> tuple[DeviceInfo, ...]:
    """The visible devices ``request`` names, in the order given.

    Raises :class:`SelectionError` when indices are out of range or when specific
    devices are asked for where CUDA is unusable. ``all`` never fails: it selects
    whatever is visible, possibly nothing.
    """
    if request.indices is None:
        return status.devices
    if not status.available:
        raise SelectionError(
            f"{request.source} asks for CUDA devices, but there is no usable GPU here: "
            f"{status.reason}"
        )
    missing = [i for i in request.indices if i >= len(status.devices)]
    if missing:
        asked = ", ".join(f"cuda:{i}" for i in missing)
        raise SelectionError(f"{request.source}: {asked} requested, {_shows(status)}")
    return tuple(status.devices[i] for i in request.indices)


def group_devices(
    devices: Sequence[DeviceInfo], per_worker: int
) -> tuple[tuple[DeviceInfo, ...], ...]:
    """Consecutive groups of ``per_worker`` devices, one group per xdist worker slot."""
    if per_worker < 1:
        raise SelectionError(f"--cuda-devices-per-worker={per_worker}: give 1 or more")
    if len(devices) < per_worker:
        raise SelectionError(
            f"--cuda-devices-per-worker={per_worker}, but only {len(devices)} "
            f"device(s) are selected: {device_names(devices) or 'none'}"
        )
    if len(devices) % per_worker:
        raise SelectionError(
            f"--cuda-devices-per-worker={per_worker} does not split the {len(devices)} "
            f"selected devices ({device_names(devices)}) evenly; select a multiple of "
            f"{per_worker} with --cuda-devices"
        )
    return tuple(tuple(devices[i : i + per_worker]) for i in range(0, len(devices), per_worker))


def visible_devices_value(group: Sequence[DeviceInfo], outer: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a worker that owns ``group``.

    Written in the outer variable's terms (its indices, UUIDs or MIG ids), so the
    worker sees exactly these devices whatever the outer setting was.
    """
    parsed = parse_visible_devices(outer)
    if parsed is None:
        return ",".join(str(d.index) for d in group)
    return ",".join(str(parsed[d.index]) for d in group)


@dataclass(frozen=True)
class WorkerPlan:
    """How xdist workers share the selected devices: worker ``i`` owns group ``i % n``."""

    groups: tuple[tuple[DeviceInfo, ...], ...]
    per_worker: int
    outer: str | None
    source: str

    def group(self, worker: int) -> tuple[DeviceInfo, ...]:
        """The devices worker number ``worker`` (``gw<worker>``) owns."""
        return self.groups[worker % len(self.groups)]

    def visible_devices(self, worker: int) -> str:
        """The ``CUDA_VISIBLE_DEVICES`` value worker number ``worker`` runs with."""
        return visible_devices_value(self.group(worker), self.outer)

    def describe(self, workers: int) -> list[str]:
        """One line per worker: ``gw0 → cuda:0 NVIDIA H200 (CUDA_VISIBLE_DEVICES=0)``."""
        lines = []
        for i in range(workers):
            owned = ", ".join(f"cuda:{d.index} {d.name}" for d in self.group(i))
            lines.append(f"gw{i} → {owned} (CUDA_VISIBLE_DEVICES={self.visible_devices(i)})")
        if workers < len(self.groups):
            idle = self.groups[workers:]
            names = ", ".join(f"cuda:{d.index}" for g in idle for d in g)
            lines.append(f"no worker for {names}: -n {workers} starts fewer workers than groups")
        return lines
