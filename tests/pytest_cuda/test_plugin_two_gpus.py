"""pytest_cuda on two GPUs (the H200 pair): one device per xdist worker, proven by the
device UUID each worker saw, and a device test run once per device without xdist.

Every test needs two GPUs (``cuda(min_devices=2)``): on a one-GPU machine they skip,
and fail under ``--cuda-require``, so leave this file out of one-GPU checks. Each test
writes the inner run's header and what every worker saw to
``$OUT/pytest_cuda_devices.txt`` when ``$OUT`` is set.
"""

from __future__ import annotations

import os

import pytest
from gpu_records import RECORDER, WORK, by_worker, devices, keep, same_uuid, seen

from pytest_cuda.selection import visible_devices_value


@pytest.fixture
def recorder(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(recorder=RECORDER)
    return pytester


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
