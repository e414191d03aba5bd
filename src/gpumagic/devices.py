"""Pure device bookkeeping: what a CUDA device is, and which ones a process may see.

Nothing here touches CUDA, torch or NVML: :mod:`gpumagic.cuda` gathers the facts and
this module interprets them, so the rules (``CUDA_VISIBLE_DEVICES`` in its index, UUID
and MIG forms; human memory sizes; capabilities) are testable on any machine.

It also holds the one grammar of a device spec as users write it, for ``%cudatime
--device``, ``%gpumem --device`` and ``--cuda-devices``: :func:`parse_device_spec`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpumagic.units import format_bytes

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "CudaStatus",
    "DeviceInfo",
    "DeviceSpec",
    "DeviceSpecError",
    "parse_device_spec",
    "parse_visible_devices",
    "pick_devices",
    "select_visible",
]


@dataclass(frozen=True)
class DeviceInfo:
    """One CUDA device as this process sees it.

    ``index`` is the torch/CUDA ordinal inside the visible set (``cuda:index``);
    ``physical_index`` is NVML's index of the board, ``None`` when NVML is unavailable.
    """

    index: int
    name: str
    total_memory: int
    capability: tuple[int, int]
    uuid: str = ""
    physical_index: int | None = None

    def describe(self) -> str:
        """``"0 NVIDIA H200 (139.8 GiB, sm_90)"``."""
        major, minor = self.capability
        cap = f"sm_{major}{minor}" if major else "sm_?"
        return f"{self.index} {self.name} ({format_bytes(self.total_memory)}, {cap})"


@dataclass(frozen=True)
class CudaStatus:
    """Whether CUDA work is possible here, and why not when it is not.

    Gathered without creating a CUDA context (see :func:`gpumagic.cuda.status`).
    """

    available: bool
    reason: str
    torch_version: str | None = None
    cuda_version: str | None = None
    driver_version: str | None = None
    devices: tuple[DeviceInfo, ...] = field(default_factory=tuple)
    visible_devices_env: str | None = None

    def summary(self) -> str:
        """A one-line description, e.g. for a pytest report header."""
        parts = [f"torch {self.torch_version or 'not installed'}"]
        if self.cuda_version:
            parts.append(f"CUDA {self.cuda_version}")
        if self.driver_version:
            parts.append(f"driver {self.driver_version}")
        if not self.available:
            return ", ".join(parts) + f"; no usable GPU: {self.reason}"
        return ", ".join(parts) + f"; {len(self.devices)} device(s)"


def parse_visible_devices(value: str | None) -> list[int] | list[str] | None:
    """Interpret ``CUDA_VISIBLE_DEVICES`` the way the CUDA runtime (and torch) does.

    Returns ``None`` when the variable is unset (every device is visible), a list of
    physical indices, or a list of UUID / MIG identifiers. Parsing stops at the first
    invalid entry; a repeated entry makes the set empty, as in the CUDA runtime.
    """
    if value is None:
        return None
    tokens = [t.strip() for t in value.split(",")]
    if tokens and tokens[0].startswith(("GPU-", "MIG-")):
        prefix = "GPU-" if tokens[0].startswith("GPU-") else "MIG-"
        ids: list[str] = []
        for token in tokens:
            if token in ids:
                return []
            if not token.startswith(prefix):
                break
            ids.append(token)
        return ids
    ordinals: list[int] = []
    for token in tokens:
        match = re.match(r"\d+", token)
        if match is None:
            break
        ordinal = int(match.group())
        if ordinal in ordinals:
            return []
        ordinals.append(ordinal)
    return ordinals


def select_visible(
    physical: list[DeviceInfo], visible: list[int] | list[str] | None
) -> list[DeviceInfo]:
    """Order and renumber the physical devices as a process with ``visible`` sees them.

    ``physical`` is every board NVML reports (``physical_index`` and ``uuid`` set).
    Integer entries past the last board end the list; UUID entries match by unique
    prefix, as CUDA does.
    """
    if visible is None:
        chosen = list(physical)
    else:
        chosen = []
        for entry in visible:
            found = _find_device(physical, entry)
            if found is None:
                break
            chosen.append(found)
    return [
        DeviceInfo(
            index=i,
            name=d.name,
            total_memory=d.total_memory,
            capability=d.capability,
            uuid=d.uuid,
            physical_index=d.physical_index,
        )
        for i, d in enumerate(chosen)
    ]


def _find_device(physical: list[DeviceInfo], entry: int | str) -> DeviceInfo | None:
    if isinstance(entry, int):
        return next((d for d in physical if d.physical_index == entry), None)
    matches = [d for d in physical if d.uuid.startswith(entry)]
    return matches[0] if len(matches) == 1 else None


# ---------------------------------------------------------------------------
# Device specs as users write them


class DeviceSpecError(ValueError):
    """A device spec the grammar, or the place it was given in, does not take; the
    message names the place and says what it takes."""


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed device spec: ``indices`` into the visible devices in the order written
    (``None``: all of them), or the host (``cpu``)."""

    indices: tuple[int, ...] | None
    cpu: bool = False


