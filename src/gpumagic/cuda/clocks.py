"""The SM clock and NVML's reasons for it, read cheaply around each ``%cudatime`` run.

NVML only: no torch, no CUDA context. What the reasons mean (power cap, thermal
slowdown, ...) and when a clock counts as throttled is the caller's
(:mod:`gpumagic.timing_clocks`); this module reads the numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from gpumagic.cuda import discovery
from gpumagic.cuda.discovery import CudaUnavailable

if TYPE_CHECKING:
    from gpumagic.devices import DeviceInfo

__all__ = ["SmClock", "sm_clock"]


class SmClock(NamedTuple):
    """One reading of a device's SM clock."""

    #: The SM clock now, in MHz.
    mhz: int
    #: NVML's clocks event (throttle) reasons now: a bit mask, 0 for none; ``None``
    #: where the driver would not say.
    reasons: int | None
    #: The clock the device runs at when nothing holds it back: NVML's default
    #: applications clock, else its maximum SM clock; ``None`` where NVML says neither.
    default_mhz: int | None


# Per device: its NVML handle and default clock, read once (a handle lookup by UUID
# costs more than the two readings themselves). Keyed by the NVML module as well, so a
# test's stand-in never sees another's handle; the entry keeps the module alive, so its
# id is never reused.
_STATIC: dict[tuple[int, DeviceInfo], tuple[Any, int | None, Any]] = {}


def _static(nvml: Any, device: DeviceInfo) -> tuple[Any, int | None]:
    key = (id(nvml), device)
    found = _STATIC.get(key)
    if found is None:
        handle = discovery._nvml_handle(device)
        default = None
        for query in ("nvmlDeviceGetDefaultApplicationsClock", "nvmlDeviceGetMaxClockInfo"):
            try:
                value = int(getattr(nvml, query)(handle, nvml.NVML_CLOCK_SM))
            except (nvml.NVMLError, AttributeError):
                continue
            if value > 0:
                default = value
                break
        found = _STATIC[key] = (handle, default, nvml)
    return found[:2]


def sm_clock(device: int) -> SmClock | None:
    """The SM clock of ``device`` (an index into the visible devices) and NVML's reasons
    for it, now; ``None`` where NVML is missing or cannot read them (the clock is then
    unknown, and nothing should be said about it).

    Two NVML queries (the handle and the default clock are read once per device), no
    torch and no CUDA context: cheap enough to read after every run.
    """
    nvml = discovery._nvml()
    visible = discovery.devices()
    if nvml is None or not 0 <= device < len(visible):
        return None
    try:
        handle, default = _static(nvml, visible[device])
        mhz = int(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))
        # Renamed in NVML 12.2 ("clocks event reasons"); the old name stays for older
        # drivers' bindings.
        reasons_of = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if reasons_of is None:
            reasons_of = nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        try:
            reasons: int | None = int(reasons_of(handle))
        except nvml.NVMLError:
            reasons = None  # the clock alone is still worth having
    except (nvml.NVMLError, CudaUnavailable, AttributeError):
        return None
    return SmClock(mhz, reasons, default) if mhz > 0 else None
