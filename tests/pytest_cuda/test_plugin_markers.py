"""The ``cuda`` marker in every form, its skip reasons, malformed markers, --cuda-require."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from reports import skip_reasons

from fake_cuda import CPU_BUILD, CPU_BUILD_REASON, GIB, board, h200s
from gpumagic import cuda

if TYPE_CHECKING:
    from conftest import FakeGpus

REQUIRE = "(--cuda-require turns this skip into an error)"

FORMS = """
import pytest

@pytest.mark.cuda
def test_bare():
    pass

@pytest.mark.cuda(min_devices=2)
def test_two_devices():
    pass

@pytest.mark.cuda(min_memory="40GiB")
def test_memory_string():
    pass

@pytest.mark.cuda(min_memory=40 * 1024**3)
def test_memory_bytes():
    pass

@pytest.mark.cuda(min_capability=(9, 0))
def test_capability_tuple():
    pass

@pytest.mark.cuda(min_capability="9.0")
def test_capability_string():
    pass

@pytest.mark.cuda(min_devices=2, min_memory="40GiB", min_capability=(8, 0))
def test_everything():
    pass

def test_cpu():
    pass
"""


def test_marker_is_documented(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.cuda(min_devices=1, min_memory=None, min_capability=None): "
            "the test needs CUDA: at least min_devices usable CUDA devices, min_memory free "
            'on each device it is given (bytes or "40GiB"), and a compute capability of at '
            'least min_capability ((8, 0) or "8.0"). Without them the test is skipped with '
            "the reason (an error under --cuda-require). With markers on the test, its class "
            "and its module, the strictest value of each keyword wins."
        ]
    )


def test_every_form_runs_where_the_machine_has_it(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus(h200s(2))
    pytester.makepyfile(FORMS)
    pytester.runpytest("--strict-markers", "--cuda-require").assert_outcomes(passed=8)


def test_no_cuda_in_torch_skips_every_form_with_the_reason(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus(**CPU_BUILD)
    pytester.makepyfile(FORMS)
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=1, skipped=7)
    assert skip_reasons(result) == {f"CUDA unavailable: {CPU_BUILD_REASON}": 7}


def test_no_driver_skips_with_the_reason(pytester: pytest.Pytester, fake_gpus: FakeGpus) -> None:
    fake_gpus([])
    pytester.makepyfile(FORMS)
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=1, skipped=7)
    assert skip_reasons(result) == {"CUDA unavailable: the NVIDIA driver reports no GPU": 7}


def test_too_few_devices_are_named(pytester: pytest.Pytester, fake_gpus: FakeGpus) -> None:
    fake_gpus(h200s(1))
    pytester.makepyfile(FORMS)
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=6, skipped=2)
    assert skip_reasons(result) == {"needs 2 CUDA devices, 1 available: 0 NVIDIA H200": 2}


def test_too_few_selected_devices_name_the_selection(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus(h200s(3))
    pytester.makepyfile(FORMS)
    result = pytester.runpytest("-rs", "--cuda-devices=2")
    result.assert_outcomes(passed=6, skipped=2)
    assert skip_reasons(result) == {
        "needs 2 CUDA devices, 1 selected by --cuda-devices=2: 2 NVIDIA H200": 2
    }


def test_too_little_free_memory_is_measured(pytester: pytest.Pytester, fake_gpus: FakeGpus) -> None:
    fake_gpus([board(0, free=12 * GIB), board(1)])
    pytester.makepyfile(FORMS)
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=5, skipped=3)
    assert skip_reasons(result) == {
        "needs 40.0 GiB free memory, cuda:0 NVIDIA H200 has 12.0 GiB free (of 140.4 GiB)": 3
    }


def test_memory_is_checked_on_every_device_the_test_is_given(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus([board(0), board(1, free=2 * GIB)])
    pytester.makepyfile(FORMS)
    result = pytester.runpytest("-rs")
    # min_devices=2 takes cuda:0 and cuda:1; the others take cuda:0 only.
    result.assert_outcomes(passed=7, skipped=1)
    assert skip_reasons(result) == {
        "needs 40.0 GiB free memory, cuda:1 NVIDIA H200 has 2.0 GiB free (of 140.4 GiB)": 1
    }


def test_low_capability_is_named(pytester: pytest.Pytester, fake_gpus: FakeGpus) -> None:
    fake_gpus([board(i, "NVIDIA A100-SXM4-80GB", capability=(8, 0)) for i in range(2)])
    pytester.makepyfile(FORMS)
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=6, skipped=2)
    assert skip_reasons(result) == {
        "needs compute capability 9.0, cuda:0 NVIDIA A100-SXM4-80GB has 8.0": 2
    }


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        ("cuda(min_device=2)",
         "unknown keyword 'min_device'; known: min_devices, min_memory, min_capability"),
        ("cuda(2)", "takes keyword arguments only (min_devices=, min_memory=, "
         "min_capability=), got positional 2"),
        ("cuda(min_devices=0)", "min_devices must be a positive integer, got 0"),
        ("cuda(min_devices='2')", "min_devices must be a positive integer, got '2'"),
        ("cuda(min_devices=True)", "min_devices must be a positive integer, got True"),
        ("cuda(min_memory='forty')", "min_memory: not a memory size: 'forty'; use bytes or a "
         "number with a unit such as '512MiB', '40GiB' or '1.5GB'"),
        ("cuda(min_memory='40 GB RAM')", "min_memory: not a memory size: '40 GB RAM';*"),
        ("cuda(min_memory=-1)", "min_memory: memory size must not be negative: -1"),
        ("cuda(min_capability=(8,))", "min_capability: not a compute capability: (8,); "
         "use (major, minor) like (8, 0)"),
        ("cuda(min_capability='ampere')", "min_capability: not a compute capability: "
         "'ampere'; use (8, 0), '8.0' or 'sm_80'"),
    ],
)  # fmt: skip
def test_malformed_marker_is_an_error_naming_the_test(
    pytester: pytest.Pytester, fake_gpus: FakeGpus, marker: str, message: str
) -> None:
    # On a machine without CUDA too: a typo must not hide behind "CUDA unavailable".
    fake_gpus(**CPU_BUILD)
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.{marker}
        def test_typo():
            pass

        def test_fine():
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, errors=1)
    name = "test_malformed_marker_is_an_error_naming_the_test.py::test_typo"
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_typo*",
            f"malformed @pytest.mark.cuda on {name}: {message}",
            "*short test summary info*",
            f"ERROR {name} - *",
        ]
    )
    result.stdout.no_fnmatch_line("*During handling*")


def test_markers_on_module_class_and_function_add_up(
    pytester: pytest.Pytester, fake_gpus: FakeGpus
) -> None:
    fake_gpus([board(0, free=50 * GIB), board(1, free=50 * GIB, capability=(8, 0))])
    pytester.makepyfile(
        """
        import pytest

        pytestmark = pytest.mark.cuda(min_memory="40GiB")

        @pytest.mark.cuda(min_capability=(8, 0))
        class TestBoth:
            @pytest.mark.cuda(min_devices=2)
            def test_needs_all(self):
                pass

            def test_needs_memory_and_capability(self):
                pass

        @pytest.mark.cuda(min_memory="60GiB")
        def test_strictest_memory_wins():
            pass
        """
    )
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=2, skipped=1)
    assert skip_reasons(result) == {
        "needs 60.0 GiB free memory, cuda:0 NVIDIA H200 has 50.0 GiB free (of 140.4 GiB)": 1
    }


@pytest.mark.parametrize(
    ("machine", "reason"),
    [
        ({**CPU_BUILD}, f"CUDA unavailable: {CPU_BUILD_REASON}"),
        ({"boards": h200s(1)}, "needs 2 CUDA devices, 1 available: 0 NVIDIA H200"),
        ({"boards": [board(0, free=GIB), board(1)]},
         "needs 40.0 GiB free memory, cuda:0 NVIDIA H200 has 1.0 GiB free (of 140.4 GiB)"),
        ({"boards": [board(i, "NVIDIA T4", capability=(7, 5)) for i in range(2)]},
         "needs compute capability 8.0, cuda:0 NVIDIA T4 has 7.5"),
    ],
)  # fmt: skip
def test_require_fails_with_the_same_reason(
    pytester: pytest.Pytester, fake_gpus: FakeGpus, machine: dict[str, object], reason: str
) -> None:
    fake_gpus(**machine)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.cuda(min_devices=2, min_memory="40GiB", min_capability=(8, 0))
        def test_gpu():
            pass

        def test_cpu():
            pass
        """
    )
    skipped = pytester.runpytest("-rs")
    skipped.assert_outcomes(passed=1, skipped=1)
    assert skip_reasons(skipped) == {reason: 1}
    failed = pytester.runpytest("--cuda-require")
    if reason.startswith("CUDA unavailable"):
        # No usable device at all: the whole run is an error, before any test.
        assert failed.ret == pytest.ExitCode.USAGE_ERROR
        failed.stderr.fnmatch_lines([f"*--cuda-require: no usable CUDA device here: {reason}"])
        return
    failed.assert_outcomes(passed=1, errors=1)
    failed.stdout.fnmatch_lines(
        ["*ERROR at setup of test_gpu*", f"{reason} {REQUIRE}", "ERROR *::test_gpu - *"]
    )


