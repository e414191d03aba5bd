"""The pure parts of poison handling: classifying CUDA errors, repro commands, the
child's command line and the event channel (plain calls, no pytest run)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from gpumagic import cuda_errors
from gpumagic.stacks import FrameFilter
from pytest_cuda import child as pytest_child
from pytest_cuda import repro

TORCH_ASSERT = (
    "CUDA error: device-side assert triggered\n"
    "Search for `cudaErrorAssert' in https://docs.nvidia.com/cuda/cuda-runtime-api/"
    "group__CUDART__TYPES.html for more information.\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\n"
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)


@pytest.mark.parametrize(
    ("message", "text", "name", "sticky"),
    [
        (TORCH_ASSERT, "device-side assert triggered", "cudaErrorAssert", True),
        (
            "CUDA error: an illegal memory access was encountered\nCUDA kernel errors...",
            "an illegal memory access was encountered",
            "cudaErrorIllegalAddress",
            True,
        ),
        (
            "cudaErrorIllegalAddress: an illegal memory access was encountered",
            "an illegal memory access was encountered",
            "cudaErrorIllegalAddress",
            True,
        ),
        (
            "[700] Call to cuCtxSynchronize results in CUDA_ERROR_ILLEGAL_ADDRESS",
            "CUDA_ERROR_ILLEGAL_ADDRESS",
            "CUDA_ERROR_ILLEGAL_ADDRESS",
            True,
        ),
        ("CUDA error: invalid argument", "invalid argument", None, False),
        (
            "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle)`",
            "CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle)`",
            None,
            False,
        ),
        (
            "CUDA error: unspecified launch failure",
            "unspecified launch failure",
            "cudaErrorLaunchFailure",
            True,
        ),
    ],
)
def test_classify_names_cuda_errors(
    message: str, text: str, name: str | None, sticky: bool
) -> None:
    info = cuda_errors.classify(message)
    assert info == cuda_errors.CudaErrorInfo(text=text, name=name, sticky=sticky)


@pytest.mark.parametrize(
    "message",
    [
        "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.19 GiB total capacity)",
        "assert 2 == 3",
        "Expected all tensors to be on the same device, but found cuda:0 and cpu",
        "",
    ],
)
def test_classify_leaves_other_failures_alone(message: str) -> None:
    assert cuda_errors.classify(message) is None


def test_classify_describe() -> None:
    info = cuda_errors.classify(TORCH_ASSERT)
    assert info is not None
    assert info.describe() == "device-side assert triggered (cudaErrorAssert)"
    bare = cuda_errors.classify("CUDA error: invalid argument")
    assert bare is not None
    assert bare.describe() == "invalid argument"


def test_classify_falls_back_to_the_async_hint() -> None:
    info = cuda_errors.classify(
        "RuntimeError: something odd\nCUDA kernel errors might be asynchronously reported"
    )
    assert info == cuda_errors.CudaErrorInfo("RuntimeError: something odd", None, False)


# ---------------------------------------------------------------------------
# repro


def test_repro_command_quotes_the_node_id() -> None:
    command = repro.repro_command("tests/test_x.py::test_y[a b-*]", visible_devices="0,1")
    assert (
        command
        == "CUDA_VISIBLE_DEVICES=0,1 CUDA_LAUNCH_BLOCKING=1 pytest 'tests/test_x.py::test_y[a b-*]'"
    )


def test_repro_command_without_devices_and_with_a_quote() -> None:
    command = repro.repro_command("t.py::test_it[it's]", visible_devices=None)
    assert command == "CUDA_LAUNCH_BLOCKING=1 pytest 't.py::test_it[it'\"'\"'s]'"


def test_repro_command_changes_to_the_rootdir(tmp_path: Path) -> None:
    sub = tmp_path / "sub dir"
    command = repro.repro_command(
        "t.py::test_a", visible_devices="GPU-1a2b", rootdir=sub, cwd=tmp_path
    )
    expected = "CUDA_VISIBLE_DEVICES=GPU-1a2b CUDA_LAUNCH_BLOCKING=1 pytest 't.py::test_a'"
    assert command == f"cd '{sub}' && {expected}"
    same = repro.repro_command("t.py::test_a", visible_devices=None, rootdir=sub, cwd=sub)
    assert same.startswith("CUDA_LAUNCH_BLOCKING=1")


def _raise_from(path: Path, source: str) -> BaseException:
    path.write_text(textwrap.dedent(source))
    namespace: dict[str, object] = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    try:
        namespace["entry"]()  # type: ignore[operator]
    except RuntimeError as error:
        return error
    raise AssertionError("no error")


def test_failure_site_is_the_innermost_user_frame(tmp_path: Path) -> None:
    user = tmp_path / "user_code.py"
    error = _raise_from(
        user,
        """
        def entry():
            x = 1
            helper(x)

        def helper(x):
            raise RuntimeError("CUDA error: device-side assert triggered")
        """,
    )
    site = repro.failure_site(
        error.__traceback__, FrameFilter.default().is_user, relative_to=tmp_path
    )
    assert site == repro.FailureSite(
        "user_code.py",
        7,
        "helper",
        'raise RuntimeError("CUDA error: device-side assert triggered")',
    )
    assert site.describe().startswith("user_code.py:7 in helper: raise RuntimeError(")
    assert repro.FailureSite.from_dict(site.to_dict()) == site


def test_failure_site_skips_library_and_hidden_frames(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "library.py").write_text(
        textwrap.dedent(
            """
            def op():
                raise RuntimeError("CUDA error: misaligned address")

            def hidden():
                __tracebackhide__ = True
                op()
            """
        )
    )
    sys.path.insert(0, str(lib))
    try:
        error = _raise_from(
            tmp_path / "caller.py",
            """
            import library

            def entry():
                library.hidden()
            """,
        )
    finally:
        sys.path.remove(str(lib))
        sys.modules.pop("library", None)
    site = repro.failure_site(error.__traceback__, FrameFilter.default([str(lib)]).is_user)
    assert site is not None
    assert (Path(site.path).name, site.lineno, site.function) == ("caller.py", 5, "entry")
    assert site.source == "library.hidden()"
    assert repro.failure_site(None) is None


def test_failure_site_from_bad_data() -> None:
    assert repro.FailureSite.from_dict(None) is None
    assert repro.FailureSite.from_dict({"path": "x"}) is None
    assert (
        repro.FailureSite.from_dict({"path": "x", "lineno": "nan", "function": "f", "source": ""})
        is None
    )


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        (
            "aten._local_scalar_dense.default",
            "Tensor.item() (also int(), float() of a CUDA tensor) "
            "[aten._local_scalar_dense.default]",
        ),
        (
            "aten.nonzero.default",
            "nonzero() (its output size depends on the data) [aten.nonzero.default]",
        ),
        (
            "aten._to_copy.default",
            "a copy to the host (.cpu(), .to('cpu'), .numpy(), .tolist()) [aten._to_copy.default]",
        ),
        (
            "aten.is_nonzero.default",
            "bool() of a CUDA tensor (an if or assert on a tensor) [aten.is_nonzero.default]",
        ),
        ("mylib.custom_op.default", "mylib.custom_op.default"),
        (None, "a synchronizing CUDA operation"),
    ],
)
def test_describe_sync_op(op: str | None, expected: str) -> None:
    assert repro.describe_sync_op(op) == expected


# ---------------------------------------------------------------------------
# The child's command line and the channel


def test_child_argv_keeps_the_session_args_and_isolates_the_child(tmp_path: Path) -> None:
    argv = pytest_child.child_argv(
        ["-q", "tests", "--junitxml=out.xml"],
        tmp_path,
        python="/py",
        no_xdist=True,
        junitxml=True,
        extra=("--cuda-internal-resume=X",),
    )
    assert argv == [
        "/py", "-m", "pytest", "-q", "tests", "--junitxml=out.xml",
        f"--basetemp={tmp_path / 'basetemp'}",
        "-o", f"cache_dir={tmp_path / 'cache'}",
        "-n", "0", "--dist", "no",
        f"--junitxml={tmp_path / 'junit.xml'}",
        "--cuda-internal-resume=X",
    ]  # fmt: skip


def test_child_argv_without_cacheprovider_or_xdist(tmp_path: Path) -> None:
    argv = pytest_child.child_argv(["-p", "no:cacheprovider"], tmp_path, python="/py", cache=False)
    assert argv == [
        "/py",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        f"--basetemp={tmp_path / 'basetemp'}",
    ]


def test_nodeids_round_trip(tmp_path: Path) -> None:
    ids = ["t.py::test_a[x y]", "t.py::test_b['q']", "dir/t.py::C::test_c"]
    pytest_child.write_nodeids(tmp_path, iter(ids))
    assert pytest_child.read_nodeids(tmp_path) == ids


def test_child_run_relays_events_in_order(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            sys.path[:0] = {sys.path!r}
            from pathlib import Path
            from pytest_cuda.child import EventWriter
            writer = EventWriter(Path({str(tmp_path)!r}))
            for i in range(3):
                writer.write("step", index=i, path=Path("/x"))
                time.sleep(0.05)
            print("child says bye")
            writer.close()
            sys.exit(7)
            """
        )
    )
    child = pytest_child.ChildRun(
        [sys.executable, str(script)], tmp_path, cwd=tmp_path, env=os.environ
    )
    events = []
    while (event := child.next_event()) is not None:
        events.append(event)
    assert events == [{"event": "step", "index": i, "path": "/x"} for i in range(3)]
    assert child.wait() == 7
    assert child.returncode == 7
    assert child.output_tail() == "child says bye"
    child.stop()


