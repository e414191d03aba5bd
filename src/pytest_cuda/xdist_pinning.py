"""pytest-xdist glue: each worker gets its own CUDA devices before it starts.

A worker on another host (``--tx ssh=host-b//python=…``) pins itself instead
(:func:`pin_here`, at its configure): the controller cannot see that host's devices,
so it sends only the worker's number among that host's workers, and the worker applies
``--cuda-devices`` and ``--cuda-devices-per-worker`` to the devices it finds there.

The controller writes ``CUDA_VISIBLE_DEVICES`` into every worker's execnet spec (the
``--tx popen//env:NAME=value`` mechanism pytest-xdist's maintainers recommend,
pytest-dev/pytest-xdist#179), so the variable is in the worker's environment before
pytest, any conftest or torch is imported there: nothing in the worker can create a
CUDA context on the wrong device first. A crashed worker is replaced from the same
spec and keeps its devices. Which devices it got travels in ``workerinput`` too, so
the worker can check, before each CUDA test, that nobody changed the variable since.

Registered by :mod:`pytest_cuda.plugin` only when pytest-xdist is active.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, NamedTuple

import pytest

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from execnet import XSpec

    from pytest_cuda.selection import WorkerPlan

__all__ = ["WORKERINPUT_KEY", "WorkerPin", "XdistPinning", "pin_here", "remote_host", "worker_pin"]

WORKERINPUT_KEY = "pytest_cuda"
ENV = "CUDA_VISIBLE_DEVICES"


class WorkerPin(NamedTuple):
    """The devices an xdist worker was started with.

    ``visible_devices`` is the worker's ``CUDA_VISIBLE_DEVICES``; ``devices`` are the
    same devices as the controller numbers them (its ``cuda:i``).
    """

    worker: str
    visible_devices: str
    devices: tuple[int, ...]
    per_worker: int
    #: Why a worker on another host could not pin itself ("": it did).
    problem: str = ""

    def drift(self) -> str | None:
        """Why this worker may no longer be on its devices (or never was), ``None``
        while it is."""
        if self.problem:
            return self.problem
        now = os.environ.get(ENV)
        if now == self.visible_devices:
            return None
        from gpumagic import cuda

        state = (
            "CUDA is already initialised on those devices"
            if cuda.is_initialized()
            else "CUDA would start on the wrong devices"
        )
        return (
            f"xdist worker {self.worker} was pinned to {ENV}={self.visible_devices!r} "
            f"by pytest_cuda, but it is {now!r} now (changed by a conftest, plugin or "
            f"test in this worker): {state}; remove the code that sets {ENV}, or drop "
            "--cuda-devices/--cuda-devices-per-worker and pin workers yourself"
        )


def remote_host(spec: XSpec) -> str:
    """The host of a worker that is not a local (``popen``) one: ``ssh=host-b``."""
    for kind in ("ssh", "socket", "vagrant_ssh"):
        value = getattr(spec, kind, None)
        if value:  # ssh's options before the host left out: ssh=user@host-b
            return f"{kind}={str(value).split()[-1]}"
    return str(spec)


def pin_here(config: pytest.Config) -> None:
    """In a worker on another host: pin this worker to its share of this host's
    devices, found here (NVML; no CUDA context), with ``--cuda-devices`` and
    ``--cuda-devices-per-worker`` as this host sees them, before anything may start
    CUDA; its devices go back to the controller for the run's summary."""
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    data = (workerinput or {}).get(WORKERINPUT_KEY)
    if not data or "host" not in data or "visible_devices" in data:
        return
    import socket

    from gpumagic import cuda
    from pytest_cuda.selection import (
        SelectionError,
        group_devices,
        select_devices,
        visible_devices_value,
    )
    from pytest_cuda.settings import settings_of

    # A worker that cannot pin itself fails its CUDA tests with the reason (raised here,
    # the error would end the worker, and xdist would start it again and again).
    where = f"xdist worker {data['worker']} on {socket.gethostname()} ({data['host']})"
    data.update(visible_devices="", devices=[])
    if cuda.is_initialized():
        data["problem"] = (
            f"{where}: CUDA was initialised before the worker could pin itself (a conftest "
            "or plugin used CUDA at import); move that into a fixture"
        )
        return
    status = cuda.status()
    request = settings_of(config).device_request
    try:
        devices = select_devices(request, status) if request else status.devices
        groups = group_devices(devices, int(data["per_worker"])) if devices else ()
    except SelectionError as exc:
        data["problem"] = f"{where}: {exc}"
        return
    group = groups[int(data["slot"]) % len(groups)] if groups else ()
    value = visible_devices_value(group, status.visible_devices_env) if group else ""
    if group:
        os.environ[ENV] = value
        cuda.reset_status_cache()
    data.update(visible_devices=value, devices=[d.index for d in group])
    owned = ", ".join(f"cuda:{d.index} {d.name}" for d in group) or f"none ({status.summary()})"
    line = f"{data['worker']} on {socket.gethostname()} ({data['host']}) → {owned}"
    if group:
        line += f" ({ENV}={value})"
    workeroutput: dict[str, Any] = getattr(config, "workeroutput", {})
    workeroutput[WORKERINPUT_KEY] = {"worker": data["worker"], "line": line}


