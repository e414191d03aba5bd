"""``%load_ext gpumagic`` through a real shell."""

from __future__ import annotations

from typing import TYPE_CHECKING

import gpumagic

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell


def test_extension_loads_and_registers_its_magics(shell: InteractiveShell) -> None:
    assert "gpumagic" in shell.extension_manager.loaded
    for module in gpumagic._MAGIC_MODULES:
        assert module in __import__("sys").modules


def test_extension_loading_creates_no_cuda_context(shell: InteractiveShell) -> None:
    from gpumagic import cuda

    assert not cuda.is_initialized()
