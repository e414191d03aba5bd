"""``cuda_device`` and ``cuda_devices``, and the API the other pytest_cuda modules use."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from reports import skip_reasons

from fake_cuda import CPU_BUILD, CPU_BUILD_REASON, GIB, board, h200s

if TYPE_CHECKING:
    from conftest import FakeGpus

REQUIRE = "(--cuda-require turns this skip into an error)"


def test_fixtures_are_documented(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--fixtures")
    result.stdout.fnmatch_lines(
        [
            "cuda_device [[]session scope[]] -- *pytest_cuda/plugin.py:*",
            "    A CUDA device for this test, as a ``torch.device``.",
            "",
            "cuda_devices -- *pytest_cuda/plugin.py:*",
            "    Every selected CUDA device (an xdist worker's own), as ``torch.device`` objects.",
        ]
    )


def test_cuda_device_runs_once_per_device(pytester: pytest.Pytester, fake_gpus: FakeGpus) -> None:
    fake_gpus(h200s(2))
    pytester.makepyfile(
        """
        import torch

        def test_device(cuda_device):
            assert isinstance(cuda_device, torch.device)
            assert cuda_device.type == "cuda"
            print("GOT", cuda_device)
        """
    )
    result = pytester.runpytest("-v", "-s")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "*test_device?cuda:0? GOT cuda:0",
            "PASSED",
            "*test_device?cuda:1? GOT cuda:1",
            "PASSED",
        ]
    )


def test_tests_are_grouped_by_device(pytester: pytest.Pytester, fake_gpus: FakeGpus) -> None:
    # Session-scoped: every test of cuda:0 runs, then every test of cuda:1.
    fake_gpus(h200s(2))
    pytester.makepyfile(
        """
        def test_a(cuda_device):
            pass

        def test_b(cuda_device):
            pass
        """
    )
    result = pytester.runpytest("-v")
    result.stdout.fnmatch_lines(
        ["*test_a?cuda:0? PASSED*", "*test_b?cuda:0? PASSED*", "*test_a?cuda:1? PASSED*",
         "*test_b?cuda:1? PASSED*"]
    )  # fmt: skip


def test_wider_fixtures_can_take_the_device(pytester: pytest.Pytester, fake_gpus: FakeGpus) -> None:
    fake_gpus(h200s(2))
    pytester.makepyfile(
        """
        import pytest

        @pytest.fixture(scope="module")
        def model(cuda_device):
            return f"model on {cuda_device}"

        def test_model(model, cuda_device):
            assert model == f"model on {cuda_device}"
        """
    )
    pytester.runpytest().assert_outcomes(passed=2)


def test_cuda_device_without_a_gpu_skips_unparametrized(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus(**CPU_BUILD)
    pytester.makepyfile(
        """
        def test_device(cuda_device):
            pass

        def test_devices(cuda_devices):
            pass
        """
    )
    result = pytester.runpytest("-v", "-rs")
    result.assert_outcomes(skipped=2)
    # Not parametrized: no device to run on.
    result.stdout.fnmatch_lines(["*::test_device SKIPPED*", "*::test_devices SKIPPED*"])
    assert skip_reasons(result) == {f"CUDA unavailable: {CPU_BUILD_REASON}": 2}
    failed = pytester.runpytest("--cuda-require")
    assert failed.ret == pytest.ExitCode.USAGE_ERROR
    failed.stderr.fnmatch_lines(
        [f"*--cuda-require: no usable CUDA device here: CUDA unavailable: {CPU_BUILD_REASON}"]
    )


def test_a_users_own_device_fixture_wins(pytester: pytest.Pytester, fake_gpus: FakeGpus) -> None:
    """A fixture named cuda_device in the user's module (or conftest) overrides the
    plugin's (pytest's rules): an unmarked test that takes it runs, neither skipped nor
    parametrized per device."""
    fake_gpus(**CPU_BUILD)
    pytester.makepyfile(
        """
        import pytest

        @pytest.fixture
        def cuda_device():
            return "the user's own device"

        def test_own(cuda_device):
            assert cuda_device == "the user's own device"

        @pytest.mark.cuda
        def test_marked(cuda_device):
            pass
        """
    )
    result = pytester.runpytest("-v", "-rs")
    result.assert_outcomes(passed=1, skipped=1)  # the marker still asks for a GPU
    result.stdout.fnmatch_lines(["*::test_own PASSED*", "*::test_marked SKIPPED*"])
    assert skip_reasons(result) == {f"CUDA unavailable: {CPU_BUILD_REASON}": 1}


def test_cuda_devices_lists_the_selection(pytester: pytest.Pytester, fake_gpus: FakeGpus) -> None:
    fake_gpus(h200s(3))
    pytester.makepyfile(
        """
        def test_devices(cuda_devices):
            assert [str(d) for d in cuda_devices] == ["cuda:2", "cuda:0"]
        """
    )
    result = pytester.runpytest("--cuda-devices=2,0", "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*::test_devices PASSED*"])


def test_cuda_devices_skips_below_the_marker(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus(h200s(2))
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.cuda(min_devices=3)
        def test_three(cuda_devices):
            pass

        @pytest.mark.cuda(min_devices=2)
        def test_two(cuda_devices):
            assert len(cuda_devices) == 2
        """
    )
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=1, skipped=1)
    assert skip_reasons(result) == {
        "needs 3 CUDA devices, 2 available: 0 NVIDIA H200, 1 NVIDIA H200": 1
    }


