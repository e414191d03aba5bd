"""What the plugin does in a run that uses none of its features: nothing per test.

The per-test hooks (the check before each CUDA test, the checks after each test phase,
the leak checker, the sync modes, the leak outcome) are registered only when they have
work, and the modules behind them are imported only then. Each run here is a fresh
process, so what the outer session imported (torch) does not count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Callable

PER_TEST_PLUGINS = (
    "cuda.setup",
    "cuda.poison-checks",
    "cuda.poison-culprit-reports",
    "cuda.leaks",
    "cuda.leak-reports",
    "cuda.memory-limit",
    "cuda.sync-modes",
    "cuda.xdist",
)
LAZY_MODULES = (
    "torch",
    "gpumagic.cuda",
    "pytest_cuda.leaks.checker",
    "pytest_cuda.leaks.engine",
    "pytest_cuda.leaks.block",
    "pytest_cuda.leaks.limit",
    "pytest_cuda.leaks.limiter",
    "pytest_cuda.leaks.oom",
    "pytest_cuda.leaks.snapshots",
    "pytest_cuda.sync.checks",
    "pytest_cuda.sync.modes",
    "pytest_cuda.sync.poison",
    "pytest_cuda.sync.continuation",
    "pytest_cuda.child",
    "pytest_cuda.repro",
    "pytest_cuda.markers",
    "pytest_cuda.selection",
    "pytest_cuda.xdist_pinning",
)

REPORTING_CONFTEST = f"""
import sys

import pytest

PER_TEST_PLUGINS = {PER_TEST_PLUGINS!r}
LAZY_MODULES = {LAZY_MODULES!r}


def pytest_sessionfinish(session):
    manager = session.config.pluginmanager
    registered = sorted(name for name in PER_TEST_PLUGINS if manager.has_plugin(name))
    imported = sorted(name for name in LAZY_MODULES if name in sys.modules)
    print("\\nREGISTERED", registered)
    print("IMPORTED", imported)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    watches = [f for f in sys.meta_path if type(f).__name__ == "CudaImportWatch"]
    print("WATCHES LEFT", len(watches))
"""

CPU_SUITE = """
import pytest

@pytest.mark.parametrize("i", range(5))
def test_cpu(i):
    assert i >= 0

def test_fixture(tmp_path):
    assert tmp_path.exists()
"""


@pytest.fixture
def reporting(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(REPORTING_CONFTEST)
    return pytester


def test_a_cpu_run_registers_no_per_test_hook(reporting: pytest.Pytester) -> None:
    reporting.makepyfile(CPU_SUITE)
    result = reporting.runpytest_subprocess("-s")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines(["REGISTERED []", "IMPORTED []", "WATCHES LEFT 0"])


def test_a_cuda_test_registers_the_check_before_it(reporting: pytest.Pytester) -> None:
    reporting.makepyfile(
        CPU_SUITE
        + """
@pytest.mark.cuda
def test_gpu():
    pass
"""
    )
    result = reporting.runpytest_subprocess("-s")
    result.stdout.fnmatch_lines(["REGISTERED [[]*'cuda.setup'*[]]"])


def test_markers_register_their_hooks(reporting: pytest.Pytester) -> None:
    reporting.makepyfile(
        """
        import pytest

        pytestmark = pytest.mark.cuda_no_sync

        @pytest.mark.cuda_leak_check
        def test_x():
            pass
        """
    )
    result = reporting.runpytest_subprocess("-s")
    result.stdout.fnmatch_lines(
        ["REGISTERED [[]'cuda.leak-reports', 'cuda.leaks', *'cuda.sync-modes'[]]"]
    )


def test_the_xdist_hooks_are_registered_where_workers_start(
    reporting: pytest.Pytester,
) -> None:
    pytest.importorskip("xdist")
    reporting.makepyfile(CPU_SUITE)
    result = reporting.runpytest_subprocess("-s", "-n", "2")
    result.assert_outcomes(passed=6)
    # On the controller: the leak outcome of the workers' reports, and the pinning.
    result.stdout.fnmatch_lines(["REGISTERED [[]'cuda.leak-reports', *'cuda.xdist'[]]"])


def test_importing_a_cuda_library_starts_the_checks(reporting: pytest.Pytester) -> None:
    # A module of the same name as one of the CUDA libraries stands in for it.
    reporting.makepyfile(cupy="")
    reporting.makepyfile(
        test_lib="""
        import cupy

        def test_launch():
            raise RuntimeError("cudaErrorInvalidValue: invalid argument")
        """
    )
    result = reporting.runpytest_subprocess("-s")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["REGISTERED ['cuda.poison-checks']"])
    result.stdout.fnmatch_lines(
        [
            "*- pytest_cuda -*",
            "reproduce: *CUDA_LAUNCH_BLOCKING=1 pytest 'test_lib.py::test_launch'",
            "WATCHES LEFT 0",
        ]
    )


LATE_CONFTEST = """
from gpumagic import cuda

