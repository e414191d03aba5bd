"""The debug options through real pytest runs: help, markers, fixtures, bad input,
CUDA_LAUNCH_BLOCKING set early and put back, and what happens without a GPU."""

from __future__ import annotations

import contextlib
import os

import pytest

from fake_cuda import install
from gpumagic import cuda
from gpumagic.devices import CudaStatus

ENV_PROBE_CONFTEST = """
import os

# Imported by pytest after pytest_load_initial_conftests: what a conftest that creates
# a CUDA context at import would see.
AT_IMPORT = os.environ.get("CUDA_LAUNCH_BLOCKING")
"""

ENV_PROBE_TEST = """
import os
import conftest

def test_env():
    in_test = os.environ.get("CUDA_LAUNCH_BLOCKING")
    print("AT-CONFTEST-IMPORT", conftest.AT_IMPORT, "IN-TEST", in_test)
"""


@pytest.fixture
def no_launch_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CUDA_LAUNCH_BLOCKING, and no CUDA context as far as the in-process runs go.

    On the GPU machine an earlier test may have initialised CUDA in this process, which
    launch-blocking would rightly refuse; these runs are about the environment only
    (the refusal has its own tests, in fresh processes).
    """
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    install(monkeypatch, is_initialized=lambda: False)


def test_help_shows_the_options(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(
        [
            "  --cuda-sync={launch-blocking,per-op}",
            "*debug asynchronous CUDA errors. launch-blocking: set*",
            "  --cuda-on-poison={continue,stop,skip}",
            "*after a test leaves a sticky CUDA error*",
            "  --cuda-rerun-blocking*",
        ]
    )
    assert "--cuda-internal" not in result.stdout.str()


def test_markers_are_documented(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.cuda_sync: synchronize after every torch operation of this test*",
            "@pytest.mark.cuda_no_sync: fail the test if its body makes the host wait for the "
            "GPU implicitly*explicit torch.cuda.synchronize() and syncs outside torch are not "
            "seen*",
        ]
    )


def test_fixture_is_documented(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x="def test_x(cuda_no_sync):\n    pass\n")
    result = pytester.runpytest("--fixtures", "-v")
    result.stdout.fnmatch_lines(
        [
            "cuda_no_sync -- *sync/plugin.py:*",
            "    Forbid implicit host-device synchronization in a block: "
            "``with cuda_no_sync(): ...``.",
            "*Not seen: explicit ``torch.cuda.synchronize()``*",
        ]
    )


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (
            "--cuda-sync=sometimes",
            "*argument --cuda-sync: invalid choice: 'sometimes' (choose from "
            "'launch-blocking', 'per-op')",
        ),
        (
            "--cuda-on-poison=retry",
            "*argument --cuda-on-poison: invalid choice: 'retry' (choose from "
            "'continue', 'stop', 'skip')",
        ),
    ],
)
def test_unknown_values_are_usage_errors(
    pytester: pytest.Pytester, option: str, message: str
) -> None:
    result = pytester.runpytest(option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert "Traceback" not in result.stderr.str()


def test_rerun_blocking_with_launch_blocking_is_a_usage_error(
    pytester: pytest.Pytester, no_launch_blocking: None
) -> None:
    result = pytester.runpytest("--cuda-sync=launch-blocking", "--cuda-rerun-blocking")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: --cuda-rerun-blocking re-runs CUDA failures with CUDA_LAUNCH_BLOCKING=1, "
            "which --cuda-sync=launch-blocking already sets for the whole run: use one of them."
        ]
    )
    assert "CUDA_LAUNCH_BLOCKING" not in os.environ


def test_no_header_line_without_options(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest()
    assert "cuda debug" not in result.stdout.str()


def test_header_names_the_modes(pytester: pytest.Pytester, no_launch_blocking: None) -> None:
    result = pytester.runpytest(
        "--cuda-sync=per-op", "--cuda-rerun-blocking", "--cuda-on-poison=skip"
    )
    result.stdout.fnmatch_lines(
        [
            "cuda debug: --cuda-sync=per-op (synchronize after every torch op), "
            "--cuda-on-poison=skip, --cuda-rerun-blocking",
        ]
    )
    result = pytester.runpytest("--cuda-sync=launch-blocking")
    result.stdout.fnmatch_lines(
        ["cuda debug: --cuda-sync=launch-blocking (CUDA_LAUNCH_BLOCKING=1)"]
    )


def test_without_cuda_the_options_are_a_one_line_note(
    pytester: pytest.Pytester, no_launch_blocking: None
) -> None:
    if cuda.status().available:
        pytest.skip("this machine has a GPU")
    pytester.makepyfile(
        test_x="""
        import pytest

        def test_plain():
            pass

        @pytest.mark.cuda_sync
        def test_marked():
            pass

        @pytest.mark.cuda_no_sync
        def test_no_sync():
            pass

        def test_fixture(cuda_no_sync):
            with cuda_no_sync():
                pass
        """
    )
    result = pytester.runpytest("--cuda-sync=per-op", "--cuda-rerun-blocking")
    result.assert_outcomes(passed=4)
    reason = cuda.status().reason
    result.stdout.fnmatch_lines(
        [
            "cuda debug: --cuda-sync=per-op (synchronize after every torch op), "
            "--cuda-rerun-blocking",
            f"cuda debug: these have no effect here: CUDA unavailable: {reason}",
            f"cuda debug: per-op sync did nothing: CUDA unavailable: {reason}",
            f"cuda debug: cuda_no_sync checked nothing: CUDA unavailable: {reason}",
        ]
    )
    assert result.stdout.str().count("cuda_no_sync checked nothing") == 1
    assert "Traceback" not in result.stdout.str()


def test_markers_alone_switch_the_sync_modes_on(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import pytest

        @pytest.hookimpl(trylast=True)
        def pytest_collection_finish(session):
            print("SYNC-MODES", session.config.pluginmanager.has_plugin("cuda.sync-modes"))
        """
    )
    pytester.makepyfile(test_plain="def test_a():\n    pass\n")
    pytester.runpytest("-s").stdout.fnmatch_lines(["*SYNC-MODES False*"])
    pytester.makepyfile(
        test_marked="import pytest\n\n@pytest.mark.cuda_sync\ndef test_b():\n    pass\n"
    )
    pytester.runpytest("-s").stdout.fnmatch_lines(["*SYNC-MODES True*"])


