"""Poisoned-context handling through real pytest runs, with a simulated sticky error.

The planted suites' ``conftest.py`` swaps the plugin's health check (the one seam,
``PoisonGuard.check``) for a fake GPU whose "bad kernel" poisons the process the way a
device-side assert does: the test that launched it returns normally, every later
"CUDA call" in that process raises, and with CUDA_LAUNCH_BLOCKING=1 the launch itself
raises. Everything else (blame, fresh processes, report merging, xdist) runs for real.
The same flows on a real GPU are in ``test_poison_gpu.py``.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pathlib import Path

FAKE_CONFTEST = """
import os
import pytest
from gpumagic import cuda

ASSERT = (
    "CUDA error: device-side assert triggered\\n"
    "Search for `cudaErrorAssert' in https://docs.nvidia.com/cuda/cuda-runtime-api/\\n"
    "CUDA kernel errors might be asynchronously reported at some other API call\\n"
)
POISONED = []


def fake_check():
    if not POISONED:
        return None
    if len(POISONED) == 1:
        # What a real kernel prints when its assert fires, at the next synchronize.
        os.write(2, b"IndexKernel.cu:111: Assertion `index out of bounds` failed.\\n")
        POISONED.append(True)
    return cuda.AsyncCudaError(ASSERT, sticky=True)


def pytest_sessionstart(session):
    guard = session.config.pluginmanager.get_plugin("cuda.poison")
    if guard is not None:
        guard.check = fake_check


class FakeGpu:
    def launch_bad_kernel(self):
        # Like x[idx] with an out-of-range CUDA index: queued, fails later...
        if os.environ.get("CUDA_LAUNCH_BLOCKING") == "1":
            raise RuntimeError(ASSERT)  # ...unless launches are synchronous.
        POISONED.append(True)

    def op(self):
        if POISONED:
            raise RuntimeError(ASSERT)
        return 1


@pytest.fixture
def gpu(request):
    with open("pids.txt", "a") as f:
        f.write(f"{request.node.name} {os.getpid()}\\n")
    return FakeGpu()
