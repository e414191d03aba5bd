"""Pure device bookkeeping: what a CUDA device is, and which ones a process may see.

Nothing here touches CUDA, torch or NVML: :mod:`gpumagic.cuda` gathers the facts and
this module interprets them, so the rules (``CUDA_VISIBLE_DEVICES`` in its index, UUID
and MIG forms; human memory sizes; capabilities) are testable on any machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = [
    "CudaStatus",
    "DeviceInfo",
    "format_bytes",
    "parse_capability",
    "parse_size",
    "parse_visible_devices",
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


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a human string: ``4096``, ``"512MiB"``, ``"40 GiB"``, ``"1.5GB"``.

    Raises :class:`ValueError` with the accepted forms when ``value`` is not a size.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a memory size: {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"memory size must not be negative: {value!r}")
        return int(value)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"not a memory size: {value!r}; use bytes or a number with a unit "
            "such as '512MiB', '40GiB' or '1.5GB'"
        )
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_capability(value: tuple[int, int] | str | float) -> tuple[int, int]:
    """A compute capability from ``(8, 0)``, ``"8.0"``, ``"sm_80"`` or ``8.0``."""
    if isinstance(value, tuple):
        if len(value) == 2 and all(isinstance(v, int) and v >= 0 for v in value):
            return (value[0], value[1])
        raise ValueError(f"not a compute capability: {value!r}; use (major, minor) like (8, 0)")
    text = str(value).strip().lower()
    match = re.fullmatch(r"(?:sm_?)?(\d+)(?:\.(\d))?", text)
    if match is None:
        raise ValueError(f"not a compute capability: {value!r}; use (8, 0), '8.0' or 'sm_80'")
    if match.group(2) is None:
        digits = match.group(1)
        if text.startswith("sm") and len(digits) >= 2:
            return (int(digits[:-1]), int(digits[-1]))
        return (int(digits), 0)
    return (int(match.group(1)), int(match.group(2)))


def format_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``; binary units, one decimal, sign kept."""
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