# ---------------------------------------------------------------------------
# --cuda-sync=launch-blocking: the environment


def test_launch_blocking_is_set_before_conftests_and_restored(
    pytester: pytest.Pytester, no_launch_blocking: None
) -> None:
    pytester.makeconftest(ENV_PROBE_CONFTEST)
    pytester.makepyfile(test_env=ENV_PROBE_TEST)
    result = pytester.runpytest("-s", "--cuda-sync=launch-blocking")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*AT-CONFTEST-IMPORT 1 IN-TEST 1*"])
    assert "CUDA_LAUNCH_BLOCKING" not in os.environ


def test_launch_blocking_restores_a_previous_value(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, no_launch_blocking: None
) -> None:
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "0")
    pytester.makeconftest(ENV_PROBE_CONFTEST)
    pytester.makepyfile(test_env=ENV_PROBE_TEST)
    result = pytester.runpytest("-s", "--cuda-sync=launch-blocking")
    result.stdout.fnmatch_lines(["*AT-CONFTEST-IMPORT 1 IN-TEST 1*"])
    assert os.environ["CUDA_LAUNCH_BLOCKING"] == "0"


def test_launch_blocking_is_restored_after_a_usage_error(
    pytester: pytest.Pytester, no_launch_blocking: None
) -> None:
    result = pytester.runpytest("--cuda-sync=launch-blocking", "--no-such-option")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "CUDA_LAUNCH_BLOCKING" not in os.environ


def test_without_the_option_the_environment_is_untouched(
    pytester: pytest.Pytester, no_launch_blocking: None
) -> None:
    pytester.makeconftest(ENV_PROBE_CONFTEST)
    pytester.makepyfile(test_env=ENV_PROBE_TEST)
    result = pytester.runpytest("-s")
    result.stdout.fnmatch_lines(["*AT-CONFTEST-IMPORT None IN-TEST None*"])


