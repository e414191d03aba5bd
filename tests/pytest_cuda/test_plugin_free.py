"""Free when unused: a suite that asks for no CUDA feature never imports torch and
does no discovery; one that does imports no torch for the header and the skip checks.

Run on the real machine (no fakes), in a fresh process each: on the GPU machine this
covers NVML discovery too.
"""

from __future__ import annotations

import pytest

from gpumagic import cuda

CHECKING_CONFTEST = """
import sys

from gpumagic.cuda import discovery

discoveries = []
real = discovery._status_now
discovery._status_now = lambda: discoveries.append(1) or real()


def pytest_sessionfinish(session):
    print("\\nTORCH IMPORTED:", "torch" in sys.modules)
    print("DISCOVERIES:", len(discoveries))


def pytest_unconfigure(config):
    print("\\nTORCH IMPORTED AT THE END:", "torch" in sys.modules)
"""

CPU_ONLY = """
import sys

import pytest

@pytest.mark.parametrize("i", range(20))
def test_cpu(i):
    assert "torch" not in sys.modules

def test_fixture_free(tmp_path):
    assert "torch" not in sys.modules
"""


def test_a_cpu_suite_imports_no_torch(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CHECKING_CONFTEST)
    pytester.makepyfile(CPU_ONLY)
    result = pytester.runpytest_subprocess("-s")
    result.assert_outcomes(passed=21)
    result.stdout.fnmatch_lines(["*TORCH IMPORTED: False", "DISCOVERIES: 0"])
    assert not [line for line in result.outlines if line.startswith("cuda")]


def test_options_and_xdist_import_no_torch(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CHECKING_CONFTEST)
    pytester.makepyfile(CPU_ONLY)
    result = pytester.runpytest_subprocess("-s", "-n", "2", "--cuda-devices=all", "--cuda-require")
    if cuda.status().available:
        result.assert_outcomes(passed=21)
    else:  # no GPU here: --cuda-require ends the run at once, still without torch
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines(["*--cuda-require: no usable CUDA device here: *"])
        result = pytester.runpytest_subprocess("-s", "-n", "2", "--cuda-devices=all")
        result.assert_outcomes(passed=21)
    result.stdout.fnmatch_lines(["*TORCH IMPORTED AT THE END: False"])


def test_skip_checks_import_no_torch(pytester: pytest.Pytester) -> None:
    """Marked tests are checked by discovery alone (they skip here without a GPU)."""
    pytester.makeconftest(CHECKING_CONFTEST)
    pytester.makepyfile(
        """
        import sys

        import pytest

        @pytest.mark.cuda(min_devices=64, min_memory="1TiB", min_capability=(99, 0))
        def test_impossible():
            pass

        def test_after():
            assert "torch" not in sys.modules
        """
    )
    result = pytester.runpytest_subprocess("-s", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*TORCH IMPORTED: False"])
