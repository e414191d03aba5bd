"""The one leak engine (:class:`pytest_cuda.leaks.engine.LeakCheck`) behind the pytest
checker and ``no_cuda_leak``, the report it leaves (:class:`~pytest_cuda.leaks.report.LeakReport`,
serialised from its fields), the ``pytest_cuda_leak_report`` hook, the error of a stack
recording that could not start, and memory only a failed test's traceback holds.

Through real pytest runs on the fake allocator (``planted``, see conftest.py) and
``no_cuda_leak`` in this process on it. The ranks' side of the report is in
``test_leak_ranks.py``.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import fields
from typing import TYPE_CHECKING

import pytest

from fake_cuda import FakeAllocator
from pytest_cuda.leaks import engine
from pytest_cuda.leaks.block import CudaLeakError, no_cuda_leak
from pytest_cuda.leaks.report import LeakReport, json_report, junit_properties
from pytest_cuda.leaks.result import LeakResult
from pytest_cuda.leaks.walk.holders import LeakHolder, LeakHolderScan

if TYPE_CHECKING:
    from collections.abc import Callable

KEEP: list[object] = []


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
    """A fake allocator in the seam; the real functions are put back afterwards."""
    KEEP.clear()
    return FakeAllocator().install(monkeypatch)


@pytest.fixture
def finished(monkeypatch: pytest.MonkeyPatch) -> list[engine.LeakCheck]:
    """Every :class:`LeakCheck` that finished, in order (its ``finish`` wrapped)."""
    checks: list[engine.LeakCheck] = []
    finish = engine.LeakCheck.finish

    def spy(self: engine.LeakCheck, **kwargs: object) -> object:
        checks.append(self)
        return finish(self, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.LeakCheck, "finish", spy)
    return checks


# ---------------------------------------------------------------------------
# One engine: the checker and no_cuda_leak say the same of the same leak.

BOTH = """
from pytest_cuda import no_cuda_leak

KEEP = []

def test_checked(fake_cuda):
    KEEP.append(fake_cuda.tensor(4096))

def test_block(fake_cuda):
    with no_cuda_leak():
        KEEP.append(fake_cuda.tensor(4096))
