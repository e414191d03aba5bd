"""``--cuda-devices`` (ini ``cuda_devices``, env ``PYTEST_CUDA_DEVICES``) through real runs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from fake_cuda import CPU_BUILD, CPU_BUILD_REASON, board, h200s

if TYPE_CHECKING:
    from conftest import FakeGpus

WHICH_DEVICE = """
def test_device(cuda_device):
    pass
"""


def usage_error(result: pytest.RunResult, message: str) -> None:
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {message}"])


def test_options_are_in_help(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(
        [
            "CUDA (pytest_cuda): devices, leak checks, sync modes; env $PYTEST_CUDA_DEVICES:",
            "*--cuda-devices=INDICES*",
            "*--cuda-devices-per-worker=K*",
            "*--cuda-require*strict mode for GPU CI*",
            "*cuda_devices (string):*",
            "*default for --cuda-devices*",
        ]
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0,x", "'x' is not a device index; use indices into the visible devices such as 0 "
         "or cuda:0, a list such as 0,1 or 'all'"),
        ("-1", "'-1' is not a device index;*"),
        ("0,,1", "'' is not a device index;*"),
        ("1.0", "'1.0' is not a device index;*"),
        ("0,1,0", "cuda:0 is listed twice"),
        ("", "no device given; use indices into the visible devices such as 0 or cuda:0, a "
         "list such as 0,1 or 'all'"),
        ("cpu", "--cuda-devices takes CUDA devices only, not cpu;*"),
        ("cuda:1,1", "cuda:1 is listed twice"),
    ],
)  # fmt: skip
def test_a_malformed_selection_is_refused_as_it_is_parsed(
    pytester: pytest.Pytester, value: str, message: str
) -> None:
    # No discovery (no machine planted): argparse refuses it, before any plugin runs.
    pytester.makepyfile(WHICH_DEVICE)
    result = pytester.runpytest(f"--cuda-devices={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*error: argument --cuda-devices: {message}"])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0,3", "--cuda-devices=0,3: cuda:3 requested, this machine shows 2 devices: "
         "0 NVIDIA H200, 1 NVIDIA H200"),
        ("3,2", "--cuda-devices=3,2: cuda:3, cuda:2 requested, this machine shows 2 devices: "
         "0 NVIDIA H200, 1 NVIDIA H200"),
    ],
)  # fmt: skip
def test_a_selection_of_missing_devices_is_a_usage_error(
    pytester: pytest.Pytester, fake_gpus: FakeGpus, value: str, message: str
) -> None:
    fake_gpus(h200s(2))
    pytester.makepyfile(WHICH_DEVICE)
    usage_error(pytester.runpytest(f"--cuda-devices={value}"), message)


def test_out_of_range_names_the_outer_visible_devices(
    pytester: pytest.Pytester, fake_gpus: FakeGpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_gpus(h200s(4))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-fake-3,GPU-fake-1")
    pytester.makepyfile(WHICH_DEVICE)
    usage_error(
        pytester.runpytest("--cuda-devices=2"),
        "--cuda-devices=2: cuda:2 requested, this machine shows 2 devices "
        "(CUDA_VISIBLE_DEVICES='GPU-fake-3,GPU-fake-1'): 0 NVIDIA H200, 1 NVIDIA H200",
    )


def test_one_device_is_named_in_the_singular(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus([board(0, "NVIDIA A100-SXM4-80GB", capability=(8, 0))])
    pytester.makepyfile(WHICH_DEVICE)
    usage_error(
        pytester.runpytest("--cuda-devices=1"),
        "--cuda-devices=1: cuda:1 requested, this machine shows 1 device: 0 NVIDIA A100-SXM4-80GB",
    )


def test_devices_asked_for_without_a_gpu(pytester: pytest.Pytester, fake_gpus: FakeGpus) -> None:
    fake_gpus(**CPU_BUILD)
    pytester.makepyfile(WHICH_DEVICE)
    usage_error(
        pytester.runpytest("--cuda-devices=0"),
        f"--cuda-devices=0 asks for CUDA devices, but there is no usable GPU here: "
        f"{CPU_BUILD_REASON}",
    )


def test_devices_asked_for_where_the_driver_shows_none(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus([])
    pytester.makepyfile(WHICH_DEVICE)
    usage_error(
        pytester.runpytest("--cuda-devices=0,1"),
        "--cuda-devices=0,1 asks for CUDA devices, but there is no usable GPU here: "
        "the NVIDIA driver reports no GPU",
    )


def test_all_without_a_gpu_is_no_error(pytester: pytest.Pytester, fake_gpus: FakeGpus) -> None:
    fake_gpus(**CPU_BUILD)
    pytester.makepyfile(WHICH_DEVICE)
    result = pytester.runpytest("--cuda-devices=all", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines([f"SKIPPED [[]1] *: CUDA unavailable: {CPU_BUILD_REASON}"])


def test_selection_picks_and_orders_the_devices(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus(h200s(3))
    pytester.makepyfile(WHICH_DEVICE)
    result = pytester.runpytest("--cuda-devices=2,cuda:0", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_device?cuda:2? PASSED*", "*test_device?cuda:0? PASSED*"])


def test_all_selects_every_visible_device(pytester: pytest.Pytester, fake_gpus: FakeGpus) -> None:
    fake_gpus(h200s(3))
    pytester.makepyfile(WHICH_DEVICE)
    pytester.runpytest("--cuda-devices=all").assert_outcomes(passed=3)


def test_env_variable_selects(
    pytester: pytest.Pytester, fake_gpus: FakeGpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_gpus(h200s(2))
    monkeypatch.setenv("PYTEST_CUDA_DEVICES", "1")
    pytester.makepyfile(WHICH_DEVICE)
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["cuda devices (selected by PYTEST_CUDA_DEVICES=1):", "*test_device?cuda:1? PASSED*"]
    )


def test_empty_env_variable_is_unset(
    pytester: pytest.Pytester, fake_gpus: FakeGpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_gpus(h200s(2))
    monkeypatch.setenv("PYTEST_CUDA_DEVICES", "")
    pytester.makepyfile(WHICH_DEVICE)
    pytester.runpytest().assert_outcomes(passed=2)


def test_bad_env_variable_is_named(
    pytester: pytest.Pytester, fake_gpus: FakeGpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_gpus(h200s(2))
    monkeypatch.setenv("PYTEST_CUDA_DEVICES", "2")
    pytester.makepyfile(WHICH_DEVICE)
    usage_error(
        pytester.runpytest(),
        "PYTEST_CUDA_DEVICES=2: cuda:2 requested, this machine shows 2 devices: "
        "0 NVIDIA H200, 1 NVIDIA H200",
    )


def test_ini_selects(pytester: pytest.Pytester, fake_gpus: FakeGpus) -> None:
    fake_gpus(h200s(2))
    pytester.makeini("[pytest]\ncuda_devices = 1\n")
    pytester.makepyfile(WHICH_DEVICE)
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["cuda devices (selected by cuda_devices = 1 (ini)):", "*test_device?cuda:1? PASSED*"]
    )


def test_bad_ini_value_is_named(pytester: pytest.Pytester, fake_gpus: FakeGpus) -> None:
    fake_gpus(h200s(2))
    pytester.makeini("[pytest]\ncuda_devices = one\n")
    pytester.makepyfile(WHICH_DEVICE)
    usage_error(
        pytester.runpytest(),
        "cuda_devices = one (ini): 'one' is not a device index;*",
    )


def test_option_beats_env_beats_ini(
    pytester: pytest.Pytester, fake_gpus: FakeGpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_gpus(h200s(3))
    pytester.makeini("[pytest]\ncuda_devices = 0\n")
    pytester.makepyfile(WHICH_DEVICE)
    monkeypatch.setenv("PYTEST_CUDA_DEVICES", "1")
    pytester.runpytest("-v").stdout.fnmatch_lines(["*test_device?cuda:1? PASSED*"])
    result = pytester.runpytest("-v", "--cuda-devices=2")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_device?cuda:2? PASSED*"])


def test_bad_selection_stops_a_run_without_device_tests(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus(h200s(1))
    pytester.makepyfile("def test_cpu():\n    pass\n")
    usage_error(pytester.runpytest("--cuda-devices=5"), "--cuda-devices=5: cuda:5 requested*")


def test_devices_per_worker_is_checked_only_with_workers(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    # The option can live in addopts; a plain run (or -n 0 for debugging) ignores it.
    fake_gpus(h200s(1))
    pytester.makepyfile(WHICH_DEVICE)
    pytester.runpytest("--cuda-devices-per-worker=2").assert_outcomes(passed=1)
    pytester.runpytest("--cuda-devices-per-worker=2", "-n", "0").assert_outcomes(passed=1)


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_devices_per_worker_is_a_positive_count(pytester: pytest.Pytester, value: str) -> None:
    pytester.makepyfile("def test_cpu():\n    pass\n")
    result = pytester.runpytest(f"--cuda-devices-per-worker={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"*--cuda-devices-per-worker: takes a number of devices, 1 or more; got '{value}'*"]
    )


def test_plugin_can_be_turned_off(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_cpu():\n    pass\n")
    result = pytester.runpytest("-p", "no:cuda")
    result.assert_outcomes(passed=1)
    assert not [line for line in result.outlines if line.startswith("cuda")]
    result = pytester.runpytest("-p", "no:cuda", "--cuda-devices=0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unrecognized arguments: --cuda-devices=0*"])


def test_the_documented_ini_keeps_strict_markers_working_with_the_plugin_off(
    pytester: pytest.Pytester,
) -> None:
    """docs/pytest-plugin.md: the ini lines a suite adds to run under -p no:cuda."""
    pytester.makeini(
        """
        [pytest]
        markers =
            cuda: needs CUDA (pytest_cuda)
            cuda_leak_check: CUDA leak check (pytest_cuda)
            cuda_sync: synchronize after every torch op (pytest_cuda)
            cuda_no_sync: fail on implicit host-device syncs (pytest_cuda)
        """
    )
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.cuda
        @pytest.mark.cuda_leak_check
        @pytest.mark.cuda_sync
        @pytest.mark.cuda_no_sync
        def test_marked():
            pass
        """
    )
    pytester.runpytest("-p", "no:cuda", "--strict-markers").assert_outcomes(passed=1)
    # And with it on: the ini lines do not clash with the plugin's own (the test runs,
    # or skips where there is no GPU).
    assert pytester.runpytest("--strict-markers").ret == pytest.ExitCode.OK


