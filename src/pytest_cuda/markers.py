"""The ``cuda`` marker: what a test needs, and why it cannot run here.

Pure logic (no pytest, no CUDA): the plugin hands in the marker's arguments and the
devices discovered by :mod:`gpumagic.cuda`, and gets back a requirement or a reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpumagic.units import format_bytes, parse_capability, parse_size

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence

    from gpumagic.devices import DeviceInfo

__all__ = [
    "KEYWORDS",
    "CudaRequirement",
    "MarkerError",
    "check_keywords",
    "check_no_arguments",
    "merge_requirements",
    "parse_cuda_marker",
    "unmet_reason",
]

KEYWORDS = ("min_devices", "min_memory", "min_capability")


class MarkerError(ValueError):
    """A malformed marker (``cuda`` unless ``marker`` names another); the message says
    which argument and why."""

    def __init__(self, message: str, marker: str = "cuda") -> None:
        super().__init__(message)
        self.marker = marker


@dataclass(frozen=True)
class CudaRequirement:
    """What a test asks of the GPU: a device count, free memory, a compute capability.

    ``min_memory`` is free bytes on each device the test is given; ``min_capability``
    is ``(major, minor)``.
    """

    min_devices: int = 1
    min_memory: int | None = None
    min_capability: tuple[int, int] | None = None

    def merged(self, other: CudaRequirement) -> CudaRequirement:
        """The stricter of the two, field by field."""
        return CudaRequirement(
            min_devices=max(self.min_devices, other.min_devices),
            min_memory=_max_or_none(self.min_memory, other.min_memory),
            min_capability=_max_or_none(self.min_capability, other.min_capability),
        )


def _max_or_none(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


def check_keywords(
    args: Sequence[object], kwargs: Mapping[str, object], known: Sequence[str]
) -> None:
    """A marker that takes the ``known`` keywords only: :class:`ValueError` names
    positional arguments and unknown keywords."""
    if args:
        raise ValueError(
            f"takes keyword arguments only ({', '.join(k + '=' for k in known)}), "
            f"got positional {', '.join(repr(a) for a in args)}"
        )
    unknown = [k for k in kwargs if k not in known]
    if unknown:
        raise ValueError(
            f"unknown keyword {', '.join(repr(k) for k in unknown)}; known: {', '.join(known)}"
        )


def check_no_arguments(args: Sequence[object], kwargs: Mapping[str, object]) -> None:
    """A marker that takes no argument (``cuda_sync``, ``cuda_no_sync``):
    :class:`ValueError` names what was given."""
    given = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    if given:
        raise ValueError(f"takes no arguments, got {', '.join(given)}")


def parse_cuda_marker(args: Sequence[object], kwargs: Mapping[str, object]) -> CudaRequirement:
    """``cuda(min_devices=2, min_memory="40GiB", min_capability=(8, 0))`` → requirement.

    Raises :class:`MarkerError` for positional arguments, unknown keywords and values
    that are not a count, a size or a capability.
    """
    try:
        check_keywords(args, kwargs, KEYWORDS)
    except ValueError as exc:
        raise MarkerError(str(exc)) from None
    count = kwargs.get("min_devices", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise MarkerError(f"min_devices must be a positive integer, got {count!r}")
    memory = kwargs.get("min_memory")
    capability = kwargs.get("min_capability")
    try:
        min_memory = None if memory is None else parse_size(memory)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise MarkerError(f"min_memory: {exc}") from None
    if isinstance(capability, list):
        capability = tuple(capability)
    try:
        min_capability = (
            None if capability is None else parse_capability(capability)  # type: ignore[arg-type]
        )
    except (TypeError, ValueError) as exc:
        raise MarkerError(f"min_capability: {exc}") from None
    return CudaRequirement(count, min_memory, min_capability)


def merge_requirements(requirements: Iterable[CudaRequirement]) -> CudaRequirement | None:
    """The strictest value of each keyword over the test's, class's and module's
    markers; ``None`` for none."""
    merged: CudaRequirement | None = None
    for requirement in requirements:
        merged = requirement if merged is None else merged.merged(requirement)
    return merged


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def unmet_reason(
    requirement: CudaRequirement,
    available: Sequence[DeviceInfo],
    checked: Sequence[DeviceInfo],
    free_memory: Callable[[DeviceInfo], int | None],
    *,
    scope: str = "available",
) -> str | None:
    """Why ``requirement`` cannot be met, or ``None`` when it can.

    ``available`` are the devices the test may use, ``checked`` the ones it is given
    (its ``cuda_device`` parameter, else the first ``min_devices``): memory and
    capability are checked on those. ``free_memory`` answers free bytes of a device
    (``None``: unknown). ``scope`` words where the devices come from, e.g.
    ``"selected by --cuda-devices=0"`` or ``"owned by worker gw0"``.
    """
    if len(available) < requirement.min_devices:
        names = ", ".join(f"{d.index} {d.name}" for d in available) or "none"
        return (
            f"needs {_plural(requirement.min_devices, 'CUDA device')}, "
            f"{len(available)} {scope}: {names}"
        )
    if requirement.min_capability is not None:
        need = requirement.min_capability
        for device in checked:
            if device.capability < need:
                return (
                    f"needs compute capability {need[0]}.{need[1]}, cuda:{device.index} "
                    f"{device.name} has {device.capability[0]}.{device.capability[1]}"
                )
    if requirement.min_memory is not None:
        for device in checked:
            free = free_memory(device)
            if free is None:
                return (
                    f"needs {format_bytes(requirement.min_memory)} free memory, but the "
                    f"free memory of cuda:{device.index} is unknown (NVML unavailable)"
                )
            if free < requirement.min_memory:
                return (
                    f"needs {format_bytes(requirement.min_memory)} free memory, "
                    f"cuda:{device.index} {device.name} has {format_bytes(free)} free "
                    f"(of {format_bytes(device.total_memory)})"
                )
    return None
