"""``%cudatime`` called as a test calls it on a real GPU: quiet, its result returned."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

    from gpumagic.timing_result import CudaTimeResult


def cudatime(shell: InteractiveShell, line: str, cell: str | None = None) -> CudaTimeResult:
    """``%cudatime -q -o LINE`` (``%%cudatime`` with ``cell``): the result object."""
    if cell is None:
        result = shell.run_line_magic("cudatime", f"-q -o {line}")
    else:
        result = shell.run_cell_magic("cudatime", f"-q -o {line}", cell)
    assert result is not None
    return result  # type: ignore[no-any-return]
