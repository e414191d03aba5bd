"""pytest_cuda's hooks: device selection, the ``cuda`` marker, device fixtures, strict mode.

Loaded through the ``pytest11`` entry point as ``cuda`` (``-p no:cuda`` turns it off,
with the modules in :data:`MODE_PLUGINS`). Free when unused: importing it imports
neither torch nor NVML, and a run whose tests use no CUDA feature does no discovery at
all. Discovery (:mod:`pytest_cuda.run_devices`: NVML and torch's version file, no
torch import, no CUDA context) runs when devices are asked for, when xdist workers
start, or after collection when some test carries the ``cuda`` marker or a device
fixture; torch is imported only when a test takes a device fixture. Options are read
through :func:`pytest_cuda.settings.settings_of`.

Public API for the other pytest_cuda modules:

* :func:`selected_devices` — the devices this process's tests may use;
* :func:`cuda_requirement` — what a test's ``cuda`` markers (or device fixtures) ask;
* :func:`item_devices` — the devices one test is given;
* :func:`~pytest_cuda.collection.marker_names` — the markers a collection uses anywhere
  (one look per node; kept in a leaf module that the loaded modules share).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

from pytest_cuda.collection import marker_names
from pytest_cuda.distributed import plugin as distributed_plugin
from pytest_cuda.distributed.ranks import MARKER as DISTRIBUTED
from pytest_cuda.distributed.ranks import RANK_DEVICES, devices_needed, rank_devices
from pytest_cuda.leaks import plugin as leak_plugin
from pytest_cuda.options import (
    DISTRIBUTED_MODE,
    LEAK_MODE,
    MARKER_LINES,
    SYNC_MODE,
    add_options,
)
from pytest_cuda.run_devices import (
    RunDevices,
    asked_for_devices,
    distributing,
    header_lines,
    pinned_by,
    run_devices,
    unavailable,
    worker_plan,
)
from pytest_cuda.settings import settings_of
from pytest_cuda.sync import plugin as sync_plugin

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence
    from types import ModuleType

    import torch  # noqa: TID251 -- annotations only: the fixtures return torch.device
    from _pytest.config.argparsing import Parser

    from gpumagic.devices import DeviceInfo
    from pytest_cuda.distributed.ranks import DistributedSpec
    from pytest_cuda.markers import CudaRequirement
    from pytest_cuda.xdist_pinning import WorkerPin

# The seam (gpumagic.cuda), the marker and selection logic are imported where they are
# first needed: pytest imports this module on every run, CUDA tests or not.

__all__ = ["cuda_requirement", "item_devices", "marker_names", "selected_devices"]

#: Opt-in modes of the other pytest_cuda families (leak checks, sync/debug modes,
#: multi-rank tests), each under a fixed plugin name: loaded with this module, so ``-p
#: no:cuda`` turns them all off, and ``-p no:pytest_cuda.sync_plugin`` turns one off
#: (the names the modules had before they moved into their folders).
MODE_PLUGINS: dict[str, ModuleType] = {
    LEAK_MODE: leak_plugin,
    SYNC_MODE: sync_plugin,
    DISTRIBUTED_MODE: distributed_plugin,
}

DEVICE_FIXTURES = ("cuda_device", "cuda_devices")
_MARKERS = frozenset({"cuda", DISTRIBUTED})
_DEVICE_FIXTURE_SET = frozenset(DEVICE_FIXTURES)


_HEADER_SHOWN = pytest.StashKey[bool]()
_USES_CUDA = pytest.StashKey[bool]()
_ANY_CUDA = pytest.StashKey[bool]()
SETUP_NAME = "cuda.setup"


def pytest_plugin_registered(plugin: object, manager: pytest.PytestPluginManager) -> None:
    if getattr(plugin, "__name__", None) == __name__:
        # This module, just registered. Not ``pytest_plugins``: for each name there
        # pytest first reads the entry points of every installed distribution (2 ms
        # per name with 100 of them), on every run.
        for name, module in MODE_PLUGINS.items():
            if not manager.is_registered(module):
                manager.register(module, name)  # None where -p no: blocked it
        manager.register(CudaTestSetup(), SETUP_NAME)
        config = manager.get_plugin("pytestconfig")
        if isinstance(config, pytest.Config):  # loaded by a conftest, after the options
            _pin_workers(config)


def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    _pin_workers(early_config)


def _pin_workers(config: pytest.Config) -> None:
    """Register the xdist hooks where xdist is to start workers (``-n``, ``--tx``).

    Once the options are read and before ``pytest_cmdline_main``, where ``-n auto``
    asks ``pytest_xdist_auto_num_workers`` for the number of workers.
    """
    namespace = getattr(config, "known_args_namespace", None)  # None: not read yet
    if not (getattr(namespace, "numprocesses", None) or getattr(namespace, "tx", None)):
        return
    manager = config.pluginmanager
    if manager.has_plugin("xdist") and not manager.has_plugin("cuda.xdist"):
        from pytest_cuda.xdist_pinning import XdistPinning

        manager.register(XdistPinning(worker_plan, pinned_by), "cuda.xdist")


def pytest_addoption(parser: Parser) -> None:
    add_options(parser)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from pytest_cuda import hooks

    pluginmanager.add_hookspecs(hooks)


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKER_LINES:
        config.addinivalue_line("markers", line)
    settings = settings_of(config)  # built and checked now, if no mode has yet
    if hasattr(config, "workerinput"):  # an xdist worker on another host pins itself
        from pytest_cuda.xdist_pinning import pin_here

        pin_here(config)
    if settings.resume_dir:  # a child of another session, whichever modes are on
        from pytest_cuda.child import run_as_child

        run_as_child(config, Path(settings.resume_dir))
    if asked_for_devices(config):
        # Asked-for devices are checked now, so a bad selection stops the run at once.
        run_devices(config)
    if settings.require:
        # A GPU job whose runner lost its GPU fails at once, whatever its tests are.
        run = run_devices(config)
        if not run.devices:
            why = unavailable(run.status) if not run.status.available else "no device selected"
            raise pytest.UsageError(f"--cuda-require: no usable CUDA device here: {why}")


def pytest_report_header(config: pytest.Config) -> list[str]:
    # Discovery costs tens of ms (NVML's start-up): paid here only where devices were
    # asked for or workers start; otherwise after collection, if any test uses CUDA.
    if not (asked_for_devices(config) or distributing(config)):
        return []
    config.stash[_HEADER_SHOWN] = True
    return header_lines(config)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # One look at each test (after deselection) serves the header and every setup; the
    # markers are looked up per test only where some node carries a ``cuda`` marker.
    marked = not _MARKERS.isdisjoint(marker_names(config, items))
    uses = [_uses_cuda(item, marked) for item in items]
    any_cuda = any(uses)
    config.stash[_ANY_CUDA] = any_cuda
    manager = config.pluginmanager
    setup = manager.get_plugin(SETUP_NAME)
    if not any_cuda:
        # No test here uses CUDA: no check before each one.
        if setup is not None:
            manager.unregister(setup)
        return
    if setup is None and not manager.is_blocked(SETUP_NAME):
        manager.register(CudaTestSetup(), SETUP_NAME)  # a second collection that does
    for item, used in zip(items, uses, strict=True):
        item.stash[_USES_CUDA] = used


def pytest_report_collectionfinish(config: pytest.Config) -> list[str]:
    if config.stash.get(_HEADER_SHOWN, False) or not config.stash.get(_ANY_CUDA, False):
        return []
    return header_lines(config)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cuda_device" not in metafunc.fixturenames:
        return
    if "cuda_device" not in _ours(metafunc._arg2fixturedefs, ("cuda_device",)):
        return  # the user's own cuda_device fixture: theirs to parametrize
    run = run_devices(metafunc.config)
    # A pinned xdist worker hands out its own device; every worker must collect the
    # same tests, so none of them parametrizes.
    if run.pin is not None or not run.devices:
        return
    metafunc.parametrize(
        "cuda_device",
        run.devices,
        ids=[f"cuda:{d.index}" for d in run.devices],
        indirect=True,
    )


class CudaTestSetup:
    """Before each test: skip it (fail it under ``--cuda-require``) when its ``cuda``
    needs are not met here. Registered with this module; unregistered after collection
    when no collected test uses CUDA, so such a run pays nothing per test."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        _check_before(item)