"""


def planted_suite(pytester: pytest.Pytester, bad: tuple[int, ...] = (3,), extra: str = "") -> None:
    """Ten tests; those numbered in ``bad`` launch the bad kernel, the others one op."""
    pytester.makeconftest(FAKE_CONFTEST)
    tests = []
    for n in range(1, 11):
        body = "gpu.launch_bad_kernel()  # the faulty line" if n in bad else "assert gpu.op() == 1"
        tests.append(f"def test_{n:02d}(gpu):\n    {body}\n")
    pytester.makepyfile(test_planted="\n\n".join(tests) + extra)


def pids(pytester: pytest.Pytester) -> dict[str, int]:
    lines = (pytester.path / "pids.txt").read_text().split("\n")
    return {name: int(pid) for name, pid in (line.split() for line in lines if line)}


def test_without_the_plugin_one_bad_kernel_fails_every_later_test(
    pytester: pytest.Pytester,
) -> None:
    planted_suite(pytester)
    result = pytester.runpytest_subprocess("-p", "no:pytest_cuda.sync_plugin")
    # The culprit passes and the seven innocent tests after it fail: the cascade.
    result.assert_outcomes(passed=3, failed=7)


def test_continue_is_the_default_and_blames_the_culprit_once(pytester: pytest.Pytester) -> None:
    planted_suite(pytester)
    result = pytester.runpytest_subprocess("-rf")
    result.assert_outcomes(passed=9, failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "test_planted.py ..F.......*[[]100%[]]",
            "*_ test_03 _*",
            "pytest_cuda: an asynchronous CUDA error surfaced after the test's body returned: "
            "device-side assert triggered (cudaErrorAssert)",
            "It comes from GPU work this test queued; --cuda-rerun-blocking or "
            "--cuda-sync=per-op show the line that queued it.",
            "*- pytest_cuda -*",
            "this test left a sticky CUDA error (device-side assert triggered "
            "(cudaErrorAssert)): every later CUDA call in this process would fail, so the "
            "remaining tests continue in a fresh process (--cuda-on-poison=continue).",
            "reproduce: *CUDA_LAUNCH_BLOCKING=1 pytest 'test_planted.py::test_03'",
            "*- Captured stderr call -*",
            "IndexKernel.cu:111: Assertion `index out of bounds` failed.",
            "*= CUDA context poisoned =*",
            "test_planted.py::test_03 left a sticky CUDA error: device-side assert triggered "
            "(cudaErrorAssert); the tests after it ran in a fresh process",
            "FAILED test_planted.py::test_03 - Failed: pytest_cuda: an asynchronous CUDA *",
            "*= 1 failed, 9 passed in *",
        ]
    )
    ran = pids(pytester)
    assert ran["test_01"] == ran["test_03"]
    assert {ran[f"test_{n:02d}"] for n in range(4, 11)} == {ran["test_04"]} != {ran["test_03"]}


def test_continue_merges_the_junit_xml(pytester: pytest.Pytester) -> None:
    planted_suite(pytester)
    result = pytester.runpytest_subprocess("--junitxml=report.xml")
    result.assert_outcomes(passed=9, failed=1)
    suite = ET.parse(pytester.path / "report.xml").getroot().find("testsuite")
    assert suite is not None
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("10", "1", "0")
    failed = [
        case.get("name") for case in suite.iter("testcase") if case.find("failure") is not None
    ]
    assert failed == ["test_03"]


def test_continue_feeds_last_failed(pytester: pytest.Pytester) -> None:
    planted_suite(pytester)
    pytester.runpytest_subprocess().assert_outcomes(passed=9, failed=1)
    result = pytester.runpytest_subprocess("--lf")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["run-last-failure: rerun previous 1 failure*"])


def test_each_further_culprit_gets_another_fresh_process(pytester: pytest.Pytester) -> None:
    planted_suite(pytester, bad=(3, 7))
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=8, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*= CUDA context poisoned =*",
            "test_planted.py::test_03 left a sticky CUDA error: *; the tests after it ran in a "
            "fresh process",
            "test_planted.py::test_07 left a sticky CUDA error: *; the tests after it ran in "
            "another fresh process",
        ]
    )
    ran = pids(pytester)
    assert len({ran["test_01"], ran["test_04"], ran["test_08"]}) == 3


def test_stop_ends_the_run_at_the_culprit(pytester: pytest.Pytester) -> None:
    planted_suite(pytester)
    result = pytester.runpytest_subprocess("--cuda-on-poison=stop")
    result.assert_outcomes(passed=2, failed=1)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(
        [
            "cuda debug: --cuda-on-poison=stop",
            "*so the run stops here (--cuda-on-poison=stop).",
            "*Interrupted: pytest_cuda: test_planted.py::test_03 left a sticky CUDA error "
            "(device-side assert triggered); stopping (--cuda-on-poison=stop)*",
        ]
    )


def test_skip_skips_the_rest_with_the_culprit_in_the_reason(pytester: pytest.Pytester) -> None:
    planted_suite(pytester)
    result = pytester.runpytest_subprocess("--cuda-on-poison=skip", "-rs")
    result.assert_outcomes(passed=2, failed=1, skipped=7)
    reason = (
        "pytest_cuda: test_planted.py::test_03 left a sticky CUDA error in this process "
        "(device-side assert triggered) (--cuda-on-poison=skip)"
    )
    skipped = [line for line in result.stdout.lines if line.startswith("SKIPPED [1] ")]
    assert len(skipped) == 7
    assert all(line.endswith(f": {reason}") for line in skipped)
    assert skipped[0].startswith("SKIPPED [1] test_planted.py:13: ")
    assert set(pids(pytester)) == {"test_01", "test_02", "test_03"}


@pytest.mark.parametrize("bad", [(3,), (3, 7)])
def test_xdist_replaces_the_worker_and_reports_the_culprit_once(
    pytester: pytest.Pytester, bad: tuple[int, ...]
) -> None:
    planted_suite(pytester, bad=bad)
    result = pytester.runpytest_subprocess("-n", "2")
    result.assert_outcomes(passed=10 - len(bad), failed=len(bad))
    result.stdout.fnmatch_lines(["replacing crashed worker gw*", "*= CUDA context poisoned =*"])
    text = result.stdout.str()
    assert "crashed while running" not in text
    for n in bad:
        assert re.search(
            rf"test_planted.py::test_{n:02d} left a sticky CUDA error: .*; xdist worker gw\d "
            r"was replaced; the test is reported once, above",
            text,
        )


def test_xdist_stop_stops_every_worker(pytester: pytest.Pytester) -> None:
    planted_suite(pytester)
    result = pytester.runpytest_subprocess("-n", "2", "--cuda-on-poison=stop")
    outcomes = result.parseoutcomes()
    assert outcomes["failed"] == 1
    assert outcomes.get("passed", 0) < 9
    result.stdout.fnmatch_lines(["*stopping (--cuda-on-poison=stop)*"])


@pytest.mark.parametrize("version", ["3.5.0", "3.6.0"])
def test_xdist_stop_needs_an_xdist_whose_workers_stop(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    """Before pytest-xdist 3.6.1 the workers ran on after the culprit (issue 29)."""
    import xdist

    monkeypatch.setattr(xdist, "__version__", version)
    pytester.makepyfile("def test_a():\n    pass\n")
    result = pytester.runpytest("-n", "2", "--cuda-on-poison=stop")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*--cuda-on-poison=stop under pytest-xdist needs pytest-xdist 3.6.1 or later "
            f"(earlier workers do not stop the run); {version} is installed: upgrade it "
            "(pip install 'pytest-xdist>=3.6.1') or run without -n*"
        ]
    )
    # Without -n, or with another action, that pytest-xdist is fine.
    assert pytester.runpytest("--cuda-on-poison=stop").ret == pytest.ExitCode.OK
    assert pytester.runpytest("-n", "0", "--cuda-on-poison=stop").ret == pytest.ExitCode.OK


def test_rerun_blocking_adds_the_line_that_really_failed(pytester: pytest.Pytester) -> None:
    planted_suite(pytester)
    result = pytester.runpytest_subprocess("--cuda-rerun-blocking")
    result.assert_outcomes(passed=9, failed=1)
    result.stdout.fnmatch_lines(
        [
            "It comes from GPU work this test queued; the re-run below shows the line that "
            "queued it.",
            "*- pytest_cuda -*",
            "this test left a sticky CUDA error*",
            "re-run alone in a fresh process with CUDA_LAUNCH_BLOCKING=1: failed",
            "  at conftest.py:33 in launch_bad_kernel",
            "      raise RuntimeError(ASSERT)  # ...unless launches are synchronous.",
            "  called from test_planted.py:10 in test_03",
            "      gpu.launch_bad_kernel()  # the faulty line",
            "  RuntimeError: CUDA error: device-side assert triggered",
            "reproduce: *CUDA_LAUNCH_BLOCKING=1 pytest 'test_planted.py::test_03'",
        ]
    )


def test_rerun_blocking_under_xdist(pytester: pytest.Pytester) -> None:
    planted_suite(pytester)
    result = pytester.runpytest_subprocess("-n", "2", "--cuda-rerun-blocking")
    result.assert_outcomes(passed=9, failed=1)
    result.stdout.fnmatch_lines(["  called from test_planted.py:10 in test_03"])


def test_rerun_blocking_says_when_the_test_passes_alone(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(FAKE_CONFTEST)
    pytester.makepyfile(
        test_order="""
        import conftest

        def test_a():
            conftest.LEFT_BEHIND = True  # state an earlier test leaves in the process

        def test_b():
            if getattr(conftest, "LEFT_BEHIND", False):
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
        """
    )
    result = pytester.runpytest_subprocess("--cuda-rerun-blocking")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*- pytest_cuda -*",
            "re-run alone in a fresh process with CUDA_LAUNCH_BLOCKING=1: passed. Alone, the "
            "test does not fail: the failure needs what earlier tests left behind in this "
            "process, or it is intermittent.",
            "reproduce: *CUDA_LAUNCH_BLOCKING=1 pytest 'test_order.py::test_b'",
        ]
    )


def test_a_cuda_error_raised_by_the_test_gets_a_repro_line(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(FAKE_CONFTEST)
    pytester.makepyfile(
        test_raise="""
        def test_invalid(gpu):
            raise RuntimeError("CUDA error: invalid argument")

        def test_plain(gpu):
            assert 1 == 2
        """
    )
    result = pytester.runpytest_subprocess("-rf")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "E       RuntimeError: CUDA error: invalid argument",
            "*- pytest_cuda -*",
            "reproduce: *CUDA_LAUNCH_BLOCKING=1 pytest 'test_raise.py::test_invalid'",
        ]
    )
    text = result.stdout.str()
    assert "sticky" not in text
    assert "CUDA context poisoned" not in text
    assert text.count("reproduce:") == 1


def test_a_poisoning_fixture_fails_its_setup_once(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(FAKE_CONFTEST)
    pytester.makepyfile(
        test_setup="""
        import pytest

        @pytest.fixture
        def broken_input(gpu):
            gpu.launch_bad_kernel()
            gpu.op()

        def test_1(gpu):
            assert gpu.op() == 1

        def test_2(broken_input):
            pass

        def test_3(gpu):
            assert gpu.op() == 1
        """
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        ["*ERROR at setup of test_2*", "*this test left a sticky CUDA error*"]
    )


def test_the_culprit_tears_down_every_fixture_scope(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(FAKE_CONFTEST)
    pytester.makepyfile(
        test_scopes="""
        import pytest

        import conftest

        @pytest.fixture(scope="module")
        def model():
            gpu = conftest.FakeGpu()
            yield gpu
            gpu.op()  # e.g. a synchronize in the finalizer: fails in a poisoned process

        def test_1(model):
            assert model.op() == 1

        def test_2(model):
            model.launch_bad_kernel()

        def test_3(model):
            assert model.op() == 1
        """
    )
    result = pytester.runpytest_subprocess()
    # The finalizer's error belongs to the culprit, not to an internal error at exit.
    result.assert_outcomes(passed=2, failed=1, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_2*"])
    assert "INTERNALERROR" not in result.stdout.str()


def test_a_test_that_crashes_the_fresh_process_is_reported(pytester: pytest.Pytester) -> None:
    planted_suite(
        pytester,
        extra="""

