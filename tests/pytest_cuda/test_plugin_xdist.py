"""Pinning pytest-xdist workers to devices: what each worker really received.

Every run here is a real ``pytest -n N`` on a made-up machine, its controller in this
process (pytester's in-process run: a pytest start-up fewer each) and its workers real
processes; the planted conftest makes each worker write down the environment it started
with and the devices the plugin hands its tests. It stands in for torch too (see
``fake_cuda.install_torch_stand_in``): these runs are about which device each worker gets.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
from reports import skip_reasons

from fake_cuda import CPU_BUILD, board, h200s

if TYPE_CHECKING:
    from conftest import FakeGpus

RECORDING_CONFTEST = """
import json
import os
from pathlib import Path

import fake_cuda
from pytest_cuda.plugin import selected_devices

fake_cuda.install_planted()
fake_cuda.install_torch_stand_in()


def pytest_sessionstart(session):
    workerinput = getattr(session.config, "workerinput", None)
    if workerinput is None:
        return
    seen = {
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "devices": [[d.index, d.uuid] for d in selected_devices(session.config)],
    }
    name = f"seen-{workerinput['workerid']}.json"
    Path(__file__).with_name(name).write_text(json.dumps(seen))
"""

DEVICE_TESTS = """
import pytest

def test_device(cuda_device):
    assert str(cuda_device) == "cuda:0"

@pytest.mark.cuda
def test_marked():
    pass

def test_cpu():
    pass
"""


@pytest.fixture
def recording(pytester: pytest.Pytester, fake_gpus: FakeGpus) -> FakeGpus:
    pytester.makeconftest(RECORDING_CONFTEST)
    return fake_gpus


def seen(pytester: pytest.Pytester) -> dict[str, Any]:
    """``{worker: {"CUDA_VISIBLE_DEVICES": …, "devices": [[index, uuid], …]}}``."""
    return {
        path.stem.removeprefix("seen-"): json.loads(path.read_text())
        for path in sorted(pytester.path.glob("seen-gw*.json"))
    }


def visible(pytester: pytest.Pytester) -> dict[str, str | None]:
    return {worker: s["CUDA_VISIBLE_DEVICES"] for worker, s in seen(pytester).items()}


def test_each_worker_gets_its_own_device(pytester: pytest.Pytester, recording: FakeGpus) -> None:
    recording(h200s(2))
    pytester.makepyfile(DEVICE_TESTS)
    result = pytester.runpytest("-n", "2", "--cuda-devices=0,1", "-v")
    result.assert_outcomes(passed=3)
    assert seen(pytester) == {
        "gw0": {"CUDA_VISIBLE_DEVICES": "0", "devices": [[0, "GPU-fake-0"]]},
        "gw1": {"CUDA_VISIBLE_DEVICES": "1", "devices": [[0, "GPU-fake-1"]]},
    }
    # Not parametrized under xdist: every worker collects the same tests.
    result.stdout.fnmatch_lines(["*PASSED test_each_worker_gets_its_own_device.py::test_device*"])
    result.stdout.no_fnmatch_line("*test_device?cuda:*")


def test_outer_indices_are_mapped_through(
    pytester: pytest.Pytester, recording: FakeGpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    # triton-lang/triton#11831: cuda:0 under CUDA_VISIBLE_DEVICES=2,3 is GPU 2, never GPU 0.
    recording(h200s(4))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    pytester.makepyfile(DEVICE_TESTS)
    pytester.runpytest("-n", "2", "--cuda-devices=0,1").assert_outcomes(passed=3)
    assert seen(pytester) == {
        "gw0": {"CUDA_VISIBLE_DEVICES": "2", "devices": [[0, "GPU-fake-2"]]},
        "gw1": {"CUDA_VISIBLE_DEVICES": "3", "devices": [[0, "GPU-fake-3"]]},
    }


def test_outer_uuids_are_kept(
    pytester: pytest.Pytester, recording: FakeGpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    recording(h200s(4))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-fake-3,GPU-fake-1")
    pytester.makepyfile(DEVICE_TESTS)
    pytester.runpytest("-n", "2", "--cuda-devices=1,0").assert_outcomes(passed=3)
    assert visible(pytester) == {"gw0": "GPU-fake-1", "gw1": "GPU-fake-3"}


def test_outer_mig_instances_are_kept(
    pytester: pytest.Pytester, recording: FakeGpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    slices = [
        {"name": "NVIDIA H200 MIG 3g.71gb", "uuid": f"MIG-fake-{i}", "total": 76 * 2**30,
         "capability": [9, 0]}
        for i in range(2)
    ]  # fmt: skip
    recording([board(0, migs=slices)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-fake-0,MIG-fake-1")
    pytester.makepyfile(DEVICE_TESTS)
    result = pytester.runpytest("-n", "2", "--cuda-devices=all")
    result.assert_outcomes(passed=3)
    assert visible(pytester) == {"gw0": "MIG-fake-0", "gw1": "MIG-fake-1"}
    result.stdout.fnmatch_lines(
        ["  gw0 → cuda:0 NVIDIA H200 MIG 3g.71gb (CUDA_VISIBLE_DEVICES=MIG-fake-0)"]
    )


def test_devices_per_worker(pytester: pytest.Pytester, recording: FakeGpus) -> None:
    recording(h200s(4))
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.cuda(min_devices=2)
        def test_pair(cuda_devices):
            assert [str(d) for d in cuda_devices] == ["cuda:0", "cuda:1"]
        """
    )
    result = pytester.runpytest("-n", "2", "--cuda-devices=all", "--cuda-devices-per-worker=2")
    result.assert_outcomes(passed=1)
    assert visible(pytester) == {"gw0": "0,1", "gw1": "2,3"}


