"""pytest_cuda: a pytest plugin for CUDA test suites.

The plugin itself is :mod:`pytest_cuda.plugin`, loaded through the ``pytest11`` entry
point (disable it with ``-p no:cuda``). Importing this package imports neither torch
nor NVML.
"""

from __future__ import annotations

__all__: list[str] = []