def test_11_crash(request):
    import os
    if request.config.getoption("cuda_internal_resume"):
        os._exit(9)

def test_12(gpu):
    assert gpu.op() == 1
""",
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=10, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*_ test_11_crash _*",
            "pytest_cuda: the fresh pytest process running this test ended unexpectedly "
            "(exit status 9); its last output:",
        ]
    )


def test_a_test_the_fresh_process_does_not_collect_is_an_error(
    pytester: pytest.Pytester,
) -> None:
    planted_suite(
        pytester,
        extra="""

import os, pytest

@pytest.mark.parametrize("pid", [os.getpid()])
def test_11_per_process(pid):
    pass
""",
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=9, failed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_11_per_process*",
            "pytest_cuda: the fresh pytest process did not collect this test (its collection "
            "differs from this session's)",
        ]
    )


def test_a_fresh_process_that_cannot_start_stops_the_run(pytester: pytest.Pytester) -> None:
    planted_suite(pytester)
    conftest = pytester.path / "conftest.py"
    conftest.write_text(
        conftest.read_text()
        + "\nimport sys\nif any(a.startswith('--cuda-internal-resume') for a in sys.argv):"
        "\n    raise ImportError('cannot import in the fresh process')\n"
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=2, failed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_04*",
            "pytest_cuda: pytest_cuda could not continue the session in a fresh process: it "
            "exited with status 4 before running a test; its last output:",
            "*cannot import in the fresh process*",
            "*Interrupted: pytest_cuda: could not continue in a fresh process*",
        ]
    )


def test_warnings_of_the_fresh_process_reach_the_summary(pytester: pytest.Pytester) -> None:
    planted_suite(
        pytester,
        extra="""