def _check_before(item: pytest.Item) -> None:
    uses = item.stash.get(_USES_CUDA, None)
    if not (_uses_cuda(item) if uses is None else uses):
        return  # the common case, kept cheap: no marker parsing, no discovery
    from pytest_cuda.markers import MarkerError

    try:
        requirement = cuda_requirement(item)
    except MarkerError as exc:
        malformed = f"malformed @pytest.mark.{exc.marker} on {item.nodeid}: {exc}"
    else:
        malformed = ""
    if malformed:
        pytest.fail(malformed, pytrace=False)
    if item.get_closest_marker(DISTRIBUTED) is not None:
        _check_backend(item)
    if requirement is None:
        return
    run = run_devices(item.config)
    if run.pin is not None and (drift := run.pin.drift()) is not None:
        pytest.fail(drift, pytrace=False)
    reason = _unmet(run, requirement, item)
    if reason is None:
        spec = _distributed_spec(item)
        if spec is not None and spec.uses_cuda:
            selected = [d.index for d in run.devices]
            item.stash[RANK_DEVICES] = rank_devices(item.config, spec, selected)
        return
    if (
        run.pin is not None
        and requirement.min_devices > run.pin.per_worker
        and item.get_closest_marker(DISTRIBUTED) is not None
    ):
        pytest.fail(_per_worker_usage(requirement.min_devices, run.pin, reason), pytrace=False)
    if settings_of(item.config).require or not item.config.pluginmanager.has_plugin("skipping"):
        _skip_or_fail(item.config, reason)
    # Skipped by a mark, the skip is reported at the test's own line (as skipif is),
    # not at this hook's; pytest's skipping hook runs after this tryfirst one.
    item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def cuda_device(request: pytest.FixtureRequest) -> torch.device:
    """A CUDA device for this test, as a ``torch.device``.

    Without pytest-xdist the test runs once per selected device (``--cuda-devices``,
    default: every visible device), with ids ``cuda:0``, ``cuda:1``; under xdist it is
    the worker's own first device. Skips (fails under ``--cuda-require``) when there
    is no usable GPU.
    """
    device: DeviceInfo | None = getattr(request, "param", None)
    if device is None:
        run = run_devices(request.config)
        if not run.devices:
            _skip_or_fail(request.config, unavailable(run.status))
        device = run.devices[0]
    from gpumagic import cuda

    return cuda.torch_device(device.index)


