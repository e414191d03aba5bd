"""Helpers for the plugin's tests: a planted suite on a made-up machine (see fake_cuda.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gpumagic import cuda
from gpumagic.cuda import discovery

if TYPE_CHECKING:
    from collections.abc import Callable

    FakeGpus = Callable[..., None]

PLANTED_CONFTEST = """
import fake_cuda

fake_cuda.install_planted()
"""


@pytest.fixture
def fake_gpus(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> FakeGpus:
    """``fake_gpus(boards, cuda="13.0", torch=…, driver=…)`` plants the made-up machine.

    The planted suite's conftest installs it at import (in-process runs, subprocesses
    and xdist workers alike); ``CUDA_VISIBLE_DEVICES`` starts unset. The seam's real
    discovery functions are put back after the test whatever the inner run did.
    """
    monkeypatch.setattr(discovery, "_machine", discovery._machine)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("PYTEST_CUDA_DEVICES", raising=False)
    pytester.makepyfile(fake_cuda=(Path(__file__).parents[1] / "fake_cuda.py").read_text())
    pytester.makeconftest(PLANTED_CONFTEST)

    def plant(
        boards: list[dict[str, Any]],
        *,
        cuda: str | None = "13.0",
        torch: str = "2.11.0+cu130",
        driver: str = "580.95.05",
    ) -> None:
        machine = {"torch": torch, "cuda": cuda, "driver": driver, "boards": boards}
        monkeypatch.setenv("PYTEST_CUDA_FAKE_GPUS", json.dumps(machine))

    return plant


# ---------------------------------------------------------------------------
# Planted suites on the fake allocator (fake_cuda.py), for the leak checks' tests.

LEAK_CONFTEST = """
import os

import pytest

from fake_cuda import FakeAllocator

FAKE = FakeAllocator(int(os.environ.get("LEAK_FAKE_DEVICES", "1")))
FAKE.install(pytest.MonkeyPatch())  # for good: the outer test puts the seam back


def pytest_configure(config):
    # A leak's re-run is a subprocess: these suites ask for it where they test it.
    args = [str(a) for a in config.invocation_params.args]
    if not any(a.startswith("--cuda-leak-reruns") for a in args):
        config.option.cuda_leak_reruns = 0


@pytest.fixture(scope="session")
def fake_cuda():
    return FAKE
"""


@pytest.fixture
def planted(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """``planted(source)`` writes a suite that runs on the fake allocator; the seam's
    real functions are put back after the test whatever the inner run did."""
    for name in cuda.__all__:
        monkeypatch.setattr(cuda, name, getattr(cuda, name))
    monkeypatch.setattr(discovery, "_machine", discovery._machine)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the fake's install drops it
    monkeypatch.delenv("LEAK_FAKE_DEVICES", raising=False)
    pytester.makepyfile(fake_cuda=(Path(__file__).parents[1] / "fake_cuda.py").read_text())
    pytester.makeconftest(LEAK_CONFTEST)
    # pytester's in-process runs keep every earlier run's objects: a large heap for the
    # holder search, which has no time limit to meet here.
    pytester.makeini("[pytest]\ncuda_leak_holder_search = none\n")

    def plant(source: str) -> None:
        pytester.makepyfile(test_planted=source)

    return plant
