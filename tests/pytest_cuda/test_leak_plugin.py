"""The leak checks through real pytest runs, on a fake allocator (see fake_cuda.py).

The planted suites' conftest installs :mod:`fake_cuda` in place of the allocator side
of :mod:`gpumagic.cuda` and hands the fake to the tests as ``fake_cuda``; the plugin,
its hooks and :mod:`pytest_cuda.leaks.engine` run for real.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from gpumagic import cuda

if TYPE_CHECKING:
    from collections.abc import Callable

    from fake_cuda import FakeAllocator


def installed() -> FakeAllocator:
    """The fake the last in-process run installed."""
    fake = cuda.allocator_stats.__self__  # type: ignore[attr-defined]
    assert isinstance(fake.blocks, dict)
    return fake  # type: ignore[no-any-return]


LEAKS = """
KEEP = []

def test_clean(fake_cuda):
    x = fake_cuda.tensor(1 << 20)
    del x

def test_leak_small(fake_cuda):
    KEEP.append(fake_cuda.tensor(4))

def test_leak_large(fake_cuda):
    KEEP.append(fake_cuda.tensor(8 << 20))

def test_no_cuda():
    assert 1 + 1 == 2
"""


# ---------------------------------------------------------------------------
# Options, marker and fixture are documented.


def test_options_marker_and_fixture_are_documented(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(
        [
            "*--cuda-leak-check*fail every test that leaves CUDA*",
            "*--cuda-leak-trace*the thorough holder search*",
            "*--cuda-leak-report=FILE*",
            "*--cuda-memory-report=N*",
            "*cuda_leak_tolerance (string):*",
        ]
    )
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(
        ["@pytest.mark.cuda_leak_check(tolerance=None, mode='fail'): fail the test when*"]
    )
    result = pytester.runpytest("--fixtures")
    result.stdout.fnmatch_lines(["no_cuda_leak -- *leaks/plugin.py:*", "*with no_cuda_leak(*"])


def test_a_negative_memory_report_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("--cuda-memory-report=-1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*error: argument --cuda-memory-report: takes a number of tests, 0 or more; got '-1'"]
    )


# ---------------------------------------------------------------------------
# Without CUDA.


def test_without_cuda_the_check_is_a_no_op(pytester: pytest.Pytester) -> None:
    if cuda.status().available:
        pytest.skip("this machine has a GPU")
    pytester.makepyfile(
        """
        import torch

        def test_cpu_tensor():
            assert torch.ones(3).sum().item() == 3

        def test_plain():
            pass
        """
    )
    result = pytester.runpytest("--cuda-leak-check", "--cuda-leak-trace", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["cuda leak check: nothing to check, *no usable GPU*"])
    result.stdout.no_fnmatch_line("*LEAK*")
    result.stdout.no_fnmatch_line("*CUDA memory*")
    assert not cuda.is_initialized()


# ---------------------------------------------------------------------------
# Leaks: outcome, section, summary.


def test_a_leak_has_its_own_outcome_section_and_summary(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(LEAKS)
    result = pytester.runpytest("--cuda-leak-check", "-v")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    outcomes = result.parseoutcomes()
    assert outcomes == {"passed": 4, "leaked": 2}
    result.stdout.fnmatch_lines(
        [
            "cuda leak check: every test that uses CUDA; this process's allocator; stacks of live"
            " blocks recorded; holders searched to the end",
            "*::test_leak_small PASSED*",
            "*::test_leak_small LEAKED*",
            "*= CUDA memory leaks =*",
            "*_ test_planted.py::test_leak_small _*",
            "test_leak_small left 512 B (512 B) allocated on cuda:0; tolerance 0 B.",
            # In this process the suite's conftest froze the heap first, so no collection
            # of the whole heap: the holder below is a module global, alive.
            "Measured in this process's caching allocator after: young garbage (gc generation"
            " 1), cuBLAS/cuBLASLt workspaces, blocks freed on other streams (synchronize, "
            "empty_cache).",
            "Blocks still alive, by allocating stack (largest first):",
            "  512 B in 1 block on cuda:0 (4 B requested)",
            "    test_planted.py:8 in test_leak_small",
            "Who holds them (the reference path from a root, largest first):",
            "  512 B (1 tensor) on cuda:0: test_planted.KEEP[0] (module global)",
            "*_ test_planted.py::test_leak_large _*",
            "test_leak_large left 8.0 MiB (8,388,608 B) allocated on cuda:0; tolerance 0 B.",
            "*- leaking tests -*",
            "LEAKED test_planted.py::test_leak_small - 512 B on cuda:0, allocated at "
            "test_planted.py:8 in test_leak_small, held by test_planted.KEEP[0] (module global)",
            "LEAKED test_planted.py::test_leak_large - 8.0 MiB on cuda:0, allocated at "
            "test_planted.py:11 in test_leak_large, held by test_planted.KEEP[1] (module global)",
        ]
    )
    result.stdout.no_fnmatch_line("*test_clean LEAKED*")
    result.stdout.no_fnmatch_line("*test_no_cuda LEAKED*")


def test_progress_shows_the_letter(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(LEAKS)
    result = pytester.runpytest("--cuda-leak-check")
    result.stdout.fnmatch_lines(["test_planted.py ..L.L. *"])
    result.stdout.fnmatch_lines(["*4 passed, 2 leaked*"])


def test_trace_names_the_allocating_lines(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(
        """
        KEEP = []

        def make(fake_cuda, n):
            return fake_cuda.tensor(n)

        def test_leak_via_helper(fake_cuda):
            KEEP.append(make(fake_cuda, 4096))
            KEEP.append(make(fake_cuda, 4096))
            KEEP.append(fake_cuda.tensor(1 << 30))
        """
    )
    result = pytester.runpytest("--cuda-leak-check", "--cuda-leak-trace")
    assert result.parseoutcomes() == {"passed": 1, "leaked": 1}
    result.stdout.fnmatch_lines(
        [
            "cuda leak check: every test that uses CUDA; this process's allocator; stacks of live"
            " blocks recorded; holders searched to the end",
            "test_leak_via_helper left 1.0 GiB (1,073,750,016 B) allocated on cuda:0; "
            "tolerance 0 B.",
            "Blocks still alive, by allocating stack (largest first):",
            "  1.0 GiB in 1 block on cuda:0",
            "    test_planted.py:9 in test_leak_via_helper",
            "  4.0 KiB in 1 block on cuda:0",
            "    test_planted.py:4 in make",
            "    test_planted.py:7 in test_leak_via_helper",
            "  4.0 KiB in 1 block on cuda:0",
            "    test_planted.py:4 in make",
            "    test_planted.py:8 in test_leak_via_helper",
            "Who holds them (the reference path from a root, largest first):",
            "  1.0 GiB (1 tensor) on cuda:0: test_planted.KEEP[2] (module global)",
            "  4.0 KiB (1 tensor) on cuda:0: test_planted.KEEP[0] (module global)",
            "  4.0 KiB (1 tensor) on cuda:0: test_planted.KEEP[1] (module global)",
            "*- leaking tests -*",
            "LEAKED test_planted.py::test_leak_via_helper - 1.0 GiB on cuda:0, allocated at "
            "test_planted.py:9 in test_leak_via_helper, held by test_planted.KEEP[2] "
            "(module global)",
        ]
    )
    fake = installed()
    assert not fake.recording, "recording is switched back off at the end of the run"


def test_trace_starts_recording_when_a_test_first_initialises_cuda(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(
        """
        KEEP = []

        def test_first_cuda_use_leaks(fake_cuda):
            assert not fake_cuda.initialized
            KEEP.append(fake_cuda.tensor(512))
        """
    )
    result = pytester.runpytest("--cuda-leak-check", "--cuda-leak-trace")
    result.stdout.fnmatch_lines(
        ["LEAKED *::test_first_cuda_use_leaks - 512 B on cuda:0, allocated at test_planted.py:5 *"]
    )


def test_a_leak_on_another_device_is_named(
    pytester: pytest.Pytester, planted: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LEAK_FAKE_DEVICES", "2")
    planted(
        """
        KEEP = []

        def test_second_device(fake_cuda):
            KEEP.append(fake_cuda.tensor(4096, device=1))
        """
    )
    result = pytester.runpytest("--cuda-leak-check")
    result.stdout.fnmatch_lines(
        [
            "LEAKED test_planted.py::test_second_device - 4.0 KiB on cuda:1, allocated at "
            "test_planted.py:4 in test_second_device, held by test_planted.KEEP[0] (module global)"
        ]
    )


# ---------------------------------------------------------------------------
# The marker.


def test_the_marker_checks_only_marked_tests_without_the_option(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(
        """
        import pytest

        KEEP = []

        def test_unmarked_leak(fake_cuda):
            KEEP.append(fake_cuda.tensor(4096))

        @pytest.mark.cuda_leak_check
        def test_bare(fake_cuda):
            KEEP.append(fake_cuda.tensor(4096))

        @pytest.mark.cuda_leak_check()
        def test_called(fake_cuda):
            KEEP.append(fake_cuda.tensor(4096))

        @pytest.mark.cuda_leak_check(4096)
        def test_positional_tolerance(fake_cuda):
            KEEP.append(fake_cuda.tensor(4096))

        @pytest.mark.cuda_leak_check(tolerance="4KiB")
        def test_size_tolerance(fake_cuda):
            KEEP.append(fake_cuda.tensor(4097))

        @pytest.mark.cuda_leak_check(mode="warn")
        def test_warn(fake_cuda):
            KEEP.append(fake_cuda.tensor(8192))

        @pytest.mark.cuda_leak_check
        class TestClass:
            def test_in_class(self, fake_cuda):
                KEEP.append(fake_cuda.tensor(512))
        """
    )
    result = pytester.runpytest("-rw")
    assert result.parseoutcomes() == {"passed": 7, "leaked": 4, "warnings": 1}
    result.stdout.fnmatch_lines_random(
        [
            "LEAKED test_planted.py::test_bare - 4.0 KiB on cuda:0, allocated at "
            "test_planted.py:10 in test_bare, held by test_planted.KEEP[1] (module global)",
            "LEAKED *::test_called - 4.0 KiB on cuda:0, allocated at *:14 in test_called, *",
            "LEAKED *::test_size_tolerance - 4.5 KiB on cuda:0, allocated at *:22 in *",
            "LEAKED test_planted.py::TestClass::test_in_class - 512 B on cuda:0, allocated at "
            "test_planted.py:31 in "
            "test_in_class, held by test_planted.KEEP[6] (module global)",
            "WARNED test_planted.py::test_warn - 8.0 KiB on cuda:0, allocated at "
            "test_planted.py:26 in test_warn, held by test_planted.KEEP[5] (module global)",
            "*test_planted.py:24: CudaLeakWarning: CUDA memory leak: test_warn left 8.0 KiB on "
            "cuda:0 allocated (tolerance 0 B), allocated at test_planted.py:26 in test_warn*",
        ]
    )
    result.stdout.no_fnmatch_line("*test_unmarked_leak*")
    result.stdout.no_fnmatch_line("*test_positional_tolerance*")


def test_the_marker_overrides_the_option_and_off_skips_the_check(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(
        """
        import pytest

        pytestmark = pytest.mark.cuda_leak_check(tolerance=1024)
        KEEP = []

        def test_module_tolerance(fake_cuda):
            KEEP.append(fake_cuda.tensor(1000))

        @pytest.mark.cuda_leak_check(mode="off")
        def test_caches_on_purpose(fake_cuda):
            KEEP.append(fake_cuda.tensor(1 << 20))

        def test_over_module_tolerance(fake_cuda):
            KEEP.append(fake_cuda.tensor(2048))
        """
    )
    result = pytester.runpytest("--cuda-leak-check")
    assert result.parseoutcomes() == {"passed": 3, "leaked": 1}
    result.stdout.fnmatch_lines(
        [
            "LEAKED test_planted.py::test_over_module_tolerance - 2.0 KiB on cuda:0, allocated at "
            "test_planted.py:14 in test_over_module_tolerance, held by test_planted.KEEP[2] "
            "(module global)"
        ]
    )


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        (
            "cuda_leak_check(tolerance=-1)",
            "cuda_leak_check: tolerance must be a size in bytes >= 0 (an int or a string "
            'such as "4KiB"), got -1*',
        ),
        (
            "cuda_leak_check(mode='loud')",
            "cuda_leak_check: mode must be one of 'fail', 'warn', 'off', got 'loud'",
        ),
        ("cuda_leak_check(tol=3)", "cuda_leak_check() got an unexpected keyword argument 'tol'"),
        ("cuda_leak_check(0, 'fail', 3)", "*takes from 0 to 2 positional arguments*"),
    ],
)
def test_a_malformed_marker_is_an_error_naming_the_test(
    pytester: pytest.Pytester, planted: Callable[[str], None], marker: str, message: str
) -> None:
    planted(
        f"""
        import pytest

        @pytest.mark.{marker}
        def test_bad(fake_cuda):
            pass

        def test_fine():
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*_ ERROR at setup of test_bad _*",
            f"malformed @pytest.mark.cuda_leak_check on test_planted.py::test_bad: {message}",
            "ERROR test_planted.py::test_bad - Failed: malformed @pytest.mark.cuda_leak_*",
        ]
    )


