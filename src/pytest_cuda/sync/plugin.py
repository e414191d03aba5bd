"""Debugging asynchronous CUDA errors: synchronous modes, poisoned contexts, hidden syncs.

A CUDA kernel's error surfaces at some later CUDA call, not at the line that launched
it; a device-side assert leaves the process's context unusable, so every later CUDA
test fails too. This plugin (loaded with :mod:`pytest_cuda.plugin`; ``-p
no:pytest_cuda.sync_plugin`` turns it off alone):

* ``--cuda-sync=launch-blocking`` sets ``CUDA_LAUNCH_BLOCKING=1`` before any conftest
  can create a context, ``--cuda-sync=per-op`` / ``@pytest.mark.cuda_sync``
  synchronize after every torch op, so the error is raised at its line;
* after each test that used CUDA it checks the context (one device synchronize), blames
  the test that left a sticky error and, by default, runs the remaining tests in a
  fresh process whose results join this report (``--cuda-on-poison``); an xdist worker
  is replaced instead, and the culprit is reported once;
* ``--cuda-rerun-blocking`` re-runs a CUDA failure alone with blocking launches to
  find its real line; every CUDA failure carries a repro command;
* ``@pytest.mark.cuda_no_sync`` and the ``cuda_no_sync`` fixture fail a test whose code
  makes the host wait for the GPU implicitly.

CUDA is touched only through :mod:`gpumagic.cuda`, and only in processes where torch
has initialised CUDA (or where the user asked for a CUDA check). pytest imports this
module on every run, so it holds the options, markers, fixture and configuration only:
the per-test hooks are in :mod:`pytest_cuda.sync.checks`, imported and registered when
they have work (a sync mode asked for, a CUDA library imported, an option given).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import pytest

from pytest_cuda.collection import marker_names
from pytest_cuda.sync.poison_report import (
    LAUNCH_BLOCKING,
    NOTES,
    SUMMARY_NAME,
    Action,
    PoisonSummary,
)

if TYPE_CHECKING:
    import contextlib
    from collections.abc import Callable

    from gpumagic import cuda
    from pytest_cuda.sync.checks import PhaseChecks

__all__ = [
    "PoisonGuard",
]


class DebugOptions(NamedTuple):
    """This process's debug options, checked once in ``pytest_configure``."""

    sync: str | None
    on_poison: str
    rerun_blocking: bool
    action: Action
    #: This process is a child running some of a parent session's tests.
    resume: Path | None
    #: ... and re-runs one failing test with blocking launches.
    rerun: bool
    downgraded: str | None = None


_OPTIONS = pytest.StashKey[DebugOptions]()

#: Libraries that run CUDA work and whose CUDA errors
#: :func:`gpumagic.cuda_errors.classify` recognises. The checks after each test phase start
#: when one of them is imported (or an option of this plugin is given): until then no
#: test of this process has run CUDA work through them, and the health check itself
#: needs torch.
CUDA_LIBRARIES = frozenset({"torch", "cupy", "numba", "cuda", "pycuda", "jax"})

#: The plugins registered when they have something to do.
CHECKS_NAME = "cuda.poison-checks"


# ---------------------------------------------------------------------------
# --cuda-sync=launch-blocking: before any conftest is imported.


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    namespace = early_config.known_args_namespace
    if getattr(namespace, "cuda_sync", None) != "launch-blocking":
        return
    from gpumagic import cuda

    previous = os.environ.get(LAUNCH_BLOCKING)
    if previous != "1" and cuda.is_initialized():
        raise pytest.UsageError(
            "--cuda-sync=launch-blocking: CUDA was initialised in this process before "
            "pytest_cuda could set CUDA_LAUNCH_BLOCKING=1 (a plugin given with -p or "
            "installed with an entry point created a CUDA context when imported), so "
            "kernel launches would stay asynchronous. Set CUDA_LAUNCH_BLOCKING=1 in the "
            "environment instead, or keep that plugin from touching CUDA at import."
        )
    os.environ[LAUNCH_BLOCKING] = "1"
    early_config.add_cleanup(functools.partial(_restore_env, LAUNCH_BLOCKING, previous))


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


# ---------------------------------------------------------------------------
# Configuration: check the options, register what is switched on.

XDIST_STOPS = "3.6.1"  # the first pytest-xdist whose workers honour session.shouldstop