def test_launch_blocking_reaches_xdist_workers(
    pytester: pytest.Pytester, no_launch_blocking: None
) -> None:
    pytester.makeconftest(ENV_PROBE_CONFTEST)
    pytester.makepyfile(
        test_env="""
        import os
        import conftest

        def test_env(worker_id):
            assert worker_id.startswith("gw")
            assert conftest.AT_IMPORT == "1"
            assert os.environ["CUDA_LAUNCH_BLOCKING"] == "1"
        """
    )
    result = pytester.runpytest_subprocess("-n", "2", "--cuda-sync=launch-blocking")
    result.assert_outcomes(passed=1)


FAKE_INITIALISED_TORCH = """
import sys, types

# Stands for a plugin that imports torch and creates a CUDA context at import.
torch = types.ModuleType("torch")
torch.cuda = types.SimpleNamespace(is_initialized=lambda: True)
sys.modules["torch"] = torch
"""


def test_launch_blocking_refuses_an_initialised_context(
    pytester: pytest.Pytester, no_launch_blocking: None
) -> None:
    pytester.makepyfile(early_cuda_plugin=FAKE_INITIALISED_TORCH)
    result = pytester.runpytest_subprocess("-p", "early_cuda_plugin", "--cuda-sync=launch-blocking")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: --cuda-sync=launch-blocking: CUDA was initialised in this process before "
            "pytest_cuda could set CUDA_LAUNCH_BLOCKING=1 (a plugin given with -p or installed "
            "with an entry point created a CUDA context when imported), so kernel launches "
            "would stay asynchronous. Set CUDA_LAUNCH_BLOCKING=1 in the environment instead, "
            "or keep that plugin from touching CUDA at import."
        ]
    )
    assert "Traceback" not in result.stderr.str()


def test_an_initialised_context_is_fine_when_the_environment_already_blocks(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    pytester.makepyfile(early_cuda_plugin=FAKE_INITIALISED_TORCH)
    pytester.makepyfile(test_ok="def test_ok():\n    pass\n")
    result = pytester.runpytest_subprocess(
        "-p", "early_cuda_plugin", "--cuda-sync=launch-blocking", "--collect-only", "-q"
    )
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["test_ok.py::test_ok"])


def test_an_implicit_sync_fails_in_one_line(
    monkeypatch: pytest.MonkeyPatch, pytestconfig: pytest.Config
) -> None:
    # torch's error (raised in the block) is replaced by the report, not chained to it.
    from pytest_cuda.sync.modes import no_implicit_sync

    install(
        monkeypatch,
        status=lambda: CudaStatus(True, ""),
        forbid_implicit_sync=contextlib.nullcontext,
    )
    with pytest.raises(pytest.fail.Exception) as caught, no_implicit_sync(pytestconfig):
        raise RuntimeError(cuda.SYNC_WARNING_MESSAGE)
    assert str(caught.value).startswith("cuda_no_sync: implicit host-device synchronization:")
    assert caught.value.__suppress_context__
    assert "During handling" not in str(caught.getrepr(style="value"))


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        ("cuda_no_sync(bogus=1)", "cuda_no_sync on {}: takes no arguments, got bogus=1"),
        ("cuda_sync(1)", "cuda_sync on {}: takes no arguments, got 1"),
        (
            "cuda_sync(True, every='op')",
            "cuda_sync on {}: takes no arguments, got True, every='op'",
        ),
    ],
)
def test_sync_markers_with_arguments_are_errors(
    pytester: pytest.Pytester, marker: str, message: str
) -> None:
    """They took any arguments and ignored them (issue 29); with or without CUDA."""
    pytester.makepyfile(
        test_typo=f"import pytest\n\n@pytest.mark.{marker}\ndef test_a():\n    pass\n\n"
        "@pytest.mark.cuda_sync\ndef test_b():\n    pass\n"
    )
    # -rN: no short summary, which repeats the message (untruncated where $CI is set).
    result = pytester.runpytest("-rN")
    result.assert_outcomes(passed=1, errors=1)
    name = "test_typo.py::test_a"
    result.stdout.fnmatch_lines(
        ["*ERROR at setup of test_a*", "malformed @pytest.mark." + message.format(name)]
    )
    assert "Traceback" not in result.stdout.str()
    # Said once: not the bare reason first, then "During handling of the above...".
    assert "During handling" not in result.stdout.str()
    assert result.stdout.str().count("takes no arguments") == 1
