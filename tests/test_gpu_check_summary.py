"""The GPU check's closing summary (``scripts/gpu_check_summary.py``), from JUnit files
written the way pytest writes them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check_summary.py"


def run_inner(pytester: pytest.Pytester, name: str, source: str, *args: str) -> None:
    """Run a small suite in-process, leaving its JUnit file as ``pytest-<name>.xml``."""
    pytester.makepyfile(**{f"tests/gpumagic/test_{name}": source})
    pytester.runpytest_inprocess(
        f"tests/gpumagic/test_{name}.py", f"--junitxml=logs/pytest-{name}.xml", *args
    )


def test_counts_per_area_failures_and_slowest(pytester: pytest.Pytester) -> None:
    run_inner(
        pytester,
        "parallel",
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad():\n"
        "    assert 1 + 1 == 3, 'the arithmetic is off'\n"
        "@pytest.mark.skip(reason='no')\n"
        "def test_skipped(): pass\n",
    )
    run_inner(pytester, "timing", "def test_timed(): pass\n")
    logs = pytester.path / "logs"
    (logs / "environment.txt").write_text("== now\nGPU 0: Fake GPU\nFake GPU, 580, 80 GiB\n")
    (logs / "notebook.rc").write_text("0\n")
    (logs / "benchmarks.rc").write_text("benchmarks/bench_a.py 0\nbenchmarks/bench_b.py 1\n")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(logs), "--seconds", "42", "--exit", "1"],
        capture_output=True,
        text=True,
        check=True,
    )
    text = done.stdout
    assert "GPU 0: Fake GPU" in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line[:1].isalpha()}
    assert rows["gpumagic"] == ["2", "1", "0", "1"]  # passed, failed, error, skipped
    assert "FAILED tests/gpumagic/test_parallel.py::test_bad" in text
    # The failure's own report follows its line: the summary is all that may come back.
    after = text.split("FAILED tests/gpumagic/test_parallel.py::test_bad", 1)[1]
    assert "AssertionError: the arithmetic is off" in after.split("slowest 10:")[0]
    assert "phases: parallel 3 tests" in text
    assert "timing 1 tests" in text
    assert "slowest 10:" in text
    assert "notebook: ok" in text
    assert "benchmarks: 1 ok, FAILED: benchmarks/bench_b.py (exit 1)" in text
    assert text.rstrip().endswith("gpu-check FAILED in 42 s (exit 1; logs in " + str(logs) + ")")
