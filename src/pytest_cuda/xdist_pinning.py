"""pytest-xdist glue: each worker gets its own CUDA devices before it starts.

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

__all__ = ["WORKERINPUT_KEY", "WorkerPin", "XdistPinning", "worker_pin"]

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

    def drift(self) -> str | None:
        """Why this worker may no longer be on its devices, ``None`` while it is."""
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


def worker_pin(config: pytest.Config) -> WorkerPin | None:
    """This process's pin when it is an xdist worker started by :class:`XdistPinning`."""
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    if not workerinput or WORKERINPUT_KEY not in workerinput:
        return None
    data = workerinput[WORKERINPUT_KEY]
    return WorkerPin(
        worker=str(data["worker"]),
        visible_devices=str(data["visible_devices"]),
        devices=tuple(int(i) for i in data["devices"]),
        per_worker=int(data["per_worker"]),
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
            if not spec.popen:
                raise pytest.UsageError(
                    f"{source} pins local workers only, and {spec!r} is not a popen "
                    f"worker; drop {source} or set {ENV} with --tx …//env:{ENV}=…"
                )
            if ENV in spec.env:
                raise pytest.UsageError(
                    f"{spec!r} sets {ENV} itself, and {source} would pin the "
                    "workers too; use one of them"
                )
        plan = self._plan_for(config)
        if plan is None:
            return
        for slot, spec in enumerate(specs):
            spec.env[ENV] = plan.visible_devices(slot)
            self._slots[id(spec)] = slot

    def pytest_configure_node(self, node: Any) -> None:  # xdist's WorkerController
        # A replaced worker is set up from the same spec object: same slot, same devices.
        slot = self._slots.get(id(node.gateway.spec))
        plan = self._plan_for(node.config)
        if slot is None or plan is None:
            return
        node.workerinput[WORKERINPUT_KEY] = {
            "worker": node.gateway.id,
            "visible_devices": plan.visible_devices(slot),
            "devices": [d.index for d in plan.group(slot)],
            "per_worker": plan.per_worker,
        }