# ---------------------------------------------------------------------------
# What is not a leak.


def test_memory_libraries_keep_by_design_is_not_a_leak(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(
        """
        CACHE = {}

        def test_first_matmul(fake_cuda):
            fake_cuda.matmul()

        def test_fft(fake_cuda):
            fake_cuda.fft()

        def test_first_compile(fake_cuda):
            fake_cuda.compile()

        def test_freed_on_another_stream(fake_cuda):
            fake_cuda.free_on_another_stream(fake_cuda.tensor(1 << 20))

        def test_garbage_cycle(fake_cuda):
            cycle = [fake_cuda.tensor(4096)]
            cycle.append(cycle)

        def test_module_cache_then_deleted(fake_cuda):
            CACHE["x"] = fake_cuda.tensor(1 << 20)
            del CACHE["x"]
        """
    )
    # The stand-in's compiled graph holds memory until torch._dynamo.reset(), which
    # the check calls only when asked (a real first torch.compile call keeps none).
    result = pytester.runpytest("--cuda-leak-check", "-v")
    assert result.parseoutcomes() == {"passed": 6, "leaked": 1}
    result.stdout.fnmatch_lines(
        [
            "LEAKED test_planted.py::test_first_compile - 4.0 KiB on cuda:0, allocated at"
            " test_planted.py:10 in test_first_compile, held by conftest.FAKE.compiled[0]"
            " (module global)"
        ]
    )
    result = pytester.runpytest("--cuda-leak-check", "--cuda-leak-reset-caches", "-v")
    assert result.parseoutcomes() == {"passed": 6}
    result.stdout.fnmatch_lines_random(
        [
            "*- CUDA memory released before judging (kept by design, not leaks) -*",
            "test_planted.py::test_first_matmul - cuBLAS/cuBLASLt workspaces: 32.0 MiB on cuda:0",
            "test_planted.py::test_fft - cuFFT plan caches: 2.0 MiB on cuda:0",
            "test_planted.py::test_first_compile - torch.compile caches (torch._dynamo.reset,"
            " --cuda-leak-reset-caches): 4.0 KiB on cuda:0",
            "test_planted.py::test_freed_on_another_stream - blocks freed on other streams"
            " (synchronize, empty_cache): 1.0 MiB on cuda:0",
            "test_planted.py::test_garbage_cycle - young garbage (gc generation 1): 4.0 KiB on"
            " cuda:0",
        ]
    )


def test_fixtures_memory_is_the_fixtures(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(
        """
        import pytest

        @pytest.fixture
        def buffer(fake_cuda):
            yield fake_cuda.tensor(1 << 20)

        @pytest.fixture
        def model(fake_cuda):
            class Model:
                weight = fake_cuda.tensor(1 << 20)
                grads = []
            return Model()

        @pytest.fixture(scope="module")
        def shared(fake_cuda):
            return fake_cuda.tensor(16 << 20)

        def test_uses_a_buffer(buffer):
            assert buffer.size == 1 << 20

        def test_gradients_live_on_the_fixture(model, fake_cuda):
            model.grads.append(fake_cuda.tensor(1 << 20))

        def test_sets_up_a_module_fixture(shared, buffer):
            pass

        def test_asks_for_a_module_fixture_late(request, fake_cuda):
            request.getfixturevalue("late")

        @pytest.fixture(scope="module")
        def late(fake_cuda):
            return fake_cuda.tensor(4 << 20)
        """
    )
    result = pytester.runpytest("--cuda-leak-check")
    assert result.parseoutcomes() == {"passed": 4}


def test_a_leak_in_the_last_test_of_a_module_fixture_is_still_caught(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(
        """
        import pytest

        KEEP = []

        @pytest.fixture(scope="module")
        def model(fake_cuda):
            yield fake_cuda.tensor(64 << 20)

        def test_uses_model(model):
            pass

        def test_last_user_leaks(model, fake_cuda):
            KEEP.append(fake_cuda.tensor(4096))

        def test_after():
            pass
        """
    )
    result = pytester.runpytest("--cuda-leak-check")
    assert result.parseoutcomes() == {"passed": 3, "leaked": 1}
    result.stdout.fnmatch_lines(["LEAKED *::test_last_user_leaks - 4.0 KiB on cuda:0, allocated *"])


def test_a_fixture_that_leaks_is_charged_to_the_test(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(
        """
        import pytest

        KEEP = []

        @pytest.fixture
        def leaky(fake_cuda):
            KEEP.append(fake_cuda.tensor(4096))

        def test_with_leaky_fixture(leaky):
            pass
        """
    )
    result = pytester.runpytest("--cuda-leak-check")
    result.stdout.fnmatch_lines(
        ["LEAKED *::test_with_leaky_fixture - 4.0 KiB on cuda:0, allocated at *in leaky*"]
    )


# ---------------------------------------------------------------------------
# Failing tests are checked too.


def test_a_failing_test_is_checked_and_both_problems_reported(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(
        """
        KEEP = []

        def test_fails_and_leaks(fake_cuda):
            local = fake_cuda.tensor(1 << 20)
            KEEP.append(fake_cuda.tensor(4096))
            assert 1 == 2

        def test_fails_holding_locals(fake_cuda):
            local = fake_cuda.tensor(64 << 20)
            assert local.size == 0
        """
    )
    result = pytester.runpytest("--cuda-leak-check", "-rf")
    assert result.parseoutcomes() == {"failed": 2, "leaked": 1}
    result.stdout.fnmatch_lines_random(
        [
            "FAILED test_planted.py::test_fails_and_leaks - assert 1 == 2",
            "FAILED test_planted.py::test_fails_holding_locals - assert *",
            "LEAKED test_planted.py::test_fails_and_leaks - 4.0 KiB on cuda:0, allocated at "
            "test_planted.py:5 in test_fails_and_leaks, held by test_planted.KEEP[0] (module "
            "global)",
        ]
    )
    result.stdout.no_fnmatch_line("LEAKED *test_fails_holding_locals*")


def test_a_fixture_teardown_error_and_a_leak_are_both_reported(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(
        """
        import pytest

        KEEP = []

        @pytest.fixture
        def broken():
            yield
            raise RuntimeError("teardown broke")

        def test_leaks(broken, fake_cuda):
            KEEP.append(fake_cuda.tensor(512))
        """
    )
    result = pytester.runpytest("--cuda-leak-check")
    assert result.parseoutcomes() == {"passed": 1, "errors": 1}
    result.stdout.fnmatch_lines_random(
        [
            "*RuntimeError: teardown broke",
            "LEAKED test_planted.py::test_leaks - 512 B on cuda:0, allocated at *",
        ]
    )


# ---------------------------------------------------------------------------
# no_cuda_leak inside a test.


def test_no_cuda_leak_as_import_and_as_fixture(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(
        """
        from pytest_cuda import no_cuda_leak as imported

        KEEP = []

        def test_imported(fake_cuda):
            with imported():
                KEEP.append(fake_cuda.tensor(4096))

        def test_fixture(no_cuda_leak, fake_cuda):
            with no_cuda_leak(tolerance="8KiB"):
                KEEP.append(fake_cuda.tensor(4096))
            with no_cuda_leak():
                x = fake_cuda.tensor(4096)
                del x
        """
    )
    result = pytester.runpytest("-rf")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            ">       with imported():",
            "E       pytest_cuda.CudaLeakError: CUDA memory leak: the block at "
            "test_planted.py:6 left 4.0 KiB on cuda:0 allocated (tolerance 0 B), allocated "
            "at test_planted.py:7 in test_imported, held by test_planted.KEEP[0] (module global)",
        ]
    )


# ---------------------------------------------------------------------------
# Peaks.


def test_memory_report_lists_the_largest_peaks(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(
        """
        def test_small(fake_cuda):
            x = fake_cuda.tensor(1 << 20)

        def test_big(fake_cuda):
            x = fake_cuda.tensor(256 << 20)
            y = fake_cuda.tensor(256 << 20)

        def test_medium(fake_cuda):
            x = fake_cuda.tensor(8 << 20)

        def test_no_cuda():
            pass
        """
    )
    result = pytester.runpytest("--cuda-memory-report=2")
    assert result.parseoutcomes() == {"passed": 4}
    result.stdout.fnmatch_lines(
        [
            "*= CUDA memory: the 2 largest peaks =*",
            "512.0 MiB  cuda:0  test_planted.py::test_big (+512.0 MiB over its start)",
            "  8.0 MiB  cuda:0  test_planted.py::test_medium (+8.0 MiB over its start)",
        ]
    )
    result.stdout.no_fnmatch_line("*test_small (+*")


# ---------------------------------------------------------------------------
# xdist: workers check, the controller reports.


def test_under_xdist_the_controller_reports_what_workers_found(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    pytest.importorskip("xdist")
    planted(LEAKS)
    result = pytester.runpytest_subprocess(
        "-n", "2", "--cuda-leak-check", "--cuda-leak-trace", "--cuda-memory-report=1"
    )
    assert result.parseoutcomes() == {"passed": 4, "leaked": 2}
    result.stdout.fnmatch_lines_random(
        [
            "LEAKED test_planted.py::test_leak_small - 512 B on cuda:0, allocated at "
            "test_planted.py:8 in test_leak_small, held by test_planted.KEEP[0] (module global)",
            "LEAKED test_planted.py::test_leak_large - 8.0 MiB on cuda:0, allocated at "
            "test_planted.py:11 in test_leak_large, held by test_planted.KEEP*(module global)",
            "*8.0 MiB  cuda:0  test_planted.py::test_leak_large (+8.0 MiB over its start)",
        ]
    )


# ---------------------------------------------------------------------------
# The command-line surface is the entry point's.


def test_options_and_markers_stay_known_when_a_mode_is_switched_off(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.cuda_leak_check(tolerance="4KiB")
        @pytest.mark.cuda_sync
        def test_marked():
            pass
        """
    )
    off = ("-p", "no:pytest_cuda.leak_plugin", "-p", "no:pytest_cuda.sync_plugin")
    result = pytester.runpytest_subprocess("--strict-markers", *off)
    result.assert_outcomes(passed=1)
    markers = pytester.runpytest_subprocess("--markers", *off)
    markers.stdout.fnmatch_lines(["@pytest.mark.cuda_leak_check(*", "@pytest.mark.cuda_no_sync*"])


# ---------------------------------------------------------------------------
# --cuda-leak-reruns: the leaking test is also re-run alone in a fresh process.

RERUN = """
KEEP = []
SEEN = []

def test_leaks(fake_cuda):
    KEEP.append(fake_cuda.tensor(4096))

def test_leaks_only_after_another(fake_cuda):
    SEEN.append(1)
    if len(SEEN) > 1 or KEEP:
        KEEP.append(fake_cuda.tensor(512))
"""


def test_a_leak_is_re_run_alone_on_request_to_tell_whether_it_needs_the_tests_before(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(RERUN)
    result = pytester.runpytest("--cuda-leak-check", "--cuda-leak-reruns=2")
    assert result.parseoutcomes() == {"passed": 2, "leaked": 2}
    result.stdout.fnmatch_lines(
        [
            "test_leaks left 4.0 KiB (4,096 B) allocated on cuda:0; tolerance 0 B.",
            "*",
            "  4.0 KiB (1 tensor) on cuda:0: test_planted.KEEP[0] (module global)",
            "Re-run alone in a fresh process:",
            "  test_leaks left 4.0 KiB (4,096 B) allocated on cuda:0; tolerance 0 B.",
            "*",
            "  Blocks still alive, by allocating stack (largest first):",
            "    4.0 KiB in 1 block on cuda:0",
            "      test_planted.py:5 in test_leaks",
            "  Who holds them (the reference path from a root, largest first):",
            "    4.0 KiB (1 tensor) on cuda:0: test_planted.KEEP[0] (module global)",
        ]
    )
    # A leak that needs the tests before it does not show alone: said so.
    result.stdout.fnmatch_lines(
        [
            "Re-run alone in a fresh process: no leak there: the leak depends on the tests "
            "that ran before it",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "LEAKED test_planted.py::test_leaks - 4.0 KiB on cuda:0, allocated at "
            "test_planted.py:5 in test_leaks, held by test_planted.KEEP[0] (module global)",
            "LEAKED test_planted.py::test_leaks_only_after_another - 512 B on cuda:0, allocated "
            "at test_planted.py:10 in test_leaks_only_after_another, held by "
            "test_planted.KEEP[1] (module global)",
        ]
    )


def test_the_re_run_keeps_the_users_options(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(RERUN)
    # The user's own tolerance (an ini override on the command line) reaches the child:
    # its report says 1.0 KiB, where a child with default options would say 0 B.
    result = pytester.runpytest(
        "--cuda-leak-check", "--cuda-leak-reruns=1", "-o", "cuda_leak_tolerance=1KiB"
    )
    assert result.parseoutcomes() == {"passed": 2, "leaked": 1}
    result.stdout.fnmatch_lines(
        [
            "Re-run alone in a fresh process:",
            "  test_leaks left 4.0 KiB (4,096 B) allocated on cuda:0; tolerance 1.0 KiB.",
        ]
    )


def test_a_re_run_needs_no_other_mode(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    # The child that runs one test is pytest_cuda's own (pytest_cuda.child), not a mode's.
    planted(RERUN)
    result = pytester.runpytest(
        "--cuda-leak-check", "--cuda-leak-reruns=1", "-p", "no:pytest_cuda.sync_plugin"
    )
    assert result.parseoutcomes() == {"passed": 2, "leaked": 2}
    result.stdout.fnmatch_lines(
        [
            "Re-run alone in a fresh process:",
            "  test_leaks left 4.0 KiB (4,096 B) allocated on cuda:0; tolerance 0 B.",
        ]
    )


def test_re_runs_stop_at_their_number(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(RERUN)
    result = pytester.runpytest("--cuda-leak-check", "--cuda-leak-reruns=0")
    result.stdout.no_fnmatch_line("*Re-run alone*")
    result.stdout.fnmatch_lines(["LEAKED test_planted.py::test_leaks - 4.0 KiB on cuda:0, *"])
    result = pytester.runpytest("--cuda-leak-check", "--cuda-leak-reruns=-1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*error: argument --cuda-leak-reruns: takes a number of tests, 0 or more; got '-1'"]
    )


LIBRARY_CACHE = """
import sys
import types

# An installed library (its file in site-packages) with a by-design cache, as
# torch.compile keeps compiled graphs' constants.
planted_lib = types.ModuleType("planted_lib")
planted_lib.__file__ = "/usr/lib/python3/site-packages/planted_lib/__init__.py"
planted_lib.CACHE = []
sys.modules["planted_lib"] = planted_lib

def test_fills_a_library_cache(fake_cuda):
    planted_lib.CACHE.append(fake_cuda.tensor(4096))
"""


def test_growth_only_a_library_cache_holds_is_kept_by_design(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(LIBRARY_CACHE)
    result = pytester.runpytest("--cuda-leak-check", "--cuda-leak-trace", "-v")
    assert result.parseoutcomes() == {"passed": 1}
    result.stdout.fnmatch_lines(
        [
            "*- CUDA memory released before judging (kept by design, not leaks) -*",
            "test_planted.py::test_fills_a_library_cache - held by a library cache: "
            "planted_lib.CACHE[0]: 4.0 KiB on cuda:0",
        ]
    )
    # The default check finds the same holder, and re-runs nothing that a library keeps.
    result = pytester.runpytest("--cuda-leak-check", "--cuda-leak-reruns=1", "-v")
    assert result.parseoutcomes() == {"passed": 1}
    result.stdout.fnmatch_lines(
        [
            "test_planted.py::test_fills_a_library_cache - held by a library cache: "
            "planted_lib.CACHE[0]: 4.0 KiB on cuda:0",
        ]
    )
    result.stdout.no_fnmatch_line("*Re-run alone*")