def test_free_memory_unknown_without_nvml_skips_with_the_reason(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NVML missing, torch counts the devices: names and free memory are unknown.
    pytester.makeconftest(
        """
        from gpumagic import cuda
        from gpumagic.devices import CudaStatus, DeviceInfo

        device = DeviceInfo(0, "unknown (NVML unavailable)", 0, (0, 0))
        status = CudaStatus(True, "", "2.11.0+cu130", "13.0", devices=(device,))
        cuda.status = lambda: status
        cuda.nvml_memory_info = lambda d: (_ for _ in ()).throw(cuda.CudaUnavailable("x"))
        """
    )
    monkeypatch.setattr(cuda, "status", cuda.status)
    monkeypatch.setattr(cuda, "nvml_memory_info", cuda.nvml_memory_info)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.cuda(min_memory="1GiB")
        def test_gpu():
            pass
        """
    )
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=1)
    assert skip_reasons(result) == {
        "needs 1.0 GiB free memory, but the free memory of cuda:0 is unknown (NVML unavailable)": 1
    }


def test_skip_on_this_machine(pytester: pytest.Pytester) -> None:
    """Without fakes: the real discovery of the machine the suite runs on."""
    status = cuda.status()
    if status.available:
        pytest.skip("this machine has a GPU (test_plugin_gpu.py covers it)")
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.cuda
        def test_gpu():
            pass
        """
    )
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=1)
    assert skip_reasons(result) == {f"CUDA unavailable: {status.reason}": 1}
