"""A rank's leak is the test's leak: merged at the test's teardown with the pytest
process's own check, ``LEAKED`` naming the rank, its own row in the
``--cuda-leak-report`` JSON and its own JUnit properties, counted in the summary.

The merge is tested with stand-in ranks (``launch.run_ranks`` replaced in the planted
conftest): each returns the :class:`~pytest_cuda.distributed.ranks.RankOutcome` a rank
process sends back, its leak report as plain data, and records the settings the job
carried. The ranks' own check runs for real in gloo rank processes whose test module
puts the fake allocator in each rank's seam (the last test), and on two GPUs with NCCL
in ``test_distributed_gpu.py``.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Callable

STAND_IN_RANKS = """

import importlib
import json
from dataclasses import asdict

from pytest_cuda.distributed.ranks import RankOutcome
from pytest_cuda.leaks.report import LeakReport


def _stand_in_ranks(job, folder, *, cwd, servers=None):
    # What two rank processes send back: rank 1 keeps 1 MiB on its device.
    with open("jobs.jsonl", "a") as out:
        out.write(json.dumps(asdict(job.leak)) + "\\n")
    leak = job.leak
    subject = f"{job.name} on rank 1"
    leaked = LeakReport(
        leak.mode,
        ((1, 1 << 20),),
        (),
        details=f"{subject} left 1.0 MiB (1,048,576 B) allocated on cuda:1; tolerance "
        f"{leak.tolerance} B.",
        top="test_planted.py:9 in test_pair",
        holder="test_planted.KEPT[0] (module global)",
        tolerance=leak.tolerance,
        rank=1,
        summary=f"CUDA memory leak: {subject} left 1.0 MiB on cuda:1 allocated (tolerance "
        f"{leak.tolerance} B), allocated at test_planted.py:9 in test_pair, held by "
        "test_planted.KEPT[0] (module global)",
    )
    clean = LeakReport(leak.mode, (), (), tolerance=leak.tolerance, rank=0)
    outcomes = [
        RankOutcome(report.rank, f"cuda:{report.rank}", "passed", leak=report.to_dict())
        for report in (clean, leaked)
    ]
    return outcomes, None


_ranks_patch = pytest.MonkeyPatch()


def pytest_sessionstart(session):
    launch = importlib.import_module("pytest_cuda.distributed.launch")
    _ranks_patch.setattr(launch, "run_ranks", _stand_in_ranks)


def pytest_sessionfinish(session):
    _ranks_patch.undo()
"""

PAIR = """
import pytest

KEPT = []

@pytest.mark.cuda_distributed(world_size=2, backend="gloo", isolate=True)
def test_pair():
    pass  # runs in the stand-in ranks

def test_alone(fake_cuda):
    x = fake_cuda.tensor(512)
    del x
"""


@pytest.fixture
def stand_in_ranks(pytester: pytest.Pytester, planted: Callable[[str], None]) -> None:
    planted(PAIR)
    conftest = pytester.path / "conftest.py"
    conftest.write_text(conftest.read_text() + STAND_IN_RANKS)


def _properties(path: str) -> dict[str, dict[str, str]]:
    return {
        case.get("name", ""): {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
        for case in ET.parse(path).getroot().iter("testcase")
    }


@pytest.mark.usefixtures("stand_in_ranks")
def test_a_ranks_leak_is_the_tests_leak_in_every_report(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(
        "--cuda-leak-check",
        "--cuda-leak-report=leaks.json",
        "--junitxml=junit.xml",
        "-o",
        "cuda_leak_tolerance=16",
    )
    assert result.parseoutcomes() == {"passed": 2, "leaked": 1}
    result.stdout.fnmatch_lines(
        [
            "*_ test_planted.py::test_pair on rank 1 _*",
            "test_pair on rank 1 left 1.0 MiB (1,048,576 B) allocated on cuda:1; tolerance 16 B.",
            "*- leaking tests -*",
            "LEAKED test_planted.py::test_pair on rank 1 - 1.0 MiB on cuda:1, allocated at "
            "test_planted.py:9 in test_pair, held by test_planted.KEPT[0] (module global)",
            "cuda leak check: 2 tests checked, 1 leaked (1.0 MiB on cuda:1 leaked); report "
            "written to leaks.json",
        ]
    )
    # The ranks check as the pytest process planned: its tolerance, mode, holder search.
    jobs = (pytester.path / "jobs.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in jobs] == [
        {
            "tolerance": 16,
            "mode": "fail",
            "search_s": None,
            "reset_caches": False,
            "root": str(pytester.path),
        }
    ]
    document = json.loads((pytester.path / "leaks.json").read_text())
    rows = [
        (row["nodeid"], row["rank"], row["verdict"], row["line"], row["holder"])
        for row in document["tests"]
    ]
    assert rows == [
        ("test_planted.py::test_pair", None, "clean", None, None),
        ("test_planted.py::test_pair", 0, "clean", None, None),
        (
            "test_planted.py::test_pair",
            1,
            "leaked",
            "test_planted.py:9 in test_pair",
            "test_planted.KEPT[0] (module global)",
        ),
        ("test_planted.py::test_alone", None, "clean", None, None),
    ]
    assert document["summary"] == {
        "checked": 2,
        "clean": 1,
        "kept": 0,
        "warned": 0,
        "leaked": 1,
        "leaked_bytes": {"cuda:1": 1 << 20},
    }
    # The test's teardown failed with the rank's line.
    root = ET.parse(pytester.path / "junit.xml").getroot()
    case = next(case for case in root.iter("testcase") if case.get("name") == "test_pair")
    error = case.find("error")
    assert error is not None
    assert (
        "CUDA memory leak: test_pair on rank 1 left 1.0 MiB on cuda:1 allocated (tolerance 16 B), "
        "allocated at test_planted.py:9 in test_pair, held by test_planted.KEPT[0] (module global)"
    ) in error.get("message", "")
    properties = _properties(str(pytester.path / "junit.xml"))
    assert properties["test_pair"] == {
        "cuda_leak_verdict": "leaked",
        "cuda_leak_tolerance": "16",
        "cuda_leak_rank0_verdict": "clean",
        "cuda_leak_rank0_tolerance": "16",
        "cuda_leak_rank1_verdict": "leaked",
        "cuda_leak_rank1_tolerance": "16",
        "cuda_leak_rank1_bytes": "cuda:1=1048576",
        "cuda_leak_rank1_line": "test_planted.py:9 in test_pair",
        "cuda_leak_rank1_holder": "test_planted.KEPT[0] (module global)",
    }


@pytest.mark.usefixtures("stand_in_ranks")
def test_a_ranks_leak_under_the_warn_mode_warns(pytester: pytest.Pytester) -> None:
    test_file = pytester.path / "test_planted.py"
    test_file.write_text(
        test_file.read_text().replace(
            "@pytest.mark.cuda_distributed",
            '@pytest.mark.cuda_leak_check(mode="warn")\n@pytest.mark.cuda_distributed',
        )
    )
    result = pytester.runpytest("-W", "default::pytest_cuda.CudaLeakWarning")
    assert result.parseoutcomes() == {"passed": 2, "warnings": 1}
    result.stdout.fnmatch_lines(
        [
            "*CudaLeakWarning: CUDA memory leak: test_pair on rank 1 left 1.0 MiB on cuda:1 *",
            "WARNED test_planted.py::test_pair on rank 1 - 1.0 MiB on cuda:1, *",
        ]
    )


@pytest.mark.usefixtures("stand_in_ranks")
def test_the_hook_sees_each_ranks_report_in_the_pytest_process(pytester: pytest.Pytester) -> None:
    conftest = pytester.path / "conftest.py"
    conftest.write_text(
        conftest.read_text()
        + """