def test_marker_is_checked_per_device_parameter(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus([board(0, capability=(9, 0)), board(1, "NVIDIA A100-SXM4-80GB", capability=(8, 0))])
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.cuda(min_capability="9.0")
        def test_hopper(cuda_device):
            pass
        """
    )
    result = pytester.runpytest("-v", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(
        ["*::test_hopper?cuda:0? PASSED*", "*::test_hopper?cuda:1? SKIPPED*"]
    )
    assert skip_reasons(result) == {
        "needs compute capability 9.0, cuda:1 NVIDIA A100-SXM4-80GB has 8.0": 1
    }


def test_memory_is_checked_per_device_parameter(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus([board(0, free=3 * GIB), board(1)])
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.cuda(min_memory="10GiB")
        def test_big(cuda_device):
            pass
        """
    )
    result = pytester.runpytest("-v", "-rs")
    result.stdout.fnmatch_lines(["*::test_big?cuda:0? SKIPPED*", "*::test_big?cuda:1? PASSED*"])
    assert skip_reasons(result) == {
        "needs 10.0 GiB free memory, cuda:0 NVIDIA H200 has 3.0 GiB free (of 140.4 GiB)": 1
    }


def test_api_for_the_other_modules(pytester: pytest.Pytester, fake_gpus: FakeGpus) -> None:
    """selected_devices, cuda_requirement and item_devices, as a leak or sync mode uses them."""
    fake_gpus(h200s(3))
    pytester.makeconftest(
        """
        import fake_cuda
        import pytest
        from pytest_cuda.plugin import cuda_requirement, item_devices, selected_devices

        fake_cuda.install_planted()

        def pytest_configure(config):
            config.seen = []

        @pytest.hookimpl(trylast=True)
        def pytest_runtest_setup(item):
            names = [f"cuda:{d.index}" for d in item_devices(item)]
            item.config.seen.append((item.name, cuda_requirement(item), names))

        def pytest_unconfigure(config):
            print("SELECTED", [d.index for d in selected_devices(config)])
            for seen in config.seen:
                print("SEEN", *seen)
        """
    )
    pytester.makepyfile(
        """
        import pytest

        def test_cpu():
            pass

        @pytest.mark.cuda(min_memory="1GiB")
        def test_marked():
            pass

        def test_fixture(cuda_device):
            pass
        """
    )
    result = pytester.runpytest("--cuda-devices=2,1", "-s")
    result.assert_outcomes(passed=4)
    seen = [line for line in result.outlines if line.startswith(("SELECTED", "SEEN"))]
    assert seen == [
        "SELECTED [2, 1]",
        "SEEN test_cpu None ['cuda:2', 'cuda:1']",
        "SEEN test_marked CudaRequirement(min_devices=1, min_memory=1073741824, "
        "min_capability=None) ['cuda:2', 'cuda:1']",
        "SEEN test_fixture[cuda:2] CudaRequirement(min_devices=1, min_memory=None, "
        "min_capability=None) ['cuda:2']",
        "SEEN test_fixture[cuda:1] CudaRequirement(min_devices=1, min_memory=None, "
        "min_capability=None) ['cuda:1']",
    ]