def _usage(many: bool, cpu: bool) -> str:
    if many:
        forms = "indices into the visible devices such as 0 or cuda:0, a list such as 0,1"
        return f"use {forms}{', cpu' if cpu else ''} or 'all'"
    return f"use one index into the visible devices such as 0 or cuda:0{' or cpu' if cpu else ''}"


def parse_device_spec(
    text: str, *, where: str, place: str, many: bool = True, cpu: bool = False
) -> DeviceSpec:
    """The device spec ``text`` in the one grammar every place shares.

    The grammar: ``all``, ``cpu``, or a comma-separated list of ``N`` / ``cuda:N``
    (indices into the visible devices, as torch numbers them; no index twice), case
    and spaces aside. A place takes part of it: ``many`` (lists and ``all``) and
    ``cpu``. :class:`DeviceSpecError` otherwise, prefixed with ``where`` (the option as
    the user wrote it) and, for a form the grammar has but ``place`` does not take,
    saying so. Checked without CUDA.
    """
    usage = _usage(many, cpu)
    value = text.strip()
    if not value:
        raise DeviceSpecError(f"{where}: no device given; {usage}")
    if value.lower() == "cpu":
        if not cpu:
            raise DeviceSpecError(f"{where}: {place} takes CUDA devices only, not cpu; {usage}")
        return DeviceSpec(None, cpu=True)
    if value.lower() == "all":
        if not many:
            raise DeviceSpecError(f"{where}: {place} takes one device, not all; {usage}")
        return DeviceSpec(None)
    indices: list[int] = []
    for raw in value.split(","):
        token = raw.strip()
        number = token.lower().removeprefix("cuda:")
        if not number.isdigit():
            raise DeviceSpecError(f"{where}: {token!r} is not a device index; {usage}")
        index = int(number)
        if index in indices:
            raise DeviceSpecError(f"{where}: cuda:{index} is listed twice")
        indices.append(index)
    if len(indices) > 1 and not many:
        raise DeviceSpecError(f"{where}: {place} takes one device, not a list; {usage}")
    return DeviceSpec(tuple(indices))


def pick_devices(
    devices: Sequence[DeviceInfo], spec: DeviceSpec, *, where: str
) -> tuple[DeviceInfo, ...]:
    """The devices ``spec`` names among the visible ``devices``, in its order.

    :class:`DeviceSpecError` naming the visible ones when it names another.
    """
    if spec.indices is None:
        return tuple(devices)
    by_index = {d.index: d for d in devices}
    missing = [i for i in spec.indices if i not in by_index]
    if missing:
        visible = ", ".join(f"cuda:{d.index}" for d in devices) or "none"
        asked = ", ".join(f"cuda:{i}" for i in missing)
        raise DeviceSpecError(f"{where}: there is no {asked} here (visible: {visible})")
    return tuple(by_index[i] for i in spec.indices)