@pytest.fixture
def cuda_devices(request: pytest.FixtureRequest) -> list[torch.device]:
    """Every selected CUDA device (an xdist worker's own), as ``torch.device`` objects.

    Skips (fails under ``--cuda-require``) when there is no usable GPU, or fewer
    devices than the test's ``cuda(min_devices=N)`` marker asks.
    """
    run = run_devices(request.config)
    if not run.devices:
        _skip_or_fail(request.config, unavailable(run.status))
    from gpumagic import cuda

    return [cuda.torch_device(d.index) for d in run.devices]


# ---------------------------------------------------------------------------
# The public API.


def selected_devices(config: pytest.Config) -> tuple[DeviceInfo, ...]:
    """The CUDA devices this process's tests may use, numbered as torch sees them here.

    ``--cuda-devices`` (ini ``cuda_devices``, env ``PYTEST_CUDA_DEVICES``) picks them,
    default every visible device; in an xdist worker pinned by pytest_cuda, the
    worker's own devices. Empty without a usable GPU. Discovery runs once per config
    and creates no CUDA context; a bad selection raises :class:`pytest.UsageError`.
    """
    return run_devices(config).devices


def cuda_requirement(item: pytest.Item) -> CudaRequirement | None:
    """What ``item`` asks of the GPU, ``None`` for a test that does not use CUDA.

    Its ``cuda`` markers merged (the strictest value of each keyword wins); a
    ``cuda_distributed`` test on a GPU backend needs one device per rank; a test that
    takes ``cuda_device`` or ``cuda_devices`` without a marker needs one device.
    Raises :class:`~pytest_cuda.markers.MarkerError` for a malformed marker.
    """
    from pytest_cuda.markers import CudaRequirement, merge_requirements, parse_cuda_marker

    found = [parse_cuda_marker(mark.args, mark.kwargs) for mark in item.iter_markers("cuda")]
    spec = _distributed_spec(item)
    if spec is not None and spec.uses_cuda:
        found.append(CudaRequirement(min_devices=devices_needed(item.config, spec)))
    requirement = merge_requirements(found)
    if requirement is None and _our_device_fixtures(item):
        return CudaRequirement()
    return requirement


