"""Sticky CUDA errors: the test that left one, and the error as it surfaced.

After a device-side assert (or an illegal address, a launch failure...) every later
CUDA call in the process fails with the same error: the context is "poisoned", and a
plain pytest run blames every later CUDA test. This module holds the records of the
cure (telling a CUDA error from another failure is :mod:`gpumagic.cuda_errors`'s; the
fresh pytest process that runs the remaining tests is :mod:`pytest_cuda.child`'s).

No pytest, no torch: the glue (hooks, report replay) is in :mod:`pytest_cuda.sync.plugin`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpumagic.cuda import AsyncCudaError
    from gpumagic.cuda_errors import CudaErrorInfo

__all__ = ["Culprit", "Surfaced"]


@dataclass(frozen=True)
class Culprit:
    """The test that left a sticky CUDA error, and the phase after which it was found."""

    nodeid: str
    when: str
    error: CudaErrorInfo


@dataclass(frozen=True)
class Surfaced:
    """An error the post-phase check found; ``failed_phase``: it alone failed the phase."""

    error: AsyncCudaError
    failed_phase: bool
