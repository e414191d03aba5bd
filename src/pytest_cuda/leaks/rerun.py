"""A leaking test, re-run alone in a fresh pytest process (``--cuda-leak-reruns N``).

Opt-in (the default check names the allocating line and the holder in the run itself):
the first ``N`` leaking tests of a session are run again alone, to tell a leak that
needs the tests before it (a cache an earlier test filled) from one that leaks alone.
The child is a pytest child of this session, as the poison continuation's and
``--cuda-rerun-blocking``'s are (:mod:`pytest_cuda.child`): the user's own command
line, so it collects and configures the same way, narrowed to the one test, with its
own ``--basetemp`` and cache, without xdist; it writes its leak reports to the file
named by :data:`~pytest_cuda.leaks.report.RERUN_OUT_ENV`.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_cuda.child import child_argv_for, child_env, write_nodeids
from pytest_cuda.leaks.report import RERUN_OUT_ENV, LeakReport
from pytest_cuda.leaks.result import Rerun
from pytest_cuda.leaks.settle import LIBRARY_STEP

if TYPE_CHECKING:
    import pytest

__all__ = ["rerun_alone", "write_reports"]

TIMEOUT_S = 300


def rerun_alone(config: pytest.Config, nodeid: str) -> Rerun:
    """Run ``nodeid`` alone in a pytest child of this session; what it showed."""
    with tempfile.TemporaryDirectory(prefix="pytest-cuda-rerun-") as folder:
        workdir = Path(folder)
        out = workdir / "leaks.json"
        write_nodeids(workdir, [nodeid])
        extra = (
            "--cuda-leak-check",
            f"--cuda-leak-report={workdir / 'report.json'}",  # never the user's file
        )
        argv = child_argv_for(config, workdir, extra)
        try:
            done = subprocess.run(
                argv,
                cwd=config.invocation_params.dir,
                env=child_env({RERUN_OUT_ENV: str(out)}),
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
    out = os.environ.get(RERUN_OUT_ENV)
    if out:
        Path(out).write_text(json.dumps(reports))
