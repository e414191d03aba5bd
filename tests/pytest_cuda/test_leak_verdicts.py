"""The leak check's verdicts as CI reads them and as the heap decides them, through real
pytest runs on the fake allocator (``planted``, see conftest.py and fake_cuda.py):
the ``--cuda-leak-report`` JSON file, JUnit properties, the totals line, the
``cuda_leak_tolerance`` ini default, the holder search's time limit, and the test's own
heap collected before the whole heap."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from collections.abc import Callable

SUITE = """
KEEP = []

def test_clean(fake_cuda):
    x = fake_cuda.tensor(1 << 20)
    del x

def test_leaks(fake_cuda):
    KEEP.append(fake_cuda.tensor(4096))

def test_cublas(fake_cuda):
    fake_cuda.matmul()

def test_no_cuda():
    pass
"""


def _check_schema(document: dict[str, Any]) -> None:
    assert set(document) == {"version", "tests", "summary"}
    assert document["version"] == 1
    for row in document["tests"]:
        assert set(row) == {
            "nodeid",
            "rank",
            "verdict",
            "mode",
            "tolerance",
            "leaked",
            "kept",
            "line",
            "holder",
        }
        assert row["verdict"] in ("clean", "kept", "warned", "leaked")
        assert isinstance(row["tolerance"], int)
        assert all(d.startswith("cuda:") and isinstance(b, int) for d, b in row["leaked"].items())
        for kept in row["kept"]:
            assert set(kept) == {"step", "bytes"}
    summary = document["summary"]
    assert set(summary) == {"checked", "clean", "kept", "warned", "leaked", "leaked_bytes"}
    assert summary["checked"] == len(document["tests"])


def test_the_json_report_lists_every_checked_test(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(SUITE)
    result = pytester.runpytest("--cuda-leak-check", "--cuda-leak-report=leaks.json")
    assert result.parseoutcomes() == {"passed": 4, "leaked": 1}
    document = json.loads((pytester.path / "leaks.json").read_text())
    _check_schema(document)
    rows = {row["nodeid"]: row for row in document["tests"]}
    # test_no_cuda never initialised the made-up CUDA before the others: still checked.
    assert rows["test_planted.py::test_clean"]["verdict"] == "clean"
    assert rows["test_planted.py::test_cublas"]["verdict"] == "kept"
    assert rows["test_planted.py::test_cublas"]["kept"] == [
        {"step": "cuBLAS/cuBLASLt workspaces", "bytes": {"cuda:0": 32 * 1024**2}}
    ]
    leak = rows["test_planted.py::test_leaks"]
    assert leak == {
        "nodeid": "test_planted.py::test_leaks",
        "rank": None,
        "verdict": "leaked",
        "mode": "fail",
        "tolerance": 0,
        "leaked": {"cuda:0": 4096},
        "kept": [],
        "line": "test_planted.py:8 in test_leaks",
        "holder": "test_planted.KEEP[0] (module global)",
    }
    assert document["summary"]["leaked"] == 1
    assert document["summary"]["leaked_bytes"] == {"cuda:0": 4096}
    result.stdout.fnmatch_lines(
        [
            "cuda leak check: 4 tests checked, 1 leaked, 1 kept (4.0 KiB on cuda:0 leaked); "
            "report written to leaks.json"
        ]
    )


def test_under_xdist_one_report_and_junit_properties_cover_every_worker(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    """The controller alone writes the report, with every worker's tests in it. The
    check is switched on by the ini value alone: it reaches the workers (one xdist run,
    each process importing torch, for the settings' fact too)."""
    pytest.importorskip("xdist")
    planted(SUITE)
    pytester.makeini("[pytest]\ncuda_leak_check = true\ncuda_leak_holder_search = none\n")
    result = pytester.runpytest_subprocess(
        "-n", "2", "--cuda-leak-report=leaks.json", "--junitxml=junit.xml"
    )
    assert result.parseoutcomes() == {"passed": 4, "leaked": 1}
    document = json.loads((pytester.path / "leaks.json").read_text())
    _check_schema(document)
    assert document["summary"]["checked"] == 4
    result.stdout.fnmatch_lines(
        ["cuda leak check: 4 tests checked, 1 leaked, 1 kept *; report written to leaks.json"]
    )
    assert result.stdout.str().count("report written") == 1
    properties = {
        case.get("name"): {p.get("name"): p.get("value") for p in case.iter("property")}
        for case in ET.parse(pytester.path / "junit.xml").getroot().iter("testcase")
    }
    assert properties["test_leaks"] == {
        "cuda_leak_verdict": "leaked",
        "cuda_leak_tolerance": "0",
        "cuda_leak_bytes": "cuda:0=4096",
        "cuda_leak_line": "test_planted.py:8 in test_leaks",
        "cuda_leak_holder": "test_planted.KEEP[0] (module global)",
    }
    assert properties["test_clean"] == {"cuda_leak_verdict": "clean", "cuda_leak_tolerance": "0"}


def test_a_report_into_a_missing_folder_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("--cuda-leak-check", "--cuda-leak-report=nowhere/leaks.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: --cuda-leak-report=nowhere/leaks.json: the folder "
            f"{pytester.path / 'nowhere'} does not exist; create it first"
        ]
    )


