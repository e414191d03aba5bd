"""The GPU seam: discovery without a context, clear answers without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from fake_cuda import FakeMachine, board
from gpumagic import cuda
from gpumagic.cuda import discovery


@pytest.fixture
def two_boards(monkeypatch: pytest.MonkeyPatch) -> None:
    boards = [
        board(0, "H200 A", total=2**30, uuid="GPU-aaaa"),
        board(1, "H200 B", total=2**31, uuid="GPU-bbbb"),
    ]
    FakeMachine(boards, "580.00", torch="2.11").install(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.usefixtures("two_boards")
def test_status_lists_boards_through_nvml() -> None:
    status = cuda.status()
    assert status.available
    assert [d.name for d in status.devices] == ["H200 A", "H200 B"]
    assert status.driver_version == "580.00"
    assert status.summary() == "torch 2.11, CUDA 13.0, driver 580.00; 2 device(s)"


@pytest.mark.usefixtures("two_boards")
@pytest.mark.parametrize(
    ("env", "names"), [("1", ["H200 B"]), ("GPU-bbbb,GPU-aaaa", ["H200 B", "H200 A"])]
)
def test_status_honours_outer_visible_devices(
    monkeypatch: pytest.MonkeyPatch, env: str, names: list[str]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    assert [d.name for d in cuda.devices()] == names
    assert cuda.devices()[0].index == 0


@pytest.mark.usefixtures("two_boards")
def test_status_says_when_visible_devices_hides_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    status = cuda.status()
    assert not status.available
    assert status.reason == "CUDA_VISIBLE_DEVICES='' hides all 2 GPU(s) of this machine"
    with pytest.raises(cuda.CudaUnavailable, match="hides all 2 GPU"):
        cuda.require()


@pytest.mark.usefixtures("two_boards")
def test_status_cache_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(cuda.devices()) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert len(cuda.devices()) == 1


def test_status_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "_torch_version_file", lambda: {"torch": None, "cuda": None})
    assert cuda.status().reason == "torch is not installed"


def test_status_of_a_cpu_only_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        discovery, "_torch_version_file", lambda: {"torch": "2.13.0+cpu", "cuda": None}
    )
    status = cuda.status()
    assert not status.available
    assert status.reason == "torch 2.13.0+cpu was built without CUDA (a CPU-only build)"


class FakeLibcuda:
    """libcuda's driver API as ctypes calls it: results through ``byref`` (logic tests)."""

    def __init__(self, boards: list[tuple[str, int, tuple[int, int]]], init: int = 0) -> None:
        self.boards = boards
        self.init = init

    def cuInit(self, flags: int) -> int:
        return self.init

    def cuDeviceGetCount(self, count: Any) -> int:
        count._obj.value = len(self.boards)
        return 0

    def cuDeviceGet(self, handle: Any, ordinal: int) -> int:
        handle._obj.value = ordinal
        return 0

    def cuDeviceGetName(self, buffer: Any, size: int, handle: Any) -> int:
        buffer.value = self.boards[handle.value][0].encode()
        return 0

    def cuDeviceTotalMem_v2(self, total: Any, handle: Any) -> int:
        total._obj.value = self.boards[handle.value][1]
        return 0

    def cuDeviceGetAttribute(self, value: Any, attribute: int, handle: Any) -> int:
        value._obj.value = self.boards[handle.value][2][attribute - 75]
        return 0


