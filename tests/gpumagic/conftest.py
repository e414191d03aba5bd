"""A fresh, real IPython shell per test, with gpumagic loaded; the same shell with the
fake GPU of :mod:`fake_cuda` (``gpu``), or on a real GPU with torch in use
(``gpu_shell``); the timing engine's stand-in seam of :mod:`fake_runtime` (``seam``);
on a real GPU, torch with CUDA initialised (``torch``) and the spin kernel's rate
(``cycles_per_ms``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from fake_runtime import FakeClock, FakeSeam

from fake_cuda import FakeAllocator, MiB
from ipython_shell import fresh_shell

if TYPE_CHECKING:
    from collections.abc import Iterator

    from IPython.core.interactiveshell import InteractiveShell


@pytest.fixture
def shell() -> Iterator[InteractiveShell]:
    """A new ``InteractiveShell`` (not the singleton of an earlier test) after
    ``%load_ext gpumagic``; cleared afterwards."""
    with fresh_shell() as ip:
        ip.run_line_magic("load_ext", "gpumagic")
        yield ip


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch, shell: InteractiveShell) -> FakeAllocator:
    """The fake GPU of :mod:`fake_cuda` behind gpumagic's CUDA seam, in ``shell`` as
    ``gpu`` (with ``MiB``)."""
    fake = FakeAllocator(2, initialized=True).install(monkeypatch)
    shell.user_ns["gpu"] = fake
    shell.user_ns["MiB"] = MiB
    return fake


@pytest.fixture
def gpu_shell(shell: InteractiveShell) -> Iterator[InteractiveShell]:
    """The shell with torch imported and CUDA in use (the context exists before the
    measured cells, as in a notebook that has been running for a while). Real GPU only."""
    result = shell.run_cell("import torch\nwarm = torch.empty(1, device='cuda')")
    assert result.success, result.error_in_exec
    yield shell
    shell.user_ns.clear()


@pytest.fixture
def seam(monkeypatch: pytest.MonkeyPatch) -> FakeSeam:
    """:class:`fake_runtime.FakeSeam` in the seam, for the timing engine."""
    return FakeSeam().install(monkeypatch)


@pytest.fixture
def fake_clock(seam: FakeSeam, monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The timing engine's host clock and the stand-in seam's events, waits and bodies on
    one :class:`FakeClock`: exact times, which a loaded host cannot stretch (a side-stream
    run of 5 ms once read 10.07 ms on the host clock under load)."""
    from gpumagic import timing

    clock = FakeClock()
    monkeypatch.setattr(timing, "time", clock)
    seam.on_clock(clock)
    return clock


@pytest.fixture(scope="module")
def torch() -> Any:
    """torch, with CUDA initialised. Real GPU only."""
    import torch

    torch.cuda.init()
    return torch


@pytest.fixture(scope="module")
def cycles_per_ms(torch: Any) -> float:
    """Spin-kernel cycles per millisecond at the clock the GPU runs now."""
    torch.cuda._sleep(100_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rates = []
    for _ in range(3):
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        rates.append(20_000_000 / start.elapsed_time(end))
    return sorted(rates)[1]
