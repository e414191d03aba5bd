"""Importing either package is free: no torch, IPython or NVML."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "IPython", "pynvml", "line_profiler", "numpy")


def test_import_pulls_in_nothing_heavy() -> None:
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import gpumagic, pytest_cuda.plugin"],
        capture_output=True,
        text=True,
        check=True,
    )
    imported = {
        line.rsplit("|", 1)[-1].strip().split(".")[0] for line in result.stderr.splitlines()
    }
    assert "gpumagic" in imported
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