@pytest.fixture
def cuda_build_without_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA build of torch whose import would fail the test, and no NVML library."""
    monkeypatch.setattr(discovery, "_nvml", lambda: None)
    monkeypatch.setattr(discovery, "_torch_version_file", lambda: {"torch": "2.11", "cuda": "13.0"})

    def no_torch() -> Any:
        raise AssertionError("discovery imported torch")

    monkeypatch.setattr(discovery, "torch_module", no_torch)


@pytest.mark.usefixtures("cuda_build_without_nvml")
def test_status_without_any_driver_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "_cuda_driver", lambda: None)
    status = cuda.status()
    assert not status.available
    assert status.reason == "no NVIDIA driver was found (neither NVML nor libcuda loads)"


@pytest.mark.usefixtures("cuda_build_without_nvml")
def test_status_from_the_driver_api_where_nvml_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = FakeLibcuda([("Orin", 2**34, (8, 7)), ("Orin B", 2**33, (8, 6))])
    monkeypatch.setattr(discovery, "_cuda_driver", lambda: lib)
    status = cuda.status()
    assert status.available
    assert [(d.index, d.name, d.total_memory, d.capability) for d in status.devices] == [
        (0, "Orin", 2**34, (8, 7)),
        (1, "Orin B", 2**33, (8, 6)),
    ]
    lib.init = 100  # CUDA_ERROR_NO_DEVICE
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cuda.status().reason == "the CUDA driver reports no GPU (CUDA_VISIBLE_DEVICES='')"
    lib.init = 35  # CUDA_ERROR_INSUFFICIENT_DRIVER
    cuda.reset_status_cache()
    assert cuda.status().reason == "the CUDA driver did not start (cuInit error 35)"


def test_torch_version_file_matches_torch_without_importing_it() -> None:
    code = textwrap.dedent(
        """
        import sys
        from gpumagic.cuda import discovery
        found = discovery._torch_version_file()
        assert "torch" not in sys.modules, "reading the version imported torch"
        import torch
        assert found == {"torch": torch.__version__, "cuda": torch.version.cuda}, found
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_is_initialized_is_false_without_importing_torch() -> None:
    code = (
        "import sys; from gpumagic import cuda; assert not cuda.is_initialized(); "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocator_stats_are_zero_before_cuda_init() -> None:
    if cuda.is_initialized():
        pytest.skip("CUDA already initialised in this process")
    assert cuda.allocator_stats(0) == cuda.AllocatorStats(0, 0, 0, 0)
    assert cuda.allocated_bytes() == {}


def test_visible_devices_restores_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with cuda.visible_devices(None):
        assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"


# --------------------------------------------------------------------------- GPU


DISCOVERY_LEAVES_NO_CONTEXT = textwrap.dedent(
    """
    import json, os, sys
    from gpumagic import cuda
    status = cuda.status()
    import torch
    assert status.available, status.reason
    before = torch.cuda.is_initialized()
    pids = {}
    for d in status.devices:
        pids.update(cuda.nvml_processes(d))
    print(json.dumps({
        "initialized": before,
        "our_pid_on_gpu": os.getpid() in pids,
        "torch_count": torch.cuda.device_count(),
        "count": len(cuda.devices()),
    }))
    """
)


@pytest.mark.cuda
def test_discovery_creates_no_context() -> None:
    import json

    out = subprocess.run(
        [sys.executable, "-c", DISCOVERY_LEAVES_NO_CONTEXT],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result = json.loads(out)
    assert result == {
        "initialized": False,
        "our_pid_on_gpu": False,
        "torch_count": result["count"],
        "count": result["count"],
    }
    assert result["count"] >= 1


@pytest.mark.cuda
def test_discovery_agrees_with_torch() -> None:
    import torch

    found = cuda.devices()
    assert len(found) == torch.cuda.device_count()
    for device in found:
        props = torch.cuda.get_device_properties(device.index)
        assert device.name == props.name
        assert device.total_memory == pytest.approx(props.total_memory, rel=0.02)
        assert device.capability == (props.major, props.minor)
        assert device.uuid.removeprefix("GPU-") == str(props.uuid)


@pytest.mark.cuda
def test_synchronize_and_events_time_real_work() -> None:
    import torch

    start = cuda.record_event()
    torch.cuda._sleep(20_000_000)
    end = cuda.record_event(0)
    spin = cuda.elapsed_ms(start, end)  # waits for the end
    assert cuda.event_completed(end)
    assert cuda.elapsed_ms(start, end, wait=False) == spin
    # The events bracket the work: a twentieth of the cycles takes less GPU time. GPU
    # time against GPU time, not against a number a slow clock could miss (issue 39).
    short_start = cuda.record_event()
    torch.cuda._sleep(1_000_000)
    short_end = cuda.record_event(0)
    assert 0 < cuda.elapsed_ms(short_start, short_end) < spin
    again = cuda.record_event()
    torch.cuda._sleep(1_000_000)
    cuda.synchronize([0])
    assert cuda.event_completed(again)
    cuda.synchronize()


@pytest.mark.cuda
def test_allocator_stats_see_a_tensor() -> None:
    import torch

    before = cuda.allocator_stats(0)
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda:0")
    after = cuda.allocator_stats(0)
    assert after.allocated - before.allocated == 64 * 2**20
    assert after.reserved >= after.allocated
    assert after.peak_allocated >= after.allocated
    # The leak check's one number, per device: the same counter.
    assert cuda.allocated_bytes()[0] == after.allocated
    del x


@pytest.mark.cuda
def test_nvml_sees_this_process_once_cuda_is_in_use() -> None:
    import torch

    torch.ones(1, device="cuda:0")
    memory = cuda.nvml_memory_info(cuda.devices()[0])
    assert memory.used + memory.free <= memory.total
    assert (dict(cuda.nvml_processes(cuda.devices()[0])).get(os.getpid()) or 0) > 0


@pytest.mark.cuda
def test_the_driver_api_lists_what_nvml_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where NVML is missing (Jetson), the driver API gives the same devices."""
    by_nvml = cuda.devices()
    monkeypatch.setattr(discovery, "_nvml", lambda: None)
    cuda.reset_status_cache()
    by_driver = cuda.devices()
    assert [(d.index, d.name, d.capability) for d in by_driver] == [
        (d.index, d.name, d.capability) for d in by_nvml
    ]
    for driver, nvml in zip(by_driver, by_nvml, strict=True):
        assert driver.total_memory == pytest.approx(nvml.total_memory, rel=0.02)