def test_the_documented_conftest_skips_fixture_tests_with_the_plugin_off(
    pytester: pytest.Pytester,
) -> None:
    """docs/pytest-plugin.md: with -p no:cuda, a test taking a device fixture errored
    with "fixture not found" (issue 29); the page's conftest skips it, with the reason,
    and does nothing with the plugin on."""
    page = (Path(__file__).parents[2] / "docs" / "pytest-plugin.md").read_text()
    (conftest,) = [
        block
        for block in re.findall(r"^```python\n(.*?)^```", page, re.MULTILINE | re.DOTALL)
        if "def pytest_collection_modifyitems" in block
    ]
    pytester.makeconftest(conftest)
    pytester.makepyfile(
        """
        def test_device(cuda_device):
            pass

        def test_devices(cuda_devices):
            pass

        def test_sync(cuda_no_sync):
            pass

        def test_cpu():
            pass
        """
    )
    result = pytester.runpytest("-p", "no:cuda", "-rs")
    result.assert_outcomes(passed=1, skipped=3)
    result.stdout.fnmatch_lines(["*takes a pytest_cuda fixture; the plugin is off (-p no:cuda)"])
    result.stdout.no_fnmatch_line("*not found*")
    # With the plugin on, the conftest leaves the tests to it (no GPU here: it skips
    # the device tests for its own reason, or runs them).
    result = pytester.runpytest("-rs")
    result.stdout.no_fnmatch_line("*the plugin is off*")
    assert result.ret == pytest.ExitCode.OK
