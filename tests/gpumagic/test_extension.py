"""``%load_ext gpumagic`` through a real shell."""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

import gpumagic

if TYPE_CHECKING:
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
