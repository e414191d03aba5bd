"""A real device-side assert in a planted suite of ten tests (GPU only).

Test 3 indexes a CUDA tensor out of range: the kernel's assert fires after the test
body has returned, and leaves the process's CUDA context unusable. Every run happens
in a fresh pytest process (``runpytest_subprocess``): the assert would poison this one.
With ``OUT`` set (the GPU check), each run's output is kept in ``planted/``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda

TIMEOUT = 240

FAULTY = "y = x[idx]  # index 25 of a 10-element tensor: a device-side assert"


def _planted_source() -> str:
    tests = []
    for n in range(1, 11):
        if n == 3:
            body = (
                '    x = torch.rand(10, device="cuda")\n'
                '    idx = torch.tensor([25], device="cuda")\n'
                f"    {FAULTY}\n"
                "    assert y.shape == (1,)\n"
            )
        else:
            body = (
                f'    assert (torch.arange({n}, device="cuda") * 2).sum().item() == {n * (n - 1)}\n'
            )
        tests.append(f"def test_{n:02d}():\n{body}")
    return "import torch\n\n\n" + "\n\n".join(tests)


PLANTED = _planted_source()
FAULTY_LINE = PLANTED.splitlines().index(f"    {FAULTY}") + 1


def run_planted(pytester: pytest.Pytester, name: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_planted=PLANTED)
    result = pytester.runpytest_subprocess("-rfE", *args, timeout=TIMEOUT)
    out = os.environ.get("OUT")
    if out:
        text = f"$ pytest -rfE {' '.join(args)}  (exit status {result.ret})\n"
        Path(out, "planted").mkdir(exist_ok=True)
        path = Path(out, "planted", f"poison-{name}.txt")
        path.write_text(text + result.stdout.str() + result.stderr.str())
    return result


def failed_ids(result: pytest.RunResult) -> set[str]:
    return set(re.findall(r"^FAILED test_planted\.py::(test_\d+)", result.stdout.str(), re.M))


def test_without_the_plugin_the_assert_fails_later_tests(pytester: pytest.Pytester) -> None:
    result = run_planted(pytester, "no-plugin", "-p", "no:pytest_cuda.sync_plugin")
    failed = failed_ids(result)
    # The cascade this plugin exists for: the culprit passes, innocent tests fail.
    assert "test_03" not in failed
    assert "test_04" in failed
    assert len(failed) >= 6
    assert "device-side assert triggered" in result.stdout.str()


def test_with_the_plugin_only_the_culprit_fails(pytester: pytest.Pytester) -> None:
    result = run_planted(pytester, "default")
    result.assert_outcomes(passed=9, failed=1)
    assert failed_ids(result) == {"test_03"}
    result.stdout.fnmatch_lines(
        [
            "pytest_cuda: an asynchronous CUDA error surfaced after the test's body returned: "
            "device-side assert triggered (cudaErrorAssert)",
            "*this test left a sticky CUDA error (device-side assert triggered (cudaErrorAssert))*"
            "remaining tests continue in a fresh process*",
            "reproduce: CUDA_VISIBLE_DEVICES=* CUDA_LAUNCH_BLOCKING=1 pytest "
            "'test_planted.py::test_03'",
            # printed by the kernel when the check synchronized: captured for test_03
            "*- Captured stderr call -*",
            '*Assertion `-sizes[[]i[]] <= index && index < sizes[[]i[]] && "index out of bounds"`*',
            "*= CUDA context poisoned =*",
            "test_planted.py::test_03 left a sticky CUDA error: device-side assert triggered "
            "(cudaErrorAssert); the tests after it ran in a fresh process",
        ]
    )


def test_with_xdist_the_worker_is_replaced_and_the_culprit_reported_once(
    pytester: pytest.Pytester,
) -> None:
    result = run_planted(pytester, "xdist", "-n", "2")
    result.assert_outcomes(passed=9, failed=1)
    assert failed_ids(result) == {"test_03"}
    result.stdout.fnmatch_lines(
        [
            "replacing crashed worker gw*",
            "*= CUDA context poisoned =*",
            "test_planted.py::test_03 left a sticky CUDA error: device-side assert triggered "
            "(cudaErrorAssert); xdist worker gw* was replaced; the test is reported once, above",
        ]
    )
    assert "crashed while running" not in result.stdout.str()


def test_rerun_blocking_adds_the_true_failing_line(pytester: pytest.Pytester) -> None:
    result = run_planted(pytester, "rerun-blocking", "--cuda-rerun-blocking")
    result.assert_outcomes(passed=9, failed=1)
    result.stdout.fnmatch_lines(
        [
            "re-run alone in a fresh process with CUDA_LAUNCH_BLOCKING=1: failed",
            f"  at test_planted.py:{FAULTY_LINE} in test_03",
            f"      {FAULTY}",
            "  *CUDA error: device-side assert triggered",
            "reproduce: CUDA_VISIBLE_DEVICES=* CUDA_LAUNCH_BLOCKING=1 pytest "
            "'test_planted.py::test_03'",
        ]
    )


def _raised_at_the_faulty_line(result: pytest.RunResult) -> None:
    result.stdout.fnmatch_lines(
        [
            "*_ test_03 _*",
            ">       y = x[[]idx[]]  # index 25 of a 10-element tensor: a device-side assert",
            "E       *CUDA error: device-side assert triggered",
        ]
    )


def test_per_op_raises_at_the_faulty_line(pytester: pytest.Pytester) -> None:
    result = run_planted(pytester, "per-op", "--cuda-sync=per-op")
    result.assert_outcomes(passed=9, failed=1)
    _raised_at_the_faulty_line(result)
    result.stdout.fnmatch_lines(
        [
            "E  *pytest_cuda: raised by the synchronize right after aten.index.Tensor "
            "(per-op sync): this op queued the kernel that failed",
            # the summary line is cut to the terminal's width
            "FAILED test_planted.py::test_03 - torch.AcceleratorError: CUDA error: device-*",
        ]
    )


def test_the_cuda_sync_marker_raises_at_the_faulty_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_marked=PLANTED.replace(
            "def test_03", "import pytest\n\n@pytest.mark.cuda_sync\ndef test_03"
        )
    )
    result = pytester.runpytest_subprocess("test_marked.py", timeout=TIMEOUT)
    result.assert_outcomes(passed=9, failed=1)
    result.stdout.fnmatch_lines([">       y = x[[]idx[]]*", "E       *aten.index.Tensor*"])


def test_launch_blocking_raises_at_the_faulty_line(pytester: pytest.Pytester) -> None:
    result = run_planted(pytester, "launch-blocking", "--cuda-sync=launch-blocking")
    result.assert_outcomes(passed=9, failed=1)
    _raised_at_the_faulty_line(result)
