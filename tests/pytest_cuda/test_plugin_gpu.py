"""pytest_cuda on a real GPU: markers, fixtures and header against the device, discovery
that leaves no context behind, xdist workers sharing one device.

Every inner run is a fresh ``pytest`` process on the real machine (no fakes); each
test writes what it saw to ``$OUT/pytest_cuda_devices.txt`` when ``$OUT`` is set. The
two-GPU tests are in ``test_plugin_two_gpus.py``.
"""

from __future__ import annotations

import os

import pytest
from gpu_records import RECORDER, WORK, by_worker, devices, keep, same_uuid, seen
from reports import skip_reasons

from gpumagic import cuda
from gpumagic.units import format_bytes
from pytest_cuda.selection import visible_devices_value

pytestmark = pytest.mark.cuda


@pytest.fixture
def recorder(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(recorder=RECORDER)
    return pytester


NO_CONTEXT_CHECK = """
import os
import sys

from gpumagic import cuda


def pytest_sessionfinish(session):
    print("\\nTORCH IMPORTED:", "torch" in sys.modules)
    listed = any(os.getpid() in dict(cuda.nvml_processes(d)) for d in cuda.devices())
    print("NVML LISTS THIS PROCESS:", listed)
    import torch

    print("CUDA INITIALIZED:", torch.cuda.is_initialized())
"""


def test_header_and_discovery_leave_no_context(pytester: pytest.Pytester) -> None:
    status = cuda.status()
    pytester.makeconftest(NO_CONTEXT_CHECK)
    pytester.makepyfile(
        """
        import pytest

        def test_cpu():
            pass

        @pytest.mark.cuda(min_devices=99)
        def test_checked_but_skipped():
            pass

        @pytest.mark.skipif("not config.getoption('--positive-control', False)")
        def test_control(cuda_device):
            import torch

            torch.ones(1, device=cuda_device).sum().item()
        """
    )
    result = pytester.runpytest_subprocess("-s")
    result.assert_outcomes(passed=1, skipped=1 + len(status.devices))
    result.stdout.fnmatch_lines(
        [
            f"cuda: torch {status.torch_version}, CUDA {status.cuda_version}, "
            f"driver {status.driver_version}*",
            "cuda devices (available):",
            *(f"  cuda:{d.describe()}" for d in status.devices),
        ]
    )
    result.stdout.fnmatch_lines(
        ["*TORCH IMPORTED: False", "NVML LISTS THIS PROCESS: False", "CUDA INITIALIZED: False"]
    )
    # The positive control: a process that used the GPU is listed and initialised, so
    # the NVML check above could have seen a context (where the driver lists processes).
    pytester.makeconftest(
        NO_CONTEXT_CHECK
        + "\ndef pytest_addoption(parser):\n"
        + "    parser.addoption('--positive-control', action='store_true')\n"
    )
    control = pytester.runpytest_subprocess("-s", "--positive-control")
    control.assert_outcomes(passed=1 + len(status.devices), skipped=1)
    control.stdout.fnmatch_lines(["CUDA INITIALIZED: True"])
    keep("discovery leaves no context", result, [])
    keep("positive control", control, [])


def test_markers_against_the_real_device(pytester: pytest.Pytester) -> None:
    found = devices()
    first = found[0]
    major, minor = first.capability
    pytester.makepyfile(
        f"""
        import pytest
        import torch

        @pytest.mark.cuda
        def test_bare():
            assert torch.ones(3, device="cuda").sum().item() == 3

        @pytest.mark.cuda(min_devices={len(found) + 1})
        def test_too_many_devices():
            pass

        @pytest.mark.cuda(min_memory="1TiB")
        def test_too_much_memory():
            pass

        @pytest.mark.cuda(min_memory="256MiB")
        def test_enough_memory():
            assert torch.empty(2**27, device="cuda").numel() == 2**27

        @pytest.mark.cuda(min_memory=2**20, min_capability=({major}, {minor}))
        def test_capability_met():
            assert torch.cuda.get_device_capability(0) >= ({major}, {minor})

        @pytest.mark.cuda(min_capability="{major + 1}.0")
        def test_capability_missing():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-rs")
    result.assert_outcomes(passed=3, skipped=3)
    reasons = skip_reasons(result)
    names = ", ".join(f"{d.index} {d.name}" for d in found)
    assert reasons.pop(f"needs {len(found) + 1} CUDA devices, {len(found)} available: {names}") == 1
    assert reasons.pop(f"needs compute capability {major + 1}.0, cuda:0 {first.name} has "
                       f"{major}.{minor}") == 1  # fmt: skip
    ((memory, count),) = reasons.items()
    assert count == 1
    assert memory.startswith(f"needs 1.0 TiB free memory, cuda:0 {first.name} has ")
    assert memory.endswith(f" GiB free (of {format_bytes(first.total_memory)})")
    strict = pytester.runpytest_subprocess("--cuda-require")
    strict.assert_outcomes(passed=3, errors=3)
    keep("markers against the real device", result, [])


def test_device_fixture_on_the_real_device(recorder: pytest.Pytester) -> None:
    found = devices()
    recorder.makepyfile(WORK.format(tests=2))
    recorder.makepyfile(
        test_all="""
        import torch

        def test_all(cuda_devices):
            assert cuda_devices == [torch.device("cuda", i) for i in range(len(cuda_devices))]
            for device in cuda_devices:
                assert torch.ones(2, device=device).sum().item() == 2
        """
    )
    result = recorder.runpytest_subprocess("-v")
    result.assert_outcomes(passed=2 * len(found) + 1)
    result.stdout.fnmatch_lines([f"*test_work?cuda:{d.index}-0? PASSED*" for d in found])
    records = seen(recorder)
    for device in found:
        (mine,) = {r["uuid"] for r in records if r["device"] == f"cuda:{device.index}"}
        assert same_uuid(mine, device.uuid), (mine, device)
    keep("cuda_device on every visible device", result, records)


def test_one_gpu_shared_by_two_workers(recorder: pytest.Pytester) -> None:
    first = devices()[0]
    expected = visible_devices_value((first,), os.environ.get("CUDA_VISIBLE_DEVICES"))
    recorder.makepyfile(WORK.format(tests=4))
    result = recorder.runpytest_subprocess("-n", "2", "--dist=each", "--cuda-devices=0")
    result.assert_outcomes(passed=8)
    result.stdout.fnmatch_lines(
        [
            "cuda xdist workers (1 device(s) each):",
            f"  gw0 → cuda:0 {first.name} (CUDA_VISIBLE_DEVICES={expected})",
            f"  gw1 → cuda:0 {first.name} (CUDA_VISIBLE_DEVICES={expected})",
        ]
    )
    records = seen(recorder)
    workers = by_worker(records)
    assert set(workers) == {"gw0", "gw1"}
    for worker, (record,) in ((w, tuple(s)) for w, s in workers.items()):
        env, count, device, uuid = record
        assert (env, count, device) == (expected, 1, "cuda:0"), worker
        assert same_uuid(uuid, first.uuid), worker
    keep("-n 2 --cuda-devices=0 on one GPU", result, records)
