"""pytest_cuda on real GPUs: markers, fixtures and header against the device, discovery
that leaves no context behind, and one device per xdist worker.

Every inner run is a fresh ``pytest`` process on the real machine (no fakes). Tests
marked ``cuda(min_devices=2)`` need two GPUs (the H200 pair); each writes what the
workers saw to ``$OUT/pytest_cuda_devices.txt`` when ``$OUT`` is set, for the record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from reports import skip_reasons

from gpumagic import cuda
from gpumagic.devices import format_bytes
from pytest_cuda.selection import visible_devices_value

if TYPE_CHECKING:
    from gpumagic.devices import DeviceInfo

pytestmark = pytest.mark.cuda

# Each test that touches CUDA appends what its process saw to seen.jsonl: the xdist
# worker, its CUDA_VISIBLE_DEVICES, torch's device count and the UUID of the device.
RECORDER = """
import json
import os
from pathlib import Path

import torch

LOG = Path(__file__).with_name("seen.jsonl")


def record(request, device):
    workerinput = getattr(request.config, "workerinput", None)
    seen = {
        "worker": workerinput["workerid"] if workerinput else "main",
        "test": request.node.name,
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "device_count": torch.cuda.device_count(),
        "device": str(device),
        "uuid": str(torch.cuda.get_device_properties(device).uuid),
        "name": torch.cuda.get_device_name(device),
    }
    with LOG.open("a") as log:
        log.write(json.dumps(seen) + "\\n")
"""

WORK = """
import pytest
import torch
from recorder import record


@pytest.mark.parametrize("i", range({tests}))
def test_work(request, cuda_device, i):
    x = torch.eye(8, device=cuda_device) * i
    assert (x @ x).sum().item() == 8 * i * i
    record(request, cuda_device)
"""


def devices() -> tuple[DeviceInfo, ...]:
    return cuda.status().devices


def same_uuid(torch_uuid: str, nvml_uuid: str) -> bool:
    """torch prints ``58e4…``, NVML ``GPU-58e4…``."""
    return torch_uuid.lower().removeprefix("gpu-") == nvml_uuid.lower().removeprefix("gpu-")


def seen(pytester: pytest.Pytester) -> list[dict[str, Any]]:
    log = pytester.path / "seen.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def by_worker(records: list[dict[str, Any]]) -> dict[str, set[tuple[Any, ...]]]:
    found: dict[str, set[tuple[Any, ...]]] = {}
    for r in records:
        key = (r["CUDA_VISIBLE_DEVICES"], r["device_count"], r["device"], r["uuid"])
        found.setdefault(r["worker"], set()).add(key)
    return found


def keep(title: str, result: pytest.RunResult, records: list[dict[str, Any]]) -> None:
    """Write the inner run's header and the records to $OUT for the closing note."""
    out = os.environ.get("OUT")
    if not out:
        return
    starts = ("cuda", "  cuda:", "  gw", "  no worker", "created")
    header = [line for line in result.outlines if line.startswith(starts)]
    summary = [line for line in result.outlines if " in " in line and "===" in line]
    lines = [f"## {title}", *header, *summary]
    lines += [json.dumps(r) for r in sorted(by_worker(records).items(), key=str)]
    with (Path(out) / "pytest_cuda_devices.txt").open("a") as log:
        log.write("\n".join(lines) + "\n\n")


@pytest.fixture
def recorder(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(recorder=RECORDER)
    return pytester


# ---------------------------------------------------------------------------
# One GPU (or more).


NO_CONTEXT_CHECK = """
import os
import sys

from gpumagic import cuda


def pytest_sessionfinish(session):
    print("\\nTORCH IMPORTED:", "torch" in sys.modules)
    listed = any(os.getpid() in cuda.nvml_process_memory(d) for d in cuda.devices())
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


# ---------------------------------------------------------------------------
# Two GPUs: the H200 pair.


@pytest.mark.cuda(min_devices=2)
def test_each_worker_runs_on_its_own_device(recorder: pytest.Pytester) -> None:
    """``pytest -n 2 --cuda-devices=0,1``: the workers' device UUIDs differ."""
    first, second = devices()[:2]
    recorder.makepyfile(WORK.format(tests=40))
    result = recorder.runpytest_subprocess("-n", "2", "--cuda-devices=0,1")
    result.assert_outcomes(passed=40)
    records = seen(recorder)
    workers = by_worker(records)
    keep("pytest -n 2 --cuda-devices=0,1", result, records)
    assert set(workers) == {"gw0", "gw1"}, workers
    ((env0, count0, dev0, uuid0),) = workers["gw0"]
    ((env1, count1, dev1, uuid1),) = workers["gw1"]
    assert uuid0 != uuid1
    assert (count0, dev0, count1, dev1) == (1, "cuda:0", 1, "cuda:0")
    assert same_uuid(uuid0, first.uuid), (uuid0, first)
    assert same_uuid(uuid1, second.uuid), (uuid1, second)
    outer = os.environ.get("CUDA_VISIBLE_DEVICES")
    assert env0 == visible_devices_value((first,), outer)
    assert env1 == visible_devices_value((second,), outer)


@pytest.mark.cuda(min_devices=2)
def test_without_xdist_a_device_test_runs_once_per_device(recorder: pytest.Pytester) -> None:
    first, second = devices()[:2]
    recorder.makepyfile(WORK.format(tests=1))
    result = recorder.runpytest_subprocess("--cuda-devices=0,1", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_work?cuda:0-0? PASSED*", "*test_work?cuda:1-0? PASSED*"])
    records = seen(recorder)
    keep("pytest --cuda-devices=0,1 (no xdist)", result, records)
    uuids = {r["device"]: r["uuid"] for r in records}
    assert uuids["cuda:0"] != uuids["cuda:1"]
    assert same_uuid(uuids["cuda:0"], first.uuid)
    assert same_uuid(uuids["cuda:1"], second.uuid)


@pytest.mark.cuda(min_devices=2)
def test_outer_uuids_reorder_the_devices(
    recorder: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outer CUDA_VISIBLE_DEVICES is respected: cuda:0 is the board it names first."""
    first, second = devices()[:2]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{second.uuid},{first.uuid}")
    recorder.makepyfile(WORK.format(tests=20))
    result = recorder.runpytest_subprocess("-n", "2", "--cuda-devices=0,1")
    result.assert_outcomes(passed=20)
    records = seen(recorder)
    keep(f"CUDA_VISIBLE_DEVICES={second.uuid},{first.uuid} pytest -n 2", result, records)
    workers = by_worker(records)
    ((env0, _, _, uuid0),) = workers["gw0"]
    ((env1, _, _, uuid1),) = workers["gw1"]
    assert (env0, env1) == (second.uuid, first.uuid)
    assert same_uuid(uuid0, second.uuid)
    assert same_uuid(uuid1, first.uuid)


@pytest.mark.cuda(min_devices=2)
def test_a_worker_with_two_devices(recorder: pytest.Pytester) -> None:
    recorder.makepyfile(
        """
        import pytest
        import torch

        @pytest.mark.cuda(min_devices=2)
        def test_pair(cuda_devices):
            assert torch.cuda.device_count() == 2
            a, b = (torch.ones(4, device=d) for d in cuda_devices)
            assert (a + b.to(a.device)).sum().item() == 8
        """
    )
    result = recorder.runpytest_subprocess(
        "-n", "1", "--cuda-devices=0,1", "--cuda-devices-per-worker=2", "--cuda-require"
    )
    result.assert_outcomes(passed=1)
    keep("-n 1 --cuda-devices-per-worker=2", result, [])
