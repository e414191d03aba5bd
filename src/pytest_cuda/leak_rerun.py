"""A leaking test, re-run alone in a fresh process with allocation stacks recorded.

Without ``--cuda-leak-trace`` no stack is recorded (recording costs about 2 µs per CUDA
allocation in every test), so a leak's report could name no line and no holder. The
checker re-runs each leaking test (the first ``--cuda-leak-reruns`` of a session, 5 by
default) as
``python -m pytest NODEID --cuda-leak-check --cuda-leak-trace`` in the rootdir; the
child writes its leak reports to the file named by :data:`ENV_OUT`, and the parent puts
the line and holder it found into its own report. Clean tests never pay for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_cuda.leak_report import LeakReport
from pytest_cuda.leaks import Rerun

if TYPE_CHECKING:
    import pytest

__all__ = ["ENV_OUT", "LIBRARY_STEP", "rerun_alone", "write_reports"]

#: Where a re-run child writes ``{nodeid: LeakReport.to_dict()}``.
ENV_OUT = "PYTEST_CUDA_LEAK_RERUN_OUT"
#: The name of the step under which growth that only a library cache holds is listed
#: (:func:`pytest_cuda.leak_checker.kept_by_library`).
LIBRARY_STEP = "held by a library cache"
TIMEOUT_S = 300


def rerun_alone(config: pytest.Config, nodeid: str) -> Rerun:
    """Run ``nodeid`` alone in a fresh process with stacks recorded; what it showed."""
    with tempfile.TemporaryDirectory(prefix="pytest-cuda-rerun-") as folder:
        out = Path(folder) / "leaks.json"
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))
        }
        env[ENV_OUT] = str(out)
        argv = [sys.executable, "-m", "pytest", nodeid, "--cuda-leak-check", "--cuda-leak-trace"]
        argv += ["-p", "no:cacheprovider", "-q", "--no-header", "-rN"]
        if config.pluginmanager.has_plugin("xdist"):
            argv += ["-n", "0"]  # alone, whatever addopts says
        try:
            done = subprocess.run(
                argv,
                cwd=config.rootpath,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return Rerun(note=f"it could not run ({type(exc).__name__}: {exc})")
        reports = _read(out)
    report = reports.get(nodeid)
    if report is None:
        tail = " / ".join(line for line in done.stdout.strip().splitlines()[-2:])
        return Rerun(note=f"it did not run the test (exit status {done.returncode}: {tail})")
    library = next((step for step, _ in report.kept if step.startswith(LIBRARY_STEP)), None)
    if library is not None:
        path = library.split(": ", 1)[-1]
        return Rerun(note=f"only a library cache holds it ({path}): kept by design", library=path)
    if not report.leaked:
        return Rerun(note="no leak there: the leak depends on the tests that ran before it")
    return Rerun(top=report.top, holder=report.holder, details=report.details)


def _read(path: Path) -> dict[str, LeakReport]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return {nodeid: LeakReport.from_dict(found) for nodeid, found in data.items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def write_reports(reports: dict[str, dict[str, Any]]) -> None:
    """In a re-run child: write the leak reports where the parent reads them."""
    out = os.environ.get(ENV_OUT)
    if out:
        Path(out).write_text(json.dumps(reports))