def test_the_ini_tolerance_is_the_default_and_the_marker_overrides_it(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(
        """
        import pytest

        KEEP = []

        def test_within_the_ini_tolerance(fake_cuda):
            KEEP.append(fake_cuda.tensor(2048))

        def test_over_it(fake_cuda):
            KEEP.append(fake_cuda.tensor(8192))

        @pytest.mark.cuda_leak_check
        def test_bare_marker_takes_the_ini_value(fake_cuda):
            KEEP.append(fake_cuda.tensor(4096))

        @pytest.mark.cuda_leak_check(tolerance=0)
        def test_marker_overrides(fake_cuda):
            KEEP.append(fake_cuda.tensor(512))
        """
    )
    pytester.makeini("[pytest]\ncuda_leak_tolerance = 4KiB\ncuda_leak_holder_search = none\n")
    result = pytester.runpytest("--cuda-leak-check", "--cuda-leak-report=leaks.json")
    assert result.parseoutcomes() == {"passed": 4, "leaked": 2}
    rows = {
        r["nodeid"].split("::")[1]: r
        for r in json.loads((pytester.path / "leaks.json").read_text())["tests"]
    }
    assert rows["test_within_the_ini_tolerance"]["verdict"] == "clean"
    assert rows["test_over_it"]["tolerance"] == 4096
    assert rows["test_over_it"]["verdict"] == "leaked"
    assert rows["test_bare_marker_takes_the_ini_value"]["verdict"] == "clean"
    assert rows["test_marker_overrides"]["verdict"] == "leaked"


@pytest.mark.parametrize(
    ("ini", "message"),
    [
        ("cuda_leak_tolerance = lots", "*cuda_leak_tolerance (ini): tolerance must be a size*"),
        ("cuda_leak_holder_search = -1", "*cuda_leak_holder_search (ini) takes seconds > 0*"),
    ],
)
def test_malformed_ini_values_are_usage_errors(
    pytester: pytest.Pytester, ini: str, message: str
) -> None:
    pytester.makepyfile("def test_x(): pass")
    pytester.makeini(f"[pytest]\n{ini}\n")
    result = pytester.runpytest("--cuda-leak-check")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_a_search_out_of_time_says_so_on_the_leaked_line(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(SUITE)
    pytester.makeini("[pytest]\ncuda_leak_holder_search = 0.000001\n")
    result = pytester.runpytest("--cuda-leak-check")
    result.stdout.fnmatch_lines(
        [
            "cuda leak check: *holders searched up to 1e-06 s a test",
            "LEAKED test_planted.py::test_leaks - 4.0 KiB on cuda:0, allocated at "
            "test_planted.py:8 in test_leaks, held by an unknown holder (the search stopped at "
            "its time limit; --cuda-leak-trace searches to the end)",
        ]
    )


def test_a_block_no_tensor_shows_says_nothing_in_python_holds_it(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(
        """
        from gpumagic import cuda

        HIDDEN = []

        def test_hidden(fake_cuda):
            HIDDEN.append(fake_cuda.tensor(4096))
            cuda.tensor_facts = lambda obj: None  # as if only C++ held the block
        """
    )
    result = pytester.runpytest_subprocess("--cuda-leak-check")
    result.stdout.fnmatch_lines(
        [
            "LEAKED test_planted.py::test_hidden - 4.0 KiB on cuda:0, allocated at "
            "test_planted.py:6 in test_hidden, held by no Python object: 1 block that no "
            "Python tensor shows (C++ side: *)"
        ]
    )


def test_a_tensor_only_cpp_holds_is_where_its_path_starts(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    # No Python object refers to the tensor: the walk says so, and never names the
    # checker's own list of the test's tensors as its holder.
    planted(
        """
        import ctypes

        def test_held_by_cpp(fake_cuda):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(fake_cuda.tensor(4096)))
        """
    )
    result = pytester.runpytest_subprocess("--cuda-leak-check")
    result.stdout.fnmatch_lines(
        [
            "LEAKED test_planted.py::test_held_by_cpp - 4.0 KiB on cuda:0, allocated at "
            "test_planted.py:4 in test_held_by_cpp, held by a FakeTensor that no Python "
            "object holds (C++ does, or a running function) (no Python root: C++ holds "
            "where the path starts)"
        ]
    )


# ---------------------------------------------------------------------------
# The test's own heap first. In a process of its own: this suite's conftest freezes the
# heap (the checker then leaves the collector alone), and in-process runs keep objects.


@pytest.mark.parametrize("frozen_first", [False, True], ids=["own-freeze", "frozen-by-a-plugin"])
def test_only_garbage_with_older_objects_needs_the_whole_heap_collected(
    pytester: pytest.Pytester,
    planted: Callable[[str], None],
    frozen_first: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Also where a plugin froze objects before the session: the checker cannot freeze
    the heap per test then, collects the young generations, and the whole heap only
    where the walk proved nothing. What the interpreter froze by itself (CPython 3.12's
    start-up tuples) does not stop the checker's own freeze."""
    monkeypatch.setenv("CHECKER_FREEZES", "0" if frozen_first else "1")
    planted(
        """
        import gc
        import os

        import pytest

        KEEP = []
        FROZEN_BEFORE = gc.get_freeze_count()

        def test_the_checker_froze_the_older_heap(fake_cuda):
            froze = gc.get_freeze_count() > FROZEN_BEFORE
            assert froze == (os.environ["CHECKER_FREEZES"] == "1"), gc.get_freeze_count()

        class Old:
            pass

        OLD = Old()
        OLD.me = OLD  # a cycle made before the tests

        def test_young_cycle(fake_cuda):
            cycle = [fake_cuda.tensor(4096)]
            cycle.append(cycle)
            gc.disable(); gc.enable()  # no automatic collection in between matters

        def test_cycle_through_an_older_object(fake_cuda):
            global OLD
            OLD.tensor = fake_cuda.tensor(8192)
            OLD = None  # garbage now, with an object older than the test
            # Until the check: an automatic collection of the oldest generation (its
            # moment depends on what else the process allocated, another plugin's
            # import included) would free it before the check sees it.
            gc.disable()

        def test_held_by_a_module_global(fake_cuda):
            gc.enable()
            KEEP.append(fake_cuda.tensor(512))

        @pytest.mark.cuda_leak_check(mode="off")
        def test_the_heap_is_thawed_between_tests():
            # Ours thawed; frozen objects (Python 3.12 freezes a few) may have died since.
            assert gc.get_freeze_count() <= FROZEN_BEFORE
        """
    )
    pytester.makepyfile(freezer="import gc\n\ngc.freeze()\n")
    result = pytester.runpytest_subprocess(
        *(["-p", "freezer"] if frozen_first else []),
        "--cuda-leak-check",
        "-v",
        "--cuda-leak-report=leaks.json",
    )
    assert result.parseoutcomes() == {"passed": 5, "leaked": 1}
    rows = {
        r["nodeid"].split("::")[1]: r
        for r in json.loads((pytester.path / "leaks.json").read_text())["tests"]
    }
    # A cycle the test made goes with the collection of the test's own objects.
    assert rows["test_young_cycle"]["kept"][0]["step"].startswith("young garbage")
    # One through an older object needs the whole heap: collected, not called a leak.
    assert [k["step"] for k in rows["test_cycle_through_an_older_object"]["kept"]] == [
        "garbage collection (the whole heap)"
    ]
    # A leak whose holder is proven alive is judged without collecting the whole heap.
    assert rows["test_held_by_a_module_global"]["verdict"] == "leaked"
    lines = result.stdout.lines
    start = lines.index(
        "test_held_by_a_module_global left 512 B (512 B) allocated on cuda:0; tolerance 0 B."
    )
    assert lines[start + 1].startswith("Measured in this process's caching allocator after:")
    assert "whole heap" not in lines[start + 1]


def test_older_garbage_freed_by_the_whole_heap_collection_does_not_hide_a_leak(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    """Seen on torchvision's suite under -n 4: a test that leaks 1.5 KiB into a cache and
    also leaves garbage through an older object has the whole heap collected, which frees
    garbage an earlier test left too; the reading then falls under the baseline, yet the
    blocks the test allocated and a cache still holds are a leak."""
    planted(
        """
        import pytest

        KEEP = []

        class Old:
            pass

        OLD = Old()
        EARLIER = Old()

        @pytest.mark.cuda_leak_check(mode="off")
        def test_an_earlier_test_leaves_a_cycle(fake_cuda):
            global EARLIER
            EARLIER.me = EARLIER
            EARLIER.tensor = fake_cuda.tensor(8192)
            EARLIER = None  # garbage from now on, older than the next test

        def test_leaks_into_a_cache_and_drops_a_cycle(fake_cuda):
            global OLD
            KEEP.append(fake_cuda.tensor(1536))
            OLD.me = OLD
            OLD.tensor = fake_cuda.tensor(4096)
            OLD = None  # garbage through an object older than the test
        """
    )
    result = pytester.runpytest_subprocess("--cuda-leak-check", "--cuda-leak-report=leaks.json")
    assert result.parseoutcomes() == {"passed": 2, "leaked": 1}
    (row,) = json.loads((pytester.path / "leaks.json").read_text())["tests"]
    assert row["verdict"] == "leaked"
    assert row["leaked"] == {"cuda:0": 1536}
    assert row["line"] is not None
    assert "test_planted.py" in row["line"]
    assert "KEEP" in row["holder"]


def test_a_leak_option_with_the_leak_mode_switched_off_is_a_usage_error(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("--cuda-leak-check", "-p", "no:pytest_cuda.leak_plugin")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*--cuda-leak-check needs pytest_cuda.leak_plugin, which "
            "-p no:pytest_cuda.leak_plugin switched off: drop one of the two*"
        ]
    )


def test_the_memory_report_alone_is_not_announced_as_a_leak_check(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(SUITE)
    result = pytester.runpytest("--cuda-memory-report=1")
    assert result.parseoutcomes() == {"passed": 4}
    result.stdout.no_fnmatch_line("cuda leak check*")
    result.stdout.fnmatch_lines(["*= CUDA memory: the largest peak =*"])


def test_without_cuda_the_memory_report_says_what_it_cannot_do(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile("def test_x(): pass")
    pytester.makeconftest(
        "from gpumagic import cuda\n"
        "from gpumagic.devices import CudaStatus\n"
        "cuda.status = lambda: CudaStatus(False, 'no usable GPU: made up')\n"
    )
    result = pytester.runpytest_subprocess("--cuda-memory-report=1")
    result.stdout.fnmatch_lines(["cuda memory report: nothing to measure, *"])
    result.stdout.no_fnmatch_line("cuda leak check*")


@pytest.mark.parametrize("value", ["none", "0", "0.00"])
def test_a_holder_search_of_zero_or_none_has_no_limit(
    pytester: pytest.Pytester, planted: Callable[[str], None], value: str
) -> None:
    planted(SUITE)
    pytester.makeini(f"[pytest]\ncuda_leak_holder_search = {value}\n")
    result = pytester.runpytest("--cuda-leak-check")
    result.stdout.fnmatch_lines(["cuda leak check: *holders searched to the end"])


def test_a_memory_report_with_no_allocation_says_no_peaks(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    """It said "the 0 largest peaks" (issue 39)."""
    planted("def test_uses_cuda(fake_cuda):\n    pass\n")
    result = pytester.runpytest("--cuda-leak-check", "--cuda-memory-report=3")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*= CUDA memory: no peaks =*", "no test allocated CUDA memory"])
    result.stdout.no_fnmatch_line("*largest peak*")


def test_without_cuda_no_test_is_counted_as_checked(pytester: pytest.Pytester) -> None:
    """The header said "nothing to check" and the footer "1 test checked, no leak"
    (issue 39): without a usable GPU, no test is checked, and the footer says none."""
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.cuda_leak_check
        def test_marked():
            pass

        def test_plain():
            pass
        """
    )
    pytester.makeconftest(
        "from gpumagic import cuda\n"
        "from gpumagic.devices import CudaStatus\n"
        "cuda.status = lambda: CudaStatus(False, 'no usable GPU: made up')\n"
    )
    for option, header in [
        ("--cuda-leak-check", "cuda leak check: nothing to check"),
        ("--cuda-memory-report=3", "cuda memory report: nothing to measure"),  # and the marker
        ("-p no:cacheprovider", None),  # the marker alone
    ]:
        result = pytester.runpytest_subprocess(option)
        result.assert_outcomes(passed=2)
        if header is None:
            result.stdout.no_fnmatch_line("cuda *")
        else:
            result.stdout.fnmatch_lines([f"{header}, *no usable GPU: made up*"])
        result.stdout.no_fnmatch_line("cuda leak check: * checked*")
        result.stdout.no_fnmatch_line("*CUDA memory*")
