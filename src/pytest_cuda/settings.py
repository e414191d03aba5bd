"""pytest_cuda's settings: every option resolved once, checked and typed.

:func:`settings_of` builds one :class:`Settings` per config at its first call (the
first ``pytest_configure`` of pytest_cuda; the same in xdist workers and in the pytest
children of :mod:`pytest_cuda.child`, which parse the same command line), stashes it
and answers it from then on. Every other module reads its options there, never
through ``config.getoption`` / ``getini``.

An option with more than one source takes the command line, then the environment,
then the ini file (``--cuda-devices``, ``$PYTEST_CUDA_DEVICES``, ``cuda_devices``).
Command-line values were checked as argparse read them (the ``type=`` functions of
:mod:`pytest_cuda.options`); environment and ini values are checked here, a bad one is
a :class:`pytest.UsageError`. So is an option of a mode that ``-p no:`` switched off
(:data:`~pytest_cuda.options.MODE_OPTIONS`): it would do nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

from pytest_cuda.options import ENV_DEVICES, MODE_OPTIONS

if TYPE_CHECKING:
    from pytest_cuda.selection import DeviceRequest

__all__ = ["Settings", "early_sync_mode", "settings_of"]


@dataclass(frozen=True)
class Settings:
    """This process's pytest_cuda settings (see ``pytest --help`` for each option)."""

    #: ``--cuda-devices``, else ``$PYTEST_CUDA_DEVICES``, else ini ``cuda_devices``;
    #: ``None``: every visible device.
    device_request: DeviceRequest | None
    #: ``--cuda-devices-per-worker``.
    devices_per_worker: int | None
    #: ``--cuda-require``.
    require: bool

    #: ``--cuda-leak-check``, else ini ``cuda_leak_check``.
    leak_check: bool
    #: ``--cuda-leak-trace``.
    leak_trace: bool
    #: ``--cuda-leak-report``, as given.
    leak_report: str | None
    #: ini ``cuda_leak_tolerance``, in bytes per device.
    leak_tolerance: int
    #: ini ``cuda_leak_holder_search`` in seconds, ``None`` under ``--cuda-leak-trace``
    #: or for ``0`` / ``none``: no limit.
    holder_search_s: float | None
    #: ``--cuda-leak-reset-caches``.
    leak_reset_caches: bool
    #: ``--cuda-leak-reruns``.
    leak_reruns: int
    #: ``--cuda-memory-report``.
    memory_report: int
    #: ``--cuda-limit-memory``, else ini ``cuda_limit_memory``, in bytes; ``None``: no
    #: limit but the tests' markers.
    memory_limit: int | None
    #: Where ``memory_limit`` comes from, as messages name it.
    memory_limit_source: str
    #: ``--cuda-oom``: ``fail`` (the default) or ``skip``.
    oom: str
    #: ``--cuda-memory-snapshot``, as given.
    memory_snapshot: str | None

    #: ``--cuda-sync``.
    sync: str | None
    #: ``--cuda-on-poison``, as given (``None``: the default).
    on_poison: str | None
    #: ``--cuda-rerun-blocking``.
    rerun_blocking: bool
    #: ``--cuda-ranks``: ``env`` where a launcher started this process as one rank.
    ranks: str | None
    #: ``--cuda-rank-logs``: where the ranks but rank 0 write their terminal output.
    rank_logs: str | None

    #: ``--cuda-internal-resume``: this process is a child running a parent's tests.
    resume_dir: str | None
    #: ``--cuda-internal-rerun``: ... and re-runs one failed test with blocking launches.
    rerun: bool

    #: pytest's own ``--pdb`` / ``--trace``.
    debugging: bool
    #: pytest's own ``--collect-only``.
    collect_only: bool
    #: This process starts pytest-xdist workers (``-n``, ``--dist``): it runs no test.
    xdist_controller: bool


_SETTINGS = pytest.StashKey[Settings]()


def settings_of(config: pytest.Config) -> Settings:
    """The settings of ``config``'s run, built and checked at the first call.

    Raises :class:`pytest.UsageError` for a bad environment or ini value, and for an
    option given on the command line whose mode is switched off.
    """
    found = config.stash.get(_SETTINGS, None)
    if found is None:
        found = _build(config)
        config.stash[_SETTINGS] = found
    return found


def early_sync_mode(config: pytest.Config) -> str | None:
    """``--cuda-sync`` before the settings exist: in ``pytest_load_initial_conftests``,
    where ``launch-blocking`` must act before any conftest can create a CUDA context and
    only the known arguments are read."""
    namespace = getattr(config, "known_args_namespace", None)
    sync: str | None = getattr(namespace, "cuda_sync", None)
    return sync