"""


def test_the_checker_and_no_cuda_leak_run_the_same_engine(
    pytester: pytest.Pytester, planted: Callable[[str], None], finished: list[engine.LeakCheck]
) -> None:
    planted(BOTH)
    result = pytester.runpytest("--cuda-leak-check", "-rf", "-k", "checked")
    result.stdout.fnmatch_lines(
        [
            "LEAKED test_planted.py::test_checked - 4.0 KiB on cuda:0, allocated at "
            "test_planted.py:6 in test_checked, held by test_planted.KEEP[0] (module global)",
        ]
    )
    result = pytester.runpytest("-rf", "-k", "block")
    result.stdout.fnmatch_lines(
        [
            "E       pytest_cuda.CudaLeakError: CUDA memory leak: the block at "
            "test_planted.py:9 left 4.0 KiB on cuda:0 allocated (tolerance 0 B), allocated "
            "at test_planted.py:10 in test_block, held by test_planted.KEEP[0] (module global)",
        ]
    )
    # The checker's check runs with the time limit it was given, the block's without.
    assert [c.search_s for c in finished] == [None, None]
    assert [c.settle_start for c in finished] == [False, True]
    assert [c.outermost[1] if c.outermost else None for c in finished] == [
        "test_checked",
        "test_block",
    ]


# ---------------------------------------------------------------------------
# Stack recording that could not start says so.


def test_a_recording_that_fails_at_cuda_init_keeps_the_first_call_safe_and_says_why(
    fake: FakeAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> bool:
        raise RuntimeError("record_memory_history: not supported on this build")

    monkeypatch.setattr(fake, "start_memory_history", broken)
    FakeAllocator.install(fake, monkeypatch)
    with pytest.raises(CudaLeakError) as info, no_cuda_leak():
        KEEP.append(fake.tensor(4096))  # the first CUDA call: initialises, must not raise
    assert fake.initialized
    assert (
        "Stacks not recorded: switching on allocation-stack recording failed: RuntimeError: "
        "record_memory_history: not supported on this build"
    ) in str(info.value)
    assert "switched off by" not in str(info.value)


# ---------------------------------------------------------------------------
# The report: its fields are its data.


def test_a_leak_is_proven_when_holders_proven_alive_keep_its_growth() -> None:
    # What a collection of the whole heap could not change: skipped. torchvision's
    # DeformConv tests leak cached tensors (a class's lru_cache, proven alive) while
    # cuBLAS reallocated blocks no tensor shows (not proven, beyond the growth).
    cached = LeakHolder(
        "test_ops.T.f.cache[…]", "functools.lru_cache", 58_756, ("cuda:0",), alive=True
    )
    unshown = LeakHolder("15 blocks that no Python tensor shows", "C++ side", 122_368, ("cuda:0",))
    scan = LeakHolderScan((cached, unshown), proven=(("cuda:0", 60_928),))

    def proven(grew: int, found: LeakHolderScan = scan) -> bool:
        return engine.LeakCheck._proven_alive(LeakResult({0: grew}, {0: grew}, 0, holders=found))

    assert proven(60_928)
    assert not proven(60_929)  # more than the proven blocks: the collection decides
    assert not proven(100, LeakHolderScan((cached, unshown), complete=False))
    assert proven(100, LeakHolderScan((cached,)))  # every holder proven alive


def test_a_report_round_trips_through_json_field_by_field() -> None:
    report = LeakReport(
        mode="fail",
        leaked=((0, 4096), (1, 512)),
        kept=(("cuBLAS/cuBLASLt workspaces", ((0, 1 << 25),)),),
        details="text",
        top="test_x.py:3 in test_x",
        failed_by_leak=True,
        holder="m.KEEP[0] (module global)",
        tolerance=16,
        rank=1,
        summary="CUDA memory leak: test_x on rank 1 left ...",
    )
    data = json.loads(json.dumps(report.to_dict()))
    assert set(data) == {f.name for f in fields(LeakReport)}
    assert LeakReport.from_dict(data) == report
    # An older or newer report: missing fields take their defaults, unknown keys go.
    assert LeakReport.from_dict({"mode": "warn", "leaked": [], "kept": [], "new": 1}) == (
        LeakReport("warn", (), ())
    )


def test_a_tests_verdict_is_the_worst_of_its_checks() -> None:
    own = LeakReport("fail", (), (("cuBLAS/cuBLASLt workspaces", ((0, 8),)),))
    rank1 = LeakReport("fail", ((1, 1 << 20),), (), top="t.py:9 in t", holder="t.K (x)", rank=1)
    assert junit_properties([own, rank1]) == [
        ("cuda_leak_verdict", "leaked"),
        ("cuda_leak_tolerance", "0"),
        ("cuda_leak_rank1_verdict", "leaked"),
        ("cuda_leak_rank1_tolerance", "0"),
        ("cuda_leak_rank1_bytes", "cuda:1=1048576"),
        ("cuda_leak_rank1_line", "t.py:9 in t"),
        ("cuda_leak_rank1_holder", "t.K (x)"),
    ]
    rows = [own.row("t.py::t"), rank1.row("t.py::t"), own.row("t.py::u")]
    assert json_report(rows)["summary"] == {
        "checked": 2,
        "clean": 0,
        "kept": 1,
        "warned": 0,
        "leaked": 1,
        "leaked_bytes": {"cuda:1": 1 << 20},
    }
    assert rank1.accepted("known").verdict == "kept"
    assert rank1.accepted("known").kept == (("known", ((1, 1 << 20),)),)


# ---------------------------------------------------------------------------
# pytest_cuda_leak_report: a project acts on a verdict.


def _add_to_conftest(pytester: pytest.Pytester, source: str) -> None:
    conftest = pytester.path / "conftest.py"
    conftest.write_text(conftest.read_text() + source)


HOOKED = """
import json
from pathlib import Path

def pytest_cuda_leak_report(report, item):
    with Path("verdicts.jsonl").open("a") as out:
        out.write(json.dumps({"nodeid": item.nodeid, **report.to_dict()}) + "\\n")
    if item.name == "test_known" and report.leaked:
        return report.accepted("known leak: issue 12")
    return None
"""

KNOWN = """
KEEP = []

def test_known(fake_cuda):
    KEEP.append(fake_cuda.tensor(4096))

def test_new(fake_cuda):
    KEEP.append(fake_cuda.tensor(512))

def test_clean(fake_cuda):
    x = fake_cuda.tensor(512)
    del x
