"""The devices of this run: what this process found and was asked for, once per config.

Discovery (NVML and torch's version file: no torch import, no CUDA context) runs at the
first :func:`run_devices`; :mod:`pytest_cuda.plugin` asks for it only when devices are
asked for, when xdist workers start, or after collection when some test uses CUDA. Here
too: the report header's lines (:func:`header_lines`) and how many xdist workers start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import pytest

from pytest_cuda.settings import settings_of

if TYPE_CHECKING:
    from gpumagic.devices import CudaStatus, DeviceInfo
    from pytest_cuda.selection import DeviceRequest, WorkerPlan
    from pytest_cuda.xdist_pinning import WorkerPin

__all__ = [
    "RunDevices",
    "asked_for_devices",
    "distributing",
    "header_lines",
    "pinned_by",
    "remote_only",
    "run_devices",
    "unavailable",
    "worker_plan",
    "xdist_workers",
]


class RunDevices(NamedTuple):
    """What this process found and was asked for; one per config, built on first use."""

    status: CudaStatus
    devices: tuple[DeviceInfo, ...]
    scope: str
    request: DeviceRequest | None
    plan: WorkerPlan | None
    pin: WorkerPin | None


_RUN_DEVICES = pytest.StashKey[RunDevices]()


def asked_for_devices(config: pytest.Config) -> bool:
    """Devices were asked for (``--cuda-devices`` and its sources, or
    ``--cuda-devices-per-worker``): discovery then runs at configure."""
    settings = settings_of(config)
    return settings.device_request is not None or settings.devices_per_worker is not None


def run_devices(config: pytest.Config) -> RunDevices:
    """This process's devices, discovered at the first call (a bad selection raises
    :class:`pytest.UsageError`)."""
    run = config.stash.get(_RUN_DEVICES, None)
    if run is None:
        run = _discover(config)
        config.stash[_RUN_DEVICES] = run
    return run


def _discover(config: pytest.Config) -> RunDevices:
    from gpumagic import cuda
    from pytest_cuda.selection import SelectionError, select_devices
    from pytest_cuda.xdist_pinning import worker_pin

    status = cuda.status()
    request = settings_of(config).device_request
    pin = worker_pin(config)
    if pin is not None:
        scope = f"owned by xdist worker {pin.worker} (--cuda-devices-per-worker={pin.per_worker})"
        return RunDevices(status, status.devices, scope, request, None, pin)
    if remote_only(config):
        # Its workers are on other hosts and pin themselves there: nothing to select here.
        return RunDevices(status, (), "found by each worker on its own host", request, None, None)
    try:
        devices = select_devices(request, status) if request else status.devices
        plan = _plan(config, request, devices, status)
    except SelectionError as exc:
        raise pytest.UsageError(str(exc)) from None
    scope = f"selected by {request.source}" if request else "available"
    return RunDevices(status, devices, scope, request, plan, None)


def _plan(
    config: pytest.Config,
    request: DeviceRequest | None,
    devices: tuple[DeviceInfo, ...],
    status: CudaStatus,
) -> WorkerPlan | None:
    per_worker = settings_of(config).devices_per_worker
    source = pinned_by(config)
    if source is None or not devices or not distributing(config):
        return None
    from pytest_cuda.selection import WorkerPlan, group_devices

    groups = group_devices(devices, per_worker or 1)
    return WorkerPlan(groups, per_worker or 1, status.visible_devices_env, source)


def pinned_by(config: pytest.Config) -> str | None:
    """The option that asks for xdist workers to be pinned (``--cuda-devices=0,1`` as
    given, or ``--cuda-devices-per-worker=N``); ``None``: workers are left alone. Asked
    with or without a GPU: the ``--tx`` specs it cannot go with are refused either way."""
    settings = settings_of(config)
    if settings.device_request is not None:
        return settings.device_request.source
    if settings.devices_per_worker is not None:
        return f"--cuda-devices-per-worker={settings.devices_per_worker}"
    return None


def worker_plan(config: pytest.Config) -> WorkerPlan | None:
    """How the selected devices are shared out to xdist workers (``None``: not at all)."""
    return run_devices(config).plan


def distributing(config: pytest.Config) -> bool:
    """Whether pytest-xdist starts workers (``-n auto`` is asked before it is resolved)."""
    if not config.pluginmanager.has_plugin("xdist"):
        return False
    numprocesses = getattr(config.option, "numprocesses", None)
    return numprocesses in ("auto", "logical") or xdist_workers(config) > 0


def remote_only(config: pytest.Config) -> bool:
    """Whether every xdist worker of this run is on another host (``--tx ssh=…``)."""
    if not distributing(config) or getattr(config.option, "numprocesses", None):
        return False
    specs = [str(spec) for spec in getattr(config.option, "tx", None) or ()]
    return bool(specs) and not any(_local(spec) for spec in specs)


def _local(tx: str) -> bool:
    """Whether a ``--tx`` value (``2*popen//python=…``, ``ssh=host//…``) is local workers."""
    times, star, rest = tx.partition("*")
    spec = rest if star and times.isdigit() else tx
    return any(part.partition("=")[0] == "popen" for part in spec.split("//"))


def xdist_workers(config: pytest.Config) -> int:
    """How many xdist workers this run starts (0 when it does not distribute)."""
    if getattr(config.option, "dist", "no") == "no":
        return 0
    count = 0
    for spec in getattr(config.option, "tx", None) or ():
        times, star, _ = str(spec).partition("*")
        count += int(times) if star and times.isdigit() else 1
    return count


def unavailable(status: CudaStatus) -> str:
    """The reason a test that needs CUDA is skipped where there is none."""
    return f"CUDA unavailable: {status.reason}"


def header_lines(config: pytest.Config) -> list[str]:
    """Versions and the selected devices (one line without a GPU); no CUDA context."""
    run = run_devices(config)
    status = run.status
    remote = []
    if remote_only(config) and pinned_by(config) is not None:
        remote.append(
            f"cuda xdist workers: on other hosts, each pinned to its own host's devices "
            f"({settings_of(config).devices_per_worker or 1} each), listed after the run"
        )
    if not status.available:
        return [f"cuda: {status.summary()}", *remote]
    versions = [f"torch {status.torch_version}", f"CUDA {status.cuda_version}"]
    if status.driver_version:
        versions.append(f"driver {status.driver_version}")
    if status.visible_devices_env is not None:
        versions.append(f"CUDA_VISIBLE_DEVICES={status.visible_devices_env!r}")
    lines = [f"cuda: {', '.join(versions)}", f"cuda devices ({run.scope}):"]
    lines += [f"  cuda:{d.describe()}" for d in run.devices]
    workers = xdist_workers(config)
    lines += remote
    if run.plan is not None and workers:
        lines.append(f"cuda xdist workers ({run.plan.per_worker} device(s) each):")
        lines += [f"  {line}" for line in run.plan.describe(workers)]
    return lines