def test_devices_per_worker_alone_takes_every_device(
    pytester: pytest.Pytester, recording: FakeGpus
) -> None:
    recording(h200s(4))
    pytester.makepyfile(DEVICE_TESTS)
    pytester.runpytest("-n", "2", "--cuda-devices-per-worker=2").assert_outcomes(passed=3)
    assert visible(pytester) == {"gw0": "0,1", "gw1": "2,3"}


def test_more_workers_than_devices_share_round_robin(
    pytester: pytest.Pytester, recording: FakeGpus
) -> None:
    recording(h200s(2))
    pytester.makepyfile(DEVICE_TESTS)
    result = pytester.runpytest("-n", "4", "--cuda-devices=all")
    result.assert_outcomes(passed=3)
    assert visible(pytester) == {"gw0": "0", "gw1": "1", "gw2": "0", "gw3": "1"}


@pytest.mark.parametrize(
    ("args", "workers"),
    [
        (["--cuda-devices=0,1,2"], {"gw0": "0", "gw1": "1", "gw2": "2"}),
        (["--cuda-devices=all", "--cuda-devices-per-worker=2"], {"gw0": "0,1", "gw1": "2,3"}),
        (["--cuda-devices-per-worker=4"], {"gw0": "0,1,2,3"}),
    ],
)
def test_auto_starts_one_worker_per_device_group(
    pytester: pytest.Pytester, recording: FakeGpus, args: list[str], workers: dict[str, str]
) -> None:
    recording(h200s(4))
    pytester.makepyfile(DEVICE_TESTS)
    result = pytester.runpytest("-n", "auto", *args)
    result.assert_outcomes(passed=3)
    assert visible(pytester) == workers
    result.stdout.fnmatch_lines([f"created: {len(workers)}/{len(workers)} worker*"])