def test_child_run_reads_a_line_written_in_two_parts(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import time
            with open({str(tmp_path / pytest_child.EVENTS_FILE)!r}, "a") as f:
                f.write('{{"event": "ha'); f.flush(); time.sleep(0.2)
                f.write('lf"}}\\n{{"event": "cut sh')
            """
        )
    )
    child = pytest_child.ChildRun(
        [sys.executable, str(script)], tmp_path, cwd=tmp_path, env=os.environ
    )
    assert child.next_event() == {"event": "half"}
    # A line the child did not finish (it died while writing) is not an event.
    assert child.next_event() is None
    child.stop()


def test_child_run_stop_ends_a_running_child(tmp_path: Path) -> None:
    child = pytest_child.ChildRun(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        tmp_path,
        cwd=tmp_path,
        env=os.environ,
    )
    child.stop(timeout=5)
    assert child.returncode is not None


def test_workdirs_are_numbered_and_removed() -> None:
    workdirs = pytest_child.Workdirs()
    first, second = workdirs.new("continue"), workdirs.new("rerun")
    assert first.name == "continue-1"
    assert second.name == "rerun-2"
    assert first.parent == second.parent
    assert first.parent.name.startswith("pytest-cuda-")
    workdirs.remove()
    assert not first.parent.exists()
    workdirs.remove()


def test_child_env_drops_the_current_test(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOME_SETTING", "1")
    env = pytest_child.child_env({"CUDA_LAUNCH_BLOCKING": "1"})
    assert env["SOME_SETTING"] == "1"
    assert env["CUDA_LAUNCH_BLOCKING"] == "1"
    assert "PYTEST_CURRENT_TEST" not in env
    assert json.dumps(env)
