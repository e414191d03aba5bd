"""The ``cuda`` marker through a real pytest run."""

from __future__ import annotations

import pytest

from gpumagic import cuda

NEEDS_GPU = """
import pytest

@pytest.mark.cuda
def test_gpu():
    pass

def test_cpu():
    pass
"""


def test_marker_is_documented(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.cuda*usable CUDA device*"])


def test_marker_skips_with_the_reason_without_a_gpu(pytester: pytest.Pytester) -> None:
    if cuda.status().available:
        pytest.skip("this machine has a GPU")
    pytester.makepyfile(NEEDS_GPU)
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines([f"SKIPPED*CUDA unavailable: {cuda.status().reason}*"])


def test_require_turns_the_skip_into_a_failure(pytester: pytest.Pytester) -> None:
    if cuda.status().available:
        pytest.skip("this machine has a GPU")
    pytester.makepyfile(NEEDS_GPU)
    result = pytester.runpytest("--cuda-require")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        ["*CUDA unavailable*--cuda-require turns this skip into a failure*"]
    )


@pytest.mark.cuda
def test_marker_runs_on_a_gpu(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(NEEDS_GPU)
    pytester.runpytest_subprocess("--cuda-require").assert_outcomes(passed=2)
