"""A fork server's imports: what they raise and print is each forked rank's, given back
in its first job as a rank that imported torch itself would have met it; where they
fail, each rank starts afresh. (The ranks a server forks run for real in
``test_distributed_pool.py``: a server per rank, and a server that ends.)"""

from __future__ import annotations

import os
import sys
import warnings
from typing import TYPE_CHECKING

from pytest_cuda.distributed import forkserver_main
from pytest_cuda.distributed.job import JobRun, RankJob
from pytest_cuda.distributed.rank_main import Preloaded, _Process, _Rank
from pytest_cuda.distributed.ranks import DistributedSpec

if TYPE_CHECKING:
    from pathlib import Path

    import pytest


def _noisy_import() -> None:
    os.write(1, b"printed by an import\n")  # on the file descriptors, as C code writes
    os.write(2, b"written to stderr by C code\n")
    warnings.warn("planted: failed to initialize a planted module", UserWarning, stacklevel=1)


def test_what_the_imports_raise_and_print_is_kept_for_each_rank(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(forkserver_main, "_import_what_a_rank_imports", _noisy_import)
    monkeypatch.setattr(sys, "path", list(sys.path))
    preloaded = forkserver_main._preload(list(sys.path))
    assert preloaded is not None
    assert [str(w.message) for w in preloaded.raised] == [
        "planted: failed to initialize a planted module"
    ]
    assert preloaded.stdout == b"printed by an import\n"
    assert preloaded.stderr == b"written to stderr by C code\n"
    print("the test's own output")
    assert capfd.readouterr() == ("the test's own output\n", "")  # the fds put back


def test_imports_that_fail_leave_each_rank_to_start_afresh(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    def broken() -> None:
        os.write(1, b"half an import\n")
        raise ImportError("planted: no torch here")

    monkeypatch.setattr(forkserver_main, "_import_what_a_rank_imports", broken)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert forkserver_main._preload(list(sys.path)) is None
    print("the test's own output")
    assert capfd.readouterr() == ("the test's own output\n", "")


def test_a_forked_ranks_first_job_reports_the_imports_warnings(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        warnings.warn("planted: failed to initialize a planted module", UserWarning, stacklevel=1)
    job = RankJob(
        name="test_pair",
        module="test_planted",
        module_file=str(tmp_path / "test_planted.py"),
        call=b"",
        wants_rank=True,
        spec=DistributedSpec(backend="gloo"),
        devices=(),
        leak=None,
    )
    run = JobRun(job, 0, (), "", "0", 0, 60.0, 60.0, warm=True)
    process = _Process(0, preloaded=Preloaded(raised, b"", b""))
    first = _Rank(run, process, tmp_path)._stamped({"state": "passed"})
    assert first["warnings"] == [
        (
            "UserWarning",
            "planted: failed to initialize a planted module",
            __file__,
            raised[0].lineno,
        )
    ]
    process.preloaded = None  # given back: the next job has its own warnings only
    assert _Rank(run, process, tmp_path)._stamped({"state": "passed"})["warnings"] == []
