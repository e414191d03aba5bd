"""``%load_ext gpumagic`` through a real shell."""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

import gpumagic
from ipython_shell import fresh_shell

if TYPE_CHECKING:
    import pytest
    from IPython.core.interactiveshell import InteractiveShell


def test_extension_loads_and_registers_its_magics(shell: InteractiveShell) -> None:
    assert "gpumagic" in shell.extension_manager.loaded
    for module in gpumagic._MAGIC_MODULES:
        assert module in sys.modules


def test_extension_loading_creates_no_cuda_context() -> None:
    """In a fresh process (this one may have used CUDA already), on a GPU machine too."""
    code = (
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "ip = InteractiveShell.instance()\n"
        "ip.run_line_magic('load_ext', 'gpumagic')\n"
        "import sys\n"
        "torch = sys.modules.get('torch')\n"
        "assert torch is None or not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


OURS = {"line": ("cudatime", "gpumem", "lprun"), "cell": ("cudatime", "gpumem", "lprun")}


def test_unload_removes_every_magic_and_loading_again_restores_them(
    shell: InteractiveShell,
) -> None:
    table = shell.magics_manager.magics
    for kind, names in OURS.items():
        assert all(name in table[kind] for name in names)
    shell.run_line_magic("unload_ext", "gpumagic")
    for kind, names in OURS.items():
        assert not any(name in table[kind] for name in names), (kind, names)
    assert "CudaTimeMagics" not in shell.magics_manager.registry
    assert not shell.run_cell("%cudatime 1 + 1").success
    shell.run_line_magic("load_ext", "gpumagic")
    assert shell.run_cell("%cudatime --budget 0.05 -q 1 + 1").success


def test_taking_lprun_from_line_profiler_says_so_and_unload_gives_it_back(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with fresh_shell() as shell:
        shell.run_line_magic("load_ext", "line_profiler")
        theirs = shell.magics_manager.magics["line"]["lprun"]
        shell.run_line_magic("load_ext", "gpumagic")
        out = capsys.readouterr().out
        assert out.count("\n") == 1
        assert (
            "gpumagic: %lprun replaces line_profiler's (%unload_ext gpumagic puts it back)" in out
        )
        assert shell.magics_manager.magics["line"]["lprun"] is not theirs
        shell.run_line_magic("unload_ext", "gpumagic")
        assert shell.magics_manager.magics["line"]["lprun"] == theirs
        assert "cudatime" not in shell.magics_manager.magics["line"]