def pytest_cuda_leak_report(report, item):
    if report.rank == 1:
        return report.accepted("rank 1 keeps its buffer by design")
"""
    )
    result = pytester.runpytest("--cuda-leak-check", "-v")
    assert result.parseoutcomes() == {"passed": 2}
    result.stdout.fnmatch_lines(
        [
            "test_planted.py::test_pair on rank 1 - rank 1 keeps its buffer by design: "
            "1.0 MiB on cuda:1",
        ]
    )


# ---------------------------------------------------------------------------
# The ranks' own check, in real rank processes (gloo), on a fake allocator each.

IN_RANKS = """
import os

import pytest
import torch
import torch.distributed as dist

if "RANK" in os.environ:  # imported by a rank process: the fake allocator in its seam
    from fake_cuda import FakeAllocator

    FAKE = FakeAllocator(2)
    FAKE.install(pytest.MonkeyPatch())

KEPT = []


@pytest.mark.cuda_distributed(world_size=2, backend="gloo", timeout=60)
def test_pair(cuda_rank):
    dist.all_reduce(torch.ones(1))
    if cuda_rank.rank == 1:
        KEPT.append(FAKE.tensor(1 << 20, device=1))


@pytest.mark.cuda_distributed(world_size=2, backend="gloo", timeout=60)
def test_next(cuda_rank):
    assert not KEPT  # new ranks: the ones that leaked were replaced
    dist.all_reduce(torch.ones(1))
"""


def test_each_rank_runs_the_same_check_and_names_its_line_and_holder(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(IN_RANKS)
    result = pytester.runpytest_subprocess(
        "--cuda-leak-check",
        "--cuda-leak-report=leaks.json",
        "-o",
        "cuda_leak_holder_search=0.3",  # the default, as a user's run has it
        "-p",
        "no:cacheprovider",
    )
    assert result.parseoutcomes() == {"passed": 2, "leaked": 1}
    result.stdout.fnmatch_lines(
        [
            "test_pair on rank 1 left 1.0 MiB (1,048,576 B) allocated on cuda:1; tolerance 0 B.",
            "Measured in this process's caching allocator after: *",
            "Blocks still alive, by allocating stack (largest first):",
            "  1.0 MiB in 1 block on cuda:1",
            "    test_planted.py:20 in test_pair",
            "Who holds them (the reference path from a root, largest first):",
            "  1.0 MiB (1 tensor) on cuda:1: test_planted.KEPT[0] (module global)",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "LEAKED test_planted.py::test_pair on rank 1 - 1.0 MiB on cuda:1, allocated at "
            "test_planted.py:20 in test_pair, held by test_planted.KEPT[0] (module global)",
            "cuda leak check: 2 tests checked, 1 leaked (1.0 MiB on cuda:1 leaked); report "
            "written to leaks.json",
        ]
    )
    rows = json.loads((pytester.path / "leaks.json").read_text())["tests"]
    assert [(r["nodeid"].split("::")[1], r["rank"], r["verdict"]) for r in rows] == [
        ("test_pair", None, "clean"),
        ("test_pair", 0, "clean"),
        ("test_pair", 1, "leaked"),
        ("test_next", None, "clean"),
        ("test_next", 0, "clean"),
        ("test_next", 1, "clean"),
    ]
