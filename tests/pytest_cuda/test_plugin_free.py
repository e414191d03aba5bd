"""Free when unused: a suite that asks for no CUDA feature never imports torch and
does no discovery; one that does imports no torch for the header and the skip checks.

Each test runs twice, in a fresh process each: on this machine as it is (no fakes; on
the GPU machine this covers NVML discovery too), and with a CUDA build of torch but no
NVIDIA driver library, the default Linux wheel on a GPU-less machine (a stand-in torch
that reports its import, and a pynvml whose library is missing).
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import TYPE_CHECKING

import pytest

from gpumagic import cuda

if TYPE_CHECKING:
    from pathlib import Path

STAND_IN_TORCH = """
import sys

sys.stderr.write("STAND-IN TORCH IMPORTED\\n")
__version__ = "2.11.0+cu130"
"""

# As torch's build writes it.
STAND_IN_TORCH_VERSION = """
from typing import Optional

__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'rocm', 'xpu']
__version__ = '2.11.0+cu130'
debug = False
cuda: Optional[str] = '13.0'
hip: Optional[str] = None
"""

# pynvml as it behaves where libnvidia-ml.so is missing: nvmlInit raises.
STAND_IN_PYNVML = """
class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


def nvmlInit():
    raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")
"""


def _libcuda_loads() -> bool:
    try:
        ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.fixture(params=["this machine", "CUDA-build torch, no driver"])
def machine(
    request: pytest.FixtureRequest, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> str:
    """The machine the planted suite runs on: this one, or a CUDA build without NVML."""
    if request.param == "this machine":
        return "real"
    site: Path = pytester.mkdir("stand_in")
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(STAND_IN_TORCH)
    (site / "torch" / "version.py").write_text(STAND_IN_TORCH_VERSION)
    (site / "torch-2.11.0+cu130.dist-info").mkdir()
    (site / "torch-2.11.0+cu130.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0+cu130\n"
    )
    (site / "pynvml.py").write_text(STAND_IN_PYNVML)
    path = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    # A driver without NVML (Jetson) still lists its GPUs through libcuda.
    return "driver API" if _libcuda_loads() else "no driver"


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


def _no_torch_imported(result: pytest.RunResult) -> None:
    assert not [line for line in result.errlines if "STAND-IN TORCH IMPORTED" in line]


def _usable(machine: str) -> bool:
    """Whether the planted run will find a GPU."""
    if machine == "real":
        return cuda.status().available
    return machine == "driver API" and bool(cuda.status().available)


def test_a_cpu_suite_imports_no_torch(pytester: pytest.Pytester, machine: str) -> None:
    pytester.makeconftest(CHECKING_CONFTEST)
    pytester.makepyfile(CPU_ONLY)
    result = pytester.runpytest_subprocess("-s")
    result.assert_outcomes(passed=21)
    result.stdout.fnmatch_lines(["*TORCH IMPORTED: False", "DISCOVERIES: 0"])
    assert not [line for line in result.outlines if line.startswith("cuda")]
    _no_torch_imported(result)


def test_options_and_xdist_import_no_torch(pytester: pytest.Pytester, machine: str) -> None:
    pytester.makeconftest(CHECKING_CONFTEST)
    pytester.makepyfile(CPU_ONLY)
    result = pytester.runpytest_subprocess("-s", "-n", "2", "--cuda-devices=all", "--cuda-require")
    if _usable(machine):
        result.assert_outcomes(passed=21)
    else:  # no GPU here: --cuda-require ends the run at once, still without torch
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines(["*--cuda-require: no usable CUDA device here: *"])
        if machine == "no driver":
            result.stderr.fnmatch_lines(["*no NVIDIA driver was found*"])
        _no_torch_imported(result)
        result = pytester.runpytest_subprocess("-s", "-n", "2", "--cuda-devices=all")
        result.assert_outcomes(passed=21)
    result.stdout.fnmatch_lines(["*TORCH IMPORTED AT THE END: False"])
    _no_torch_imported(result)


def test_skip_checks_import_no_torch(pytester: pytest.Pytester, machine: str) -> None:
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
    if machine == "no driver":
        result.stdout.fnmatch_lines(["SKIPPED*no NVIDIA driver was found*"])
    _no_torch_imported(result)