def worker_pin(config: pytest.Config) -> WorkerPin | None:
    """This process's pin when it is an xdist worker started by :class:`XdistPinning`."""
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    if not workerinput or WORKERINPUT_KEY not in workerinput:
        return None
    data = workerinput[WORKERINPUT_KEY]
    if "host" in data and not (data.get("visible_devices") or data.get("problem")):
        return None  # a remote worker on a host without a usable device: left alone
    return WorkerPin(
        worker=str(data["worker"]),
        visible_devices=str(data["visible_devices"]),
        devices=tuple(int(i) for i in data["devices"]),
        per_worker=int(data["per_worker"]),
        problem=str(data.get("problem", "")),
    )


class XdistPinning:
    """Controller-side xdist hooks: worker count for ``-n auto``, a device group per worker.

    ``plan_for(config)`` answers the run's :class:`~pytest_cuda.selection.WorkerPlan`,
    or ``None`` when no devices were asked for or none is there (then workers are left
    alone); ``pinned_by(config)`` the option that asked for pinning (``None``: none did),
    whose ``--tx`` conflicts are usage errors with or without a GPU.
    """

    def __init__(
        self,
        plan_for: Callable[[pytest.Config], WorkerPlan | None],
        pinned_by: Callable[[pytest.Config], str | None],
    ) -> None:
        self._plan_for = plan_for
        self._pinned_by = pinned_by
        self._slots: dict[int, int] = {}
        #: Each remote spec's host and its number among that host's workers.
        self._remote: dict[int, tuple[str, int]] = {}
        #: What the remote workers said they pinned themselves to (at their end).
        self._pinned_remotely: list[dict[str, Any]] = []

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_auto_num_workers(self, config: pytest.Config) -> int | None:
        """``-n auto`` with ``--cuda-devices``: one worker per device group."""
        plan = self._plan_for(config)
        return len(plan.groups) if plan is not None else None

    def pytest_xdist_setupnodes(self, config: pytest.Config, specs: Sequence[XSpec]) -> None:
        source = self._pinned_by(config)
        if source is None:
            return
        # Checked before the plan: the same run is refused on a machine without a GPU,
        # where there is nothing to pin (it passed silently there; issue 39).
        for spec in specs:
            if ENV in spec.env:
                raise pytest.UsageError(
                    f"{spec!r} sets {ENV} itself, and {source} would pin the "
                    "workers too; use one of them"
                )
        # A worker on another host pins itself, to that host's devices (issue 40): it
        # gets its number among the workers of its host (pytest_configure_node).
        per_host: dict[str, int] = {}
        for spec in specs:
            if not spec.popen:
                host = remote_host(spec)
                slot = per_host.get(host, 0)
                per_host[host] = slot + 1
                self._remote[id(spec)] = (host, slot)
        local = [spec for spec in specs if spec.popen]
        plan = self._plan_for(config) if local else None
        if plan is None:
            return
        for slot, spec in enumerate(local):
            spec.env[ENV] = plan.visible_devices(slot)
            self._slots[id(spec)] = slot

    def pytest_configure_node(self, node: Any) -> None:  # xdist's WorkerController
        # A replaced worker is set up from the same spec object: same slot, same devices.
        spec = node.gateway.spec
        if id(spec) in self._remote:
            host, slot = self._remote[id(spec)]
            per_worker = node.config.option.cuda_devices_per_worker or 1
            node.workerinput[WORKERINPUT_KEY] = {
                "worker": node.gateway.id,
                "host": host,
                "slot": slot,
                "per_worker": per_worker,
            }
            return
        local = self._slots.get(id(spec))
        plan = self._plan_for(node.config)
        if local is None or plan is None:
            return
        node.workerinput[WORKERINPUT_KEY] = {
            "worker": node.gateway.id,
            "visible_devices": plan.visible_devices(local),
            "devices": [d.index for d in plan.group(local)],
            "per_worker": plan.per_worker,
        }

    def pytest_testnodedown(self, node: Any, error: object) -> None:
        found = getattr(node, "workeroutput", {}).get(WORKERINPUT_KEY)
        if found:
            self._pinned_remotely.append(found)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        """The devices each worker on another host pinned itself to."""
        if not self._pinned_remotely:
            return
        terminalreporter.section("cuda devices of xdist workers on other hosts")
        for found in sorted(self._pinned_remotely, key=lambda f: int(f["worker"][2:] or 0)):
            terminalreporter.line(str(found["line"]))