def _build(config: pytest.Config) -> Settings:
    _refuse_switched_off_modes(config)
    option = config.option
    trace = bool(option.cuda_leak_trace)
    # ``pytest --help`` configures the plugins too; it shows the help whatever the ini
    # file and the environment say (a bad value there is named by the next real run).
    read = not getattr(option, "help", False)
    return Settings(
        device_request=_device_request(config) if read else None,
        devices_per_worker=option.cuda_devices_per_worker,
        require=bool(option.cuda_require),
        leak_check=bool(option.cuda_leak_check) or (read and _ini_bool(config, "cuda_leak_check")),
        leak_trace=trace,
        leak_report=option.cuda_leak_report,
        leak_tolerance=_ini_tolerance(config, "cuda_leak_tolerance") if read else 0,
        holder_search_s=(
            None if trace or not read else _ini_seconds(config, "cuda_leak_holder_search")
        ),
        leak_reset_caches=bool(option.cuda_leak_reset_caches),
        leak_reruns=option.cuda_leak_reruns,
        memory_report=option.cuda_memory_report,
        memory_limit=(
            option.cuda_limit_memory
            if option.cuda_limit_memory is not None or not read
            else _ini_limit(config, "cuda_limit_memory")
        ),
        memory_limit_source=(
            "--cuda-limit-memory"
            if option.cuda_limit_memory is not None
            else "cuda_limit_memory ini value"
        ),
        oom=option.cuda_oom or "fail",
        memory_snapshot=option.cuda_memory_snapshot,
        sync=option.cuda_sync,
        on_poison=option.cuda_on_poison,
        rerun_blocking=bool(option.cuda_rerun_blocking),
        ranks=option.cuda_ranks,
        rank_logs=option.cuda_rank_logs,
        resume_dir=option.cuda_internal_resume,
        rerun=bool(option.cuda_internal_rerun),
        debugging=bool(getattr(option, "usepdb", False) or getattr(option, "trace", False)),
        collect_only=bool(getattr(option, "collectonly", False)),
        xdist_controller=(
            not hasattr(config, "workerinput") and getattr(option, "dist", "no") != "no"
        ),
    )


def _refuse_switched_off_modes(config: pytest.Config) -> None:
    """An option whose mode ``-p no:`` switched off would do nothing: say so instead.

    Only the command line (``addopts`` included) is refused: a mode's ini values are
    project settings, which ``-p no:`` switches off with the mode for this run.
    """
    manager = config.pluginmanager
    for mode, options in MODE_OPTIONS.items():
        if not manager.is_blocked(mode):
            continue
        for dest, flag in options:
            value = getattr(config.option, dest, None)
            if not value:  # the default (0, None, False): not asked for
                continue
            given = flag if value is True else f"{flag}={value}"
            raise pytest.UsageError(
                f"{given} needs {mode}, which -p no:{mode} switched off: drop one of the two"
            )


def _device_request(config: pytest.Config) -> DeviceRequest | None:
    option: str | None = config.option.cuda_devices
    env = os.environ.get(ENV_DEVICES, "")
    ini = str(config.getini("cuda_devices"))
    if option is not None:
        text, source = option, f"--cuda-devices={option}"
    elif env.strip():
        text, source = env, f"{ENV_DEVICES}={env}"
    elif ini.strip():
        text, source = ini, f"cuda_devices = {ini} (ini)"
    else:
        return None
    from pytest_cuda.selection import SelectionError, parse_device_request

    try:
        return parse_device_request(text, source)
    except SelectionError as exc:
        raise pytest.UsageError(str(exc)) from None


def _ini_bool(config: pytest.Config, name: str) -> bool:
    try:
        return bool(config.getini(name))
    except (ValueError, pytest.UsageError) as exc:  # pytest 9 raises the second
        raise pytest.UsageError(f"{name} (ini) takes true or false: {exc}") from None


def _ini_tolerance(config: pytest.Config, name: str) -> int:
    """An ini tolerance in bytes (an int or a string such as ``4KiB``)."""
    text = str(config.getini(name))
    from gpumagic.units import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise pytest.UsageError(
            f"{name} (ini): tolerance must be a size in bytes >= 0 (an int or a string "
            f'such as "4KiB"), got {text!r} ({exc})'
        ) from None


def _ini_limit(config: pytest.Config, name: str) -> int | None:
    """An ini memory limit in bytes; ``None`` when empty."""
    text = str(config.getini(name)).strip()
    if not text:
        return None
    from gpumagic.units import parse_size

    try:
        limit = parse_size(text)
    except ValueError as exc:
        raise pytest.UsageError(f"{name} (ini): {exc}") from None
    if limit < 1:
        raise pytest.UsageError(f"{name} (ini) takes a size above 0 bytes, got {text!r}")
    return limit


def _ini_seconds(config: pytest.Config, name: str) -> float | None:
    """An ini time limit in seconds; ``None`` (no limit) for ``0`` or ``none``."""
    text = str(config.getini(name)).strip()
    if text.lower() == "none":
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if seconds == 0:
        return None
    if not seconds > 0 or seconds == float("inf"):
        raise pytest.UsageError(
            f"{name} (ini) takes seconds > 0 (or none for no limit), got {text!r}"
        )
    return seconds