def pytest_configure(config: pytest.Config) -> None:
    options = _options(config)
    config.stash[_OPTIONS] = options
    config.stash[NOTES] = {}
    manager = config.pluginmanager
    if _is_xdist_controller(config):
        from pytest_cuda.sync.checks import XdistCulprits

        manager.register(XdistCulprits(), "cuda.poison-xdist")
    else:
        guard = PoisonGuard(config, options)
        manager.register(guard, "cuda.poison")
        if _asked_for_checks(config, options) or _cuda_library_imported():
            guard.start_checking()
        else:
            guard.watch_imports()
    # A child of another session (options.resume) runs its share of that session's tests
    # (pytest_cuda.child, registered by pytest_cuda's own plugin): the parent sums up.
    no_parent = options.resume is None and not hasattr(config, "workerinput")
    if no_parent and not _is_xdist_controller(config):
        manager.register(PoisonSummary(), SUMMARY_NAME)
    if options.sync == "per-op":
        _register_sync_modes(config)


def _options(config: pytest.Config) -> DebugOptions:
    sync: str | None = config.getoption("cuda_sync")
    given: str | None = config.getoption("cuda_on_poison")
    rerun_blocking: bool = config.getoption("cuda_rerun_blocking")
    resume_dir: str | None = config.getoption("cuda_internal_resume")
    rerun: bool = config.getoption("cuda_internal_rerun")
    resume = Path(resume_dir) if resume_dir else None
    if rerun:
        rerun_blocking = False
    elif rerun_blocking and sync == "launch-blocking":
        raise pytest.UsageError(
            "--cuda-rerun-blocking re-runs CUDA failures with CUDA_LAUNCH_BLOCKING=1, which "
            "--cuda-sync=launch-blocking already sets for the whole run: use one of them."
        )
    debugging = bool(config.getoption("usepdb", False) or config.getoption("trace", False))
    on_poison = given or "continue"
    downgraded = None
    if debugging and on_poison == "continue" and resume is None:
        if given:
            raise pytest.UsageError(
                "--cuda-on-poison=continue runs the remaining tests in a fresh process, "
                "where --pdb/--trace cannot reach them: use --cuda-on-poison=stop or skip."
            )
        on_poison, downgraded = "stop", "stop (continue is not possible under --pdb/--trace)"
    if on_poison == "stop" and _is_xdist_controller(config):
        _check_xdist_stops()
    action = cast("Action", on_poison)
    if resume is not None:
        action = "stop-child"
    elif hasattr(config, "workerinput") and on_poison == "continue":
        action = "replace-worker"
    return DebugOptions(sync, on_poison, rerun_blocking, action, resume, rerun, downgraded)


def _check_xdist_stops() -> None:
    """``--cuda-on-poison=stop`` under ``-n`` sets ``session.shouldstop`` in a worker,
    which pytest-xdist acts on from 3.6.1 (pytest-dev/pytest-xdist#1024); before, the
    workers ran on in the poisoned process."""
    from packaging.version import Version

    installed = str(getattr(importlib.import_module("xdist"), "__version__", "0"))
    if Version(installed) < Version(XDIST_STOPS):
        raise pytest.UsageError(
            f"--cuda-on-poison=stop under pytest-xdist needs pytest-xdist {XDIST_STOPS} or "
            f"later (earlier workers do not stop the run); {installed} is installed: "
            f"upgrade it (pip install 'pytest-xdist>={XDIST_STOPS}') or run without -n"
        )


def _asked_for_checks(config: pytest.Config, options: DebugOptions) -> bool:
    """An option of this plugin is given (or this process runs a parent's tests)."""
    return bool(
        options.sync
        or options.rerun_blocking
        or options.resume is not None
        or config.getoption("cuda_on_poison")
    )


def _is_xdist_controller(config: pytest.Config) -> bool:
    return (
        not hasattr(config, "workerinput")
        and getattr(config.option, "dist", "no") != "no"
        and not config.getoption("collectonly")
    )