def test_auto_without_devices_is_left_to_xdist(
    pytester: pytest.Pytester, recording: FakeGpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    recording(h200s(4))
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    pytester.makepyfile(DEVICE_TESTS)
    result = pytester.runpytest("-n", "auto")
    result.stdout.fnmatch_lines(["created: 3/3 workers"])
    # No devices asked for: workers are not pinned and every one sees every device.
    assert set(visible(pytester).values()) == {None}


def test_unpinned_workers_still_parametrize(pytester: pytest.Pytester, recording: FakeGpus) -> None:
    recording(h200s(2))
    pytester.makepyfile("def test_device(cuda_device):\n    pass\n")
    result = pytester.runpytest("-n", "2", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*PASSED*test_device?cuda:?? *"] * 2)


def test_a_test_needing_more_than_a_worker_owns_skips_with_the_reason(
    pytester: pytest.Pytester, recording: FakeGpus
) -> None:
    recording(h200s(2))
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.cuda(min_devices=2)
        def test_pair():
            pass
        """
    )
    result = pytester.runpytest("-n", "2", "--cuda-devices=0,1", "-rs")
    result.assert_outcomes(skipped=1)
    (reason,) = skip_reasons(result)
    assert reason.startswith("needs 2 CUDA devices, 1 owned by xdist worker gw")
    assert reason.endswith(" (--cuda-devices-per-worker=1): 0 NVIDIA H200")
    strict = pytester.runpytest("-n", "2", "--cuda-devices=0,1", "--cuda-require")
    strict.assert_outcomes(errors=1)


def test_a_changed_variable_fails_cuda_tests_loudly(
    pytester: pytest.Pytester, recording: FakeGpus
) -> None:
    recording(h200s(2))
    # A conftest that pins workers by itself, in pytest_configure as CuPy's does.
    pytester.makeconftest(
        RECORDING_CONFTEST
        + """
def pytest_configure(config):
    if hasattr(config, "workerinput"):
        os.environ["CUDA_VISIBLE_DEVICES"] = "1"
"""
    )
    pytester.makepyfile(DEVICE_TESTS)
    result = pytester.runpytest("-n", "1", "--cuda-devices=0")
    result.assert_outcomes(passed=1, failed=0, errors=2)
    result.stdout.fnmatch_lines(
        [
            "xdist worker gw0 was pinned to CUDA_VISIBLE_DEVICES='0' by pytest_cuda, but it "
            "is '1' now (changed by a conftest, plugin or test in this worker): CUDA would "
            "start on the wrong devices; remove the code that sets CUDA_VISIBLE_DEVICES, or "
            "drop --cuda-devices/--cuda-devices-per-worker and pin workers yourself"
        ]
    )


def test_tx_that_sets_the_variable_conflicts(
    pytester: pytest.Pytester, recording: FakeGpus
) -> None:
    recording(h200s(2))
    pytester.makepyfile(DEVICE_TESTS)
    result = pytester.runpytest(
        "--tx", "popen//env:CUDA_VISIBLE_DEVICES=1", "--dist", "load", "--cuda-devices=0"
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: <XSpec *env:CUDA_VISIBLE_DEVICES=1*> sets CUDA_VISIBLE_DEVICES itself, and "
         "--cuda-devices=0 would pin the workers too; use one of them"]
    )  # fmt: skip


@pytest.mark.parametrize(
    ("tx", "message"),
    [
        (
            "popen//env:CUDA_VISIBLE_DEVICES=1",
            "ERROR: <XSpec *env:CUDA_VISIBLE_DEVICES=1*> sets CUDA_VISIBLE_DEVICES itself, "
            "and --cuda-devices=all would pin the workers too; use one of them",
        ),
        (
            "ssh=gpu-host//python=python3//env:CUDA_VISIBLE_DEVICES=0",
            "ERROR: <XSpec *ssh=gpu-host*> sets CUDA_VISIBLE_DEVICES itself, and "
            "--cuda-devices=all would pin the workers too; use one of them",
        ),
    ],
)
def test_tx_conflicts_are_usage_errors_without_a_gpu_too(
    pytester: pytest.Pytester, recording: FakeGpus, tx: str, message: str
) -> None:
    """They passed silently on a CPU machine, exit status 0 (issue 39): the options
    conflict whatever devices there are."""
    recording(**CPU_BUILD)
    pytester.makepyfile(DEVICE_TESTS)
    result = pytester.runpytest("--tx", tx, "--dist", "load", "--cuda-devices=all")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_tx_pinning_by_hand_still_works(pytester: pytest.Pytester, recording: FakeGpus) -> None:
    # The pytorch/ao way: without --cuda-devices the plugin leaves --tx env alone.
    recording(h200s(4))
    pytester.makepyfile("def test_device(cuda_devices):\n    assert len(cuda_devices) == 2\n")
    result = pytester.runpytest(
        "--dist=load",
        "--tx", "popen//env:CUDA_VISIBLE_DEVICES=0,1",
        "--tx", "popen//env:CUDA_VISIBLE_DEVICES=2,3",
    )  # fmt: skip
    result.assert_outcomes(passed=1)
    assert seen(pytester) == {
        "gw0": {"CUDA_VISIBLE_DEVICES": "0,1", "devices": [[0, "GPU-fake-0"], [1, "GPU-fake-1"]]},
        "gw1": {"CUDA_VISIBLE_DEVICES": "2,3", "devices": [[0, "GPU-fake-2"], [1, "GPU-fake-3"]]},
    }


def test_uneven_groups_are_a_usage_error(pytester: pytest.Pytester, recording: FakeGpus) -> None:
    recording(h200s(3))
    pytester.makepyfile(DEVICE_TESTS)
    result = pytester.runpytest("-n", "2", "--cuda-devices-per-worker=2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: --cuda-devices-per-worker=2 does not split the 3 selected devices "
         "(0 NVIDIA H200, 1 NVIDIA H200, 2 NVIDIA H200) evenly; select a multiple of 2 "
         "with --cuda-devices"]
    )  # fmt: skip
    result = pytester.runpytest("-n", "2", "--cuda-devices=0", "--cuda-devices-per-worker=2")
    result.stderr.fnmatch_lines(
        ["ERROR: --cuda-devices-per-worker=2, but only 1 device(s) are selected: 0 NVIDIA H200"]
    )


def test_no_gpu_leaves_workers_alone(pytester: pytest.Pytester, recording: FakeGpus) -> None:
    recording(**CPU_BUILD)
    pytester.makepyfile(DEVICE_TESTS)
    result = pytester.runpytest("-n", "2", "--cuda-devices=all", "-rs")
    result.assert_outcomes(passed=1, skipped=2)
    assert set(visible(pytester).values()) == {None}


def test_a_crashed_worker_is_replaced_on_the_same_device(
    pytester: pytest.Pytester, recording: FakeGpus
) -> None:
    recording(h200s(2))
    pytester.makepyfile(
        """
        import os

        def test_crash(cuda_device):
            if os.environ["CUDA_VISIBLE_DEVICES"] == "1" and not os.path.exists("crashed"):
                open("crashed", "w").close()
                os._exit(1)

        def test_more(cuda_device):
            pass
        """
    )
    result = pytester.runpytest(
        "-n", "2", "--cuda-devices=0,1", "--dist=each", "--max-worker-restart=1"
    )
    result.stdout.fnmatch_lines(["*replacing crashed worker gw1*"])
    # gw2 replaces gw1 from the same spec: same device.
    assert visible(pytester) == {"gw0": "0", "gw1": "1", "gw2": "1"}