def item_devices(item: pytest.Item) -> tuple[DeviceInfo, ...]:
    """The devices ``item`` is given: its ``cuda_device`` parameter, else every selected one."""
    param = _device_param(item)
    return (param,) if param is not None else selected_devices(item.config)


# ---------------------------------------------------------------------------
# Inside.


def _distributed_spec(item: pytest.Item) -> DistributedSpec | None:
    mark = item.get_closest_marker(DISTRIBUTED)
    if mark is None:
        return None
    from pytest_cuda.distributed.ranks import parse_distributed_marker
    from pytest_cuda.markers import MarkerError

    try:
        return parse_distributed_marker(mark.args, mark.kwargs)
    except ValueError as exc:
        raise MarkerError(str(exc), DISTRIBUTED) from None


def _check_backend(item: pytest.Item) -> None:
    """A backend torch does not know is a usage error, on any machine (a typo must not
    read as "no GPU here")."""
    spec = _distributed_spec(item)
    if spec is None:  # pragma: no cover - the caller saw the marker
        return
    from gpumagic import cuda

    unknown = cuda.unknown_backends(spec.backend)
    if unknown:
        names = ", ".join(repr(name) for name in unknown)
        known = ", ".join(cuda.known_backends())
        pytest.fail(
            f"usage: @pytest.mark.{DISTRIBUTED}(backend={spec.backend!r}) on {item.nodeid}: "
            f"torch does not know the backend {names}; it knows {known} (in any case)",
            pytrace=False,
        )


def _per_worker_usage(world_size: int, pin: WorkerPin, reason: str) -> str:
    return (
        f"usage: a cuda_distributed test with world_size={world_size} needs "
        f"--cuda-devices-per-worker={world_size} or more under pytest-xdist; xdist worker "
        f"{pin.worker} owns {pin.per_worker} ({reason}). Give each worker its ranks' "
        f"devices (-n <workers> --cuda-devices-per-worker={world_size}), or run the "
        "distributed tests without -n."
    )


def _uses_cuda(item: pytest.Item, marked: bool = True) -> bool:
    """A ``cuda`` marker or a device fixture (cheap: no marker parsing, no discovery).

    ``marked=False``: no node of the run carries a ``cuda`` marker (:func:`marker_names`).
    """
    if marked and (
        item.get_closest_marker("cuda") is not None
        or item.get_closest_marker(DISTRIBUTED) is not None
    ):
        return True
    return bool(_our_device_fixtures(item))


def _our_device_fixtures(item: pytest.Item) -> frozenset[str]:
    """The device fixtures ``item`` takes that are this plugin's: a fixture of the same
    name in the user's conftest or module overrides ours, as pytest's rules say, and
    then asks nothing of the GPU."""
    names = _DEVICE_FIXTURE_SET.intersection(getattr(item, "fixturenames", ()))
    if not names:
        return frozenset()
    info = getattr(item, "_fixtureinfo", None)
    return _ours(getattr(info, "name2fixturedefs", {}), names)


def _ours(definitions: Mapping[str, Sequence[Any]], names: Iterable[str]) -> frozenset[str]:
    """Of ``names``, those whose closest fixture definition is this module's."""
    found = set()
    for name in names:
        defs = definitions.get(name)
        func = getattr(defs[-1], "func", None) if defs else None
        if defs is None or getattr(func, "__module__", __name__) == __name__:
            found.add(name)
    return frozenset(found)


def _unmet(run: RunDevices, requirement: CudaRequirement, item: pytest.Item) -> str | None:
    if not run.status.available:
        return unavailable(run.status)
    param = _device_param(item)
    checked = (param,) if param is not None else run.devices[: requirement.min_devices]
    from pytest_cuda.markers import unmet_reason

    return unmet_reason(requirement, run.devices, checked, _free_memory, scope=run.scope)


def _device_param(item: pytest.Item) -> DeviceInfo | None:
    callspec = getattr(item, "callspec", None)
    param: DeviceInfo | None = callspec.params.get("cuda_device") if callspec else None
    return param


def _free_memory(device: DeviceInfo) -> int | None:
    from gpumagic import cuda

    try:
        return cuda.nvml_memory_info(device).free
    except cuda.CudaUnavailable:
        return None


def _skip_or_fail(config: pytest.Config, reason: str) -> NoReturn:
    if settings_of(config).require:
        pytest.fail(f"{reason} (--cuda-require turns this skip into an error)", pytrace=False)
    pytest.skip(reason)