"""


def test_a_conftest_hook_sees_every_verdict_and_can_accept_a_known_leak(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(KNOWN)
    _add_to_conftest(pytester, HOOKED)
    result = pytester.runpytest("--cuda-leak-check", "--cuda-leak-report=leaks.json", "-v")
    assert result.parseoutcomes() == {"passed": 3, "leaked": 1}
    result.stdout.fnmatch_lines(
        ["test_planted.py::test_known - known leak: issue 12: 4.0 KiB on cuda:0"]
    )
    result.stdout.fnmatch_lines(["LEAKED test_planted.py::test_new - 512 B on cuda:0, *"])
    seen = [
        json.loads(line) for line in (pytester.path / "verdicts.jsonl").read_text().splitlines()
    ]
    assert [(row["nodeid"].split("::")[1], row["leaked"]) for row in seen] == [
        ("test_known", [[0, 4096]]),
        ("test_new", [[0, 512]]),
        ("test_clean", []),
    ]
    rows = {r["nodeid"]: r for r in json.loads((pytester.path / "leaks.json").read_text())["tests"]}
    assert rows["test_planted.py::test_known"]["verdict"] == "kept"
    assert rows["test_planted.py::test_new"]["verdict"] == "leaked"


def test_a_hook_can_make_a_leak_a_warning(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(KNOWN)
    _add_to_conftest(
        pytester,
        """
import dataclasses

def pytest_cuda_leak_report(report, item):
    return dataclasses.replace(report, mode="warn")
""",
    )
    result = pytester.runpytest("--cuda-leak-check", "--junitxml=j.xml")
    assert result.parseoutcomes() == {"passed": 3, "warnings": 2}
    result.stdout.fnmatch_lines(["WARNED test_planted.py::test_known - 4.0 KiB on cuda:0, *"])
    cases = ET.parse(pytester.path / "j.xml").getroot().iter("testcase")
    verdicts = {
        c.get("name"): {p.get("name"): p.get("value") for p in c.iter("property")}[
            "cuda_leak_verdict"
        ]
        for c in cases
    }
    assert verdicts == {"test_known": "warned", "test_new": "warned", "test_clean": "clean"}


def test_the_hook_is_documented_for_plugins(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        def pytest_cuda_leak_report(report, item, unknown_argument):
            pass
        """
    )
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess()
    # pluggy checks an implementation against the spec: the spec is there.
    result.stderr.fnmatch_lines(
        ["*Argument(s) {'unknown_argument'} are declared in the hookimpl but can not be found*"]
    )


# ---------------------------------------------------------------------------
# A failed test's traceback is not a leak.

TRACEBACK = """
import sys
import types

# An installed library whose helper keeps its data in a closure, as
# torch.autograd.gradcheck's vjp_fn does.
planted_lib = types.ModuleType("planted_lib")
planted_lib.__file__ = "/usr/lib/python3/site-packages/planted_lib/__init__.py"
exec(
    "def make_vjp(data):\\n"
    "    def vjp_fn():\\n"
    "        return data\\n"
    "    return vjp_fn\\n",
    planted_lib.__dict__,
)
sys.modules["planted_lib"] = planted_lib


class CheckFailed(AssertionError):
    def __init__(self, message, vjp_fn):
        super().__init__(message)
        self.vjp_fn = vjp_fn


def test_fails_holding_a_library_closure(fake_cuda):
    vjp_fn = planted_lib.make_vjp([fake_cuda.tensor(8192)])
    raise CheckFailed("Jacobian mismatch", vjp_fn)


def test_fails_holding_its_own_closure(fake_cuda):
    data = [fake_cuda.tensor(4096)]

    def check():
        return data

    raise CheckFailed("mismatch", check)
"""


def test_memory_only_a_failed_tests_traceback_holds_is_no_leak(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(TRACEBACK)
    # In a subprocess: an in-process run's hook recorder keeps every CallInfo, and with
    # it every failure's traceback.
    result = pytester.runpytest_subprocess(
        "--cuda-leak-check", "--cuda-leak-report=leaks.json", "-v"
    )
    assert result.parseoutcomes() == {"failed": 2}
    result.stdout.no_fnmatch_line("*LEAKED*")
    result.stdout.no_fnmatch_line("*library cache*")
    # Said with the failure itself.
    result.stdout.fnmatch_lines(
        [
            "*_ test_fails_holding_a_library_closure _*",
            "*CheckFailed: Jacobian mismatch",
            "*- CUDA memory leak check: teardown -*",
            "8.0 KiB on cuda:0 held only by the failed test's traceback: "
            "planted_lib.make_vjp.<locals>.vjp_fn closure variable 'data'[0]: released with "
            "it, so not a leak (pytest keeps a failed test's traceback until the next test "
            "runs).",
        ]
    )
    document = json.loads((pytester.path / "leaks.json").read_text())
    verdicts = {row["nodeid"].split("::")[1]: row["verdict"] for row in document["tests"]}
    assert verdicts == {
        "test_fails_holding_a_library_closure": "kept",
        "test_fails_holding_its_own_closure": "kept",
    }
