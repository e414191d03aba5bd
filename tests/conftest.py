"""Shared test helpers: the heap frozen once torch and IPython are imported, a fresh
status cache around every test, the demo notebook executed once a run, one headless
Chromium per session (per xdist worker)."""

from __future__ import annotations

import fcntl
import gc
import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gpumagic import cuda

ROOT = Path(__file__).resolve().parents[1]

if TYPE_CHECKING:
    from collections.abc import Generator, Iterator

    from browser import Browser


_PYTHONPATH = pytest.StashKey[str | None]()


def pytest_configure(config: pytest.Config) -> None:
    """Relative ``PYTHONPATH`` entries (``PYTHONPATH=src``) become absolute for the run.

    pytester's subprocesses run in temporary folders, where ``src`` names nothing: the
    planted runs would import whatever checkout is installed instead of this one.
    """
    value = os.environ.get("PYTHONPATH")
    config.stash[_PYTHONPATH] = value
    if value:
        here = config.invocation_params.dir
        entries = [str((here / e).resolve()) if e else e for e in value.split(os.pathsep)]
        os.environ["PYTHONPATH"] = os.pathsep.join(entries)


def pytest_unconfigure(config: pytest.Config) -> None:
    value = config.stash.get(_PYTHONPATH, None)
    if value is not None:
        os.environ["PYTHONPATH"] = value


@pytest.fixture(scope="session", autouse=True)
def _frozen_heap() -> Iterator[None]:
    """Import torch and IPython, then freeze the heap (``gc.freeze()``) for the session.

    Every IPython shell a test closes runs a full collection (IPython's ``reset``
    does), a few hundred shells a run; with torch, IPython and pytest loaded each one
    walked about a million objects (~0.1 s). Frozen, the objects made so far are left
    out of later collections; what the tests make is collected as before. The tests
    of the leak check's walks thaw the heap themselves (``test_leak_holders.py``).
    torch is imported before any ``pytester`` snapshot of ``sys.modules``: pytester
    drops the modules an in-process run imported when it ends, and torch's C extension
    crashes when imported twice.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Failed to initialize NumPy" where it is absent
        cuda.torch_module()
    import IPython.core.interactiveshell  # noqa: F401 -- its modules, frozen with the rest

    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def executed_demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``examples/demo.ipynb`` executed by a real Jupyter kernel (nbclient), once a session.

    Under pytest-xdist the first worker that asks executes it and the others read its
    result: the ``xdist_group`` marks meant to keep its tests on one worker are ignored
    with pytest 9.2 (pytest-dev/pytest-xdist#1386).
    """
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return _execute_demo(tmp_path_factory.mktemp("demo"))
    shared = tmp_path_factory.getbasetemp().parent / "executed-demo.json"  # the run's
    with shared.with_suffix(".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if shared.exists():
            found: dict[str, Any] = json.loads(shared.read_text())
            return found
        book = _execute_demo(tmp_path_factory.mktemp("demo"))
        shared.write_text(json.dumps(book))
        return book


def _execute_demo(cwd: Path) -> dict[str, Any]:
    import nbformat
    from nbclient import NotebookClient

    book = nbformat.read(ROOT / "examples" / "demo.ipynb", as_version=4)
    NotebookClient(book, timeout=600, kernel_name="python3", allow_errors=True).execute(
        cwd=str(cwd)
    )
    return dict(book)


@pytest.fixture(scope="session")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    """One headless Chromium for every rendering test of the session (a worker's, under
    xdist): starting it costs more than loading a page in it."""
    from browser import CHROMIUM, Browser

    if CHROMIUM is None:
        pytest.skip("headless Chromium is not installed (Debian package 'chromium')")
    running = Browser(CHROMIUM, tmp_path_factory.mktemp("chromium-profile"))
    try:
        yield running
    finally:
        running.close()


@pytest.fixture(autouse=True)
def _fresh_cuda_status() -> Iterator[None]:
    cuda.reset_status_cache()
    yield
    cuda.reset_status_cache()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """In the GPU check (``scripts/gpu-check.sh``) a GPU-marked test may not skip."""
    report = yield
    if (
        report.skipped
        and os.environ.get("GPUMAGIC_GPU_CHECK") == "1"
        and item.get_closest_marker("cuda") is not None
        and not hasattr(report, "wasxfail")
    ):
        report.outcome = "failed"
        report.longrepr = f"GPU-marked test skipped in the GPU check: {report.longrepr}"
    return report