ASSERT = (
    "CUDA error: device-side assert triggered\\n"
    "CUDA kernel errors might be asynchronously reported at some other API call\\n"
)
POISONED = []
CHECKS = []


def fake_async_error():
    # The seam's health check on a pretend GPU, put in place without the guard's setter.
    CHECKS.append(1)
    return cuda.AsyncCudaError(ASSERT, sticky=True) if POISONED else None


cuda.async_error = fake_async_error


def pytest_sessionfinish(session):
    print("\\nCHECKS", len(CHECKS))
"""


def test_a_test_that_imports_the_first_cuda_library_is_still_blamed(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(LATE_CONFTEST)
    pytester.makepyfile(cupy="")
    pytester.makepyfile(
        test_late="""
        import conftest

        def test_1():
            pass

        def test_2():
            import cupy  # the first CUDA library of the process, inside the test

            conftest.POISONED.append(True)  # a bad kernel, queued

        def test_3():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-s")
    # test_2's body ran before the checks started; the check after its teardown
    # finds the error and blames it; test_3 runs in a fresh process.
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_2*",
            "*an asynchronous CUDA error surfaced after the test's teardown returned*",
            "*this test left a sticky CUDA error*",
            "*= CUDA context poisoned =*",
            "test_late.py::test_2 left a sticky CUDA error: *; the tests after it ran in a "
            "fresh process",
        ]
    )
    # In the first process: none for test_1 (no CUDA library yet), one after test_2.
    result.stdout.fnmatch_lines(["CHECKS 1"])


def test_sync_options_start_the_checks_at_once(reporting: pytest.Pytester) -> None:
    reporting.makepyfile(CPU_SUITE)
    result = reporting.runpytest_subprocess("-s", "--cuda-on-poison=stop")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines(["REGISTERED ['cuda.poison-checks']", "WATCHES LEFT 0"])


def test_the_watch_leaves_sys_meta_path_as_it_was(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(CPU_SUITE)
    pytester.makeconftest(
        """
        import sys

        import pytest

        BEFORE = list(sys.meta_path)

        @pytest.hookimpl(trylast=True)
        def pytest_unconfigure(config):
            print("\\nSAME META PATH", list(sys.meta_path) == BEFORE)
        """
    )
    result = pytester.runpytest_subprocess("-s")
    result.stdout.fnmatch_lines(["SAME META PATH True"])


#: What only a leak needs: its attribution, the holder walk, the report of a re-run.
LEAK_ONLY = (
    "gpumagic.stacks",
    "pytest_cuda.leaks.stacks",
    "pytest_cuda.leaks.blocks",
    "pytest_cuda.leaks.walk.holders",
    "pytest_cuda.leaks.rerun",
    "pytest_cuda.child",
)

IMPORTS_AT_TEARDOWN = f"""
import sys

LEAK_ONLY = {LEAK_ONLY!r}


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        imported = sorted(name for name in LEAK_ONLY if name in sys.modules)
        print("\\nAFTER", report.nodeid.rpartition("::")[2], imported)
"""


def test_what_only_a_leak_needs_is_imported_at_the_first_leak(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(
        """
        KEEP = []

        def test_clean(fake_cuda):
            x = fake_cuda.tensor(1 << 20)
            del x

        def test_leak(fake_cuda):
            KEEP.append(fake_cuda.tensor(8 << 20))
        """
    )
    pytester.makepyfile(imports_at_teardown=IMPORTS_AT_TEARDOWN)
    result = pytester.runpytest_subprocess(
        "-s", "-p", "imports_at_teardown", "--cuda-leak-check", "-p", "no:cacheprovider"
    )
    assert result.parseoutcomes() == {"passed": 2, "leaked": 1}
    result.stdout.fnmatch_lines(
        [
            "AFTER test_clean [[][]]",
            "AFTER test_leak [[]'gpumagic.stacks', *'pytest_cuda.leaks.walk.holders'[]]",
        ]
    )