import warnings

def test_11_warns():
    warnings.warn("said in the fresh process", DeprecationWarning)
""",
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=10, failed=1, warnings=1)
    result.stdout.fnmatch_lines(
        [
            "*= warnings summary =*",
            "test_planted.py::test_11_warns",
            "*DeprecationWarning: said in the fresh process",
        ]
    )


def test_maxfail_stops_before_a_fresh_process(pytester: pytest.Pytester) -> None:
    planted_suite(pytester)
    result = pytester.runpytest_subprocess("-x")
    result.assert_outcomes(passed=2, failed=1)
    assert set(pids(pytester)) == {"test_01", "test_02", "test_03"}


def test_under_pdb_the_default_becomes_stop(pytester: pytest.Pytester) -> None:
    planted_suite(pytester)
    result = pytester.runpytest_subprocess("--pdb", "-k", "test_01")
    result.stdout.fnmatch_lines(
        ["cuda debug: --cuda-on-poison=stop (continue is not possible under --pdb/--trace)"]
    )


def test_continue_with_pdb_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--pdb", "--cuda-on-poison=continue")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: --cuda-on-poison=continue runs the remaining tests in a fresh process, "
            "where --pdb/--trace cannot reach them: use --cuda-on-poison=stop or skip."
        ]
    )


def test_a_cpu_suite_pays_nothing_and_prints_nothing(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_cpu="""
        def test_a():
            pass

        def test_b():
            assert False
        """
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1, failed=1)
    text = result.stdout.str()
    assert "cuda debug" not in text
    assert "pytest_cuda" not in text
    assert "CUDA context poisoned" not in text


def test_the_guard_checks_only_processes_with_a_cuda_context(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import pytest
        from gpumagic import cuda

        CALLS = []

        def pytest_sessionstart(session):
            guard = session.config.pluginmanager.get_plugin("cuda.poison")
            assert guard.check is cuda.async_error
            def counted():
                CALLS.append(cuda.is_initialized())
                return cuda.async_error()
            guard.check = counted

        def pytest_sessionfinish(session):
            print("CHECKS", len(CALLS), "INITIALISED", any(CALLS))
        """
    )
    pytester.makepyfile(test_x="def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    result = pytester.runpytest_subprocess("-s")
    result.assert_outcomes(passed=2)
    # After the body and after the teardown of each test; without a context each is free.
    result.stdout.fnmatch_lines(["*CHECKS 4 INITIALISED False*"])


def test_the_plugin_is_registered_with_pytest_cuda(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import pytest

        @pytest.hookimpl(trylast=True)
        def pytest_configure(config):
            names = [name for name, _ in config.pluginmanager.list_name_plugin()]
            ours = [n for n in names if n.startswith(("cuda.poison", "pytest_cuda."))]
            print("NAMES", sorted(ours))
        """
    )
    result = pytester.runpytest_subprocess("-s", "--co", "-q")
    names = next(line for line in result.stdout.lines if line.startswith("NAMES "))
    for name in ("'cuda.poison'", "'cuda.poison-summary'", "'pytest_cuda.sync_plugin'"):
        assert name in names
    disabled = pytester.runpytest_subprocess("-s", "--co", "-q", "-p", "no:cuda")
    assert "pytest_cuda.sync_plugin" not in disabled.stdout.str()


def test_internal_resume_needs_its_directory(pytester: pytest.Pytester, tmp_path: Path) -> None:
    result = pytester.runpytest(f"--cuda-internal-resume={tmp_path}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"ERROR: --cuda-internal-resume={tmp_path}: no nodeids.json there"]
    )
