"""pytest_cuda's hooks: the ``cuda`` marker and strict GPU mode.

Loaded through the ``pytest11`` entry point as ``cuda`` (``-p no:cuda`` turns it off).
Importing it imports neither torch nor NVML; device discovery runs only for tests that
carry the ``cuda`` marker, and creates no CUDA context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from gpumagic import cuda

if TYPE_CHECKING:
    from _pytest.config.argparsing import Parser

# Opt-in modes of other pytest_cuda modules (leak checks, sync/debug modes) register
# here: pytest loads them with this module, so ``-p no:cuda`` turns them all off.
pytest_plugins: tuple[str, ...] = ()

CUDA_MARKER_DOC = (
    "cuda: the test needs a usable CUDA device; it is skipped with the reason when "
    "there is none (or fails under --cuda-require)."
)


def pytest_addoption(parser: Parser) -> None:
    group = parser.getgroup("cuda", "CUDA devices (pytest_cuda)")
    group.addoption(
        "--cuda-require",
        action="store_true",
        default=False,
        help="strict mode for GPU CI: a test that would be skipped for lack of a GPU "
        "fails instead, with the same reason.",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", CUDA_MARKER_DOC)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is None:
        return
    current = cuda.status()
    if current.available:
        return
    reason = f"CUDA unavailable: {current.reason}"
    if item.config.getoption("cuda_require"):
        pytest.fail(f"{reason} (--cuda-require turns this skip into a failure)", pytrace=False)
    pytest.skip(reason)