def _register_sync_modes(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin("cuda.sync-modes"):
        from pytest_cuda.sync.checks import SyncModes

        per_op = config.stash[_OPTIONS].sync == "per-op"
        config.pluginmanager.register(SyncModes(config, per_op_all=per_op), "cuda.sync-modes")


def pytest_report_header(config: pytest.Config) -> list[str]:
    options = config.stash[_OPTIONS]
    parts = []
    if options.sync == "launch-blocking":
        parts.append("--cuda-sync=launch-blocking (CUDA_LAUNCH_BLOCKING=1)")
    elif options.sync == "per-op":
        parts.append("--cuda-sync=per-op (synchronize after every torch op)")
    if options.downgraded:
        parts.append(f"--cuda-on-poison={options.downgraded}")
    elif config.getoption("cuda_on_poison"):
        parts.append(f"--cuda-on-poison={options.on_poison}")
    if options.rerun_blocking:
        parts.append("--cuda-rerun-blocking")
    if not parts:
        return []
    from gpumagic import cuda

    lines = ["cuda debug: " + ", ".join(parts)]
    status = cuda.status()
    if not status.available:
        lines.append(f"cuda debug: these have no effect here: CUDA unavailable: {status.reason}")
    return lines


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The markers switch the sync modes on for their tests only; a run without them
    # pays nothing per test.
    if not marker_names(config, items).isdisjoint(("cuda_sync", "cuda_no_sync")):
        _register_sync_modes(config)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    for line in config.stash.get(NOTES, {}):
        terminalreporter.write_line(f"cuda debug: {line}", yellow=True)


# ---------------------------------------------------------------------------
# The implicit-sync check for a block (the markers' modes are in sync_checks).


@pytest.fixture
def cuda_no_sync(
    request: pytest.FixtureRequest,
) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """Forbid implicit host-device synchronization in a block: ``with cuda_no_sync(): ...``.

    Inside the block, an op that makes the host wait for the GPU (``.item()``,
    ``.cpu()``, ``nonzero()``, ``bool(tensor)``, boolean-mask indexing...) fails the
    test with the op and the line. Uses ``torch.cuda.set_sync_debug_mode("error")`` and
    restores the previous mode. Not seen: explicit ``torch.cuda.synchronize()`` or
    ``Event``/``Stream.synchronize()``, syncs outside torch (CuPy, extensions), and the
    ops torch's prototype mode misses (``torch.distributed``, ``torch.sparse``). The
    mode is process-wide while the block runs. Without CUDA the block checks nothing
    and the run ends with a note. ``@pytest.mark.cuda_no_sync`` covers a whole test.
    """
    from pytest_cuda.sync.checks import no_implicit_sync

    return functools.partial(no_implicit_sync, request.config)


# ---------------------------------------------------------------------------
# Poisoned contexts: the guard, registered in every process that runs tests.


def _cuda_library_imported() -> bool:
    return not CUDA_LIBRARIES.isdisjoint(sys.modules)


class PoisonGuard:
    """After each test phase that ran with a CUDA context: is the context still usable?

    The check is one device synchronize (:func:`gpumagic.cuda.async_error`) and is
    skipped entirely in processes where torch has not initialised CUDA. The hooks that
    run it after each phase and give a CUDA failure its repro command
    (:class:`~pytest_cuda.sync.checks.PhaseChecks`) are registered once they can
    matter: when an option of this plugin is given, the check is swapped, or one of
    :data:`CUDA_LIBRARIES` is imported (a :class:`CudaImportWatch` sees the first
    import). A run that never imports one pays nothing per test.

    When a test imports the first of them itself, the checks start in the middle of
    that test: the phase that imports it runs without the check after it (its report
    still gets the notes), and the test is checked after its teardown.
    """

    def __init__(self, config: pytest.Config, options: DebugOptions) -> None:
        self.config = config
        self.options = options
        self._check: Callable[[], cuda.AsyncCudaError | None] | None = None
        self.checks: PhaseChecks | None = None
        self._watch: CudaImportWatch | None = None

    @property
    def check(self) -> Callable[[], cuda.AsyncCudaError | None]:
        """The health check; tests swap it to simulate a sticky error without a GPU."""
        if self._check is None:
            from gpumagic import cuda

            self._check = cuda.async_error
        return self._check

    @check.setter
    def check(self, check: Callable[[], cuda.AsyncCudaError | None]) -> None:
        self._check = check
        self.start_checking()  # a swapped check is called whether torch is imported or not

    def run_check(self) -> cuda.AsyncCudaError | None:
        """Run the health check as it is now (a test may swap it after checks start)."""
        return self.check()

    def start_checking(self) -> None:
        """Check after every test phase from now on."""
        self.unwatch_imports()
        if self.checks is None:
            from pytest_cuda.sync.checks import PhaseChecks

            self.checks = PhaseChecks(
                self.config,
                self.run_check,
                action=self.options.action,
                rerun_blocking=self.options.rerun_blocking,
            )
            self.config.pluginmanager.register(self.checks, CHECKS_NAME)

    def watch_imports(self) -> None:
        """Start checking when a CUDA library is first imported."""
        self._watch = CudaImportWatch(self)
        sys.meta_path.insert(0, self._watch)

    def unwatch_imports(self) -> bool:
        """Stop watching; ``True`` for the one call that took the watch off."""
        watch = self._watch
        if watch is None:
            return False
        self._watch = None
        try:
            sys.meta_path.remove(watch)
        except ValueError:  # taken off already (an import in another thread)
            return False
        return True

    def pytest_unconfigure(self) -> None:
        self.unwatch_imports()


class CudaImportWatch:
    """An import hook that only looks: the first import of one of
    :data:`CUDA_LIBRARIES` starts the guard's checks, and the watch takes itself off
    ``sys.meta_path``; the import itself proceeds as usual."""

    def __init__(self, guard: PoisonGuard) -> None:
        self.guard = guard

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname in CUDA_LIBRARIES and self.guard.unwatch_imports():
            self.guard.start_checking()
