"""pytest_cuda's settings through real runs: one object built from the command line, the
environment and the ini file (in that order), bad values refused as they are read, the
options of a switched-off mode refused, and the ``--cuda-leak-report`` file checked
before any test runs and never claimed when it was not written."""

from __future__ import annotations

import fnmatch
import json
from typing import TYPE_CHECKING

import pytest

from pytest_cuda.options import MODE_OPTIONS
from pytest_cuda.settings import settings_of

if TYPE_CHECKING:
    from collections.abc import Callable


def _error_lines(result: pytest.RunResult) -> list[str]:
    """What a refused run said about the refusal: its error lines, without pytest's
    usage banner and the lines that say where the ini file is."""
    return [
        line
        for line in result.stderr.lines
        if line.strip() and not line.startswith(("ERROR: usage:", "  inifile:", "  rootdir:"))
    ]


def _refused(result: pytest.RunResult, message: str) -> None:
    """Exit 4 before any test ran, with ``message`` (a glob) ending its one error line,
    and no traceback."""
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = _error_lines(result)
    assert len(errors) == 1, result.stderr.lines
    assert fnmatch.fnmatchcase(errors[0], f"*{message}"), errors
    assert "Traceback" not in result.stderr.str()
    assert "passed" not in result.stdout.str()


# ---------------------------------------------------------------------------
# One object, one order of precedence.


def test_one_settings_object_per_run_read_everywhere(pytester: pytest.Pytester) -> None:
    config = pytester.parseconfigure("--cuda-leak-trace", "--cuda-memory-report=3")
    settings = settings_of(config)
    assert settings_of(config) is settings
    assert (settings.leak_trace, settings.memory_report, settings.leak_check) == (True, 3, False)
    assert settings.holder_search_s is None  # --cuda-leak-trace lifts the limit
    with pytest.raises(AttributeError):
        settings.leak_check = True  # type: ignore[misc]


def test_devices_take_the_command_line_then_the_environment_then_the_ini_file(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTEST_CUDA_DEVICES", raising=False)
    pytester.makeini("[pytest]\ncuda_devices = 0\n")

    def source(*args: str) -> str | None:
        request = settings_of(pytester.parseconfig(*args)).device_request
        return None if request is None else request.source

    assert source() == "cuda_devices = 0 (ini)"
    monkeypatch.setenv("PYTEST_CUDA_DEVICES", "1")
    assert source() == "PYTEST_CUDA_DEVICES=1"
    assert source("--cuda-devices=2") == "--cuda-devices=2"
    # An empty variable is no value: the ini file's is taken.
    monkeypatch.setenv("PYTEST_CUDA_DEVICES", " ")
    assert source() == "cuda_devices = 0 (ini)"


def test_a_value_that_loses_is_not_even_read(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makeini("[pytest]\ncuda_devices = bad\n")
    monkeypatch.setenv("PYTEST_CUDA_DEVICES", "also bad")
    request = settings_of(pytester.parseconfig("--cuda-devices=all")).device_request
    assert request is not None
    assert request.indices is None


def test_the_settings_are_built_in_every_xdist_worker(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    pytester.makeini("[pytest]\ncuda_leak_tolerance = 4KiB\ncuda_leak_holder_search = 2\n")
    pytester.makepyfile(
        """
        import pytest
        from pytest_cuda.settings import settings_of

        @pytest.mark.parametrize("n", range(4))
        def test_worker(request, n):
            settings = settings_of(request.config)
            assert hasattr(request.config, "workerinput")
            assert settings.leak_tolerance == 4096
            assert settings.holder_search_s == 2.0
            assert settings.memory_report == 2
            assert not settings.xdist_controller
        """
    )
    result = pytester.runpytest_subprocess("-n", "2", "--cuda-memory-report=2")
    result.assert_outcomes(passed=4)


# ---------------------------------------------------------------------------
# Bad values: refused as they are read, exit 4, one line.


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cuda-devices=0,x"], "argument --cuda-devices: 'x' is not a device index; use "
         "indices into the visible devices such as 0 or cuda:0, a list such as 0,1 or 'all'"),
        (["--cuda-devices-per-worker=0"],
         "argument --cuda-devices-per-worker: takes a number of devices, 1 or more; got '0'"),
        (["--cuda-memory-report=many"],
         "argument --cuda-memory-report: takes a number of tests, 0 or more; got 'many'"),
        (["--cuda-leak-reruns=-2"],
         "argument --cuda-leak-reruns: takes a number of tests, 0 or more; got '-2'"),
        (["--cuda-sync=sometimes"], "argument --cuda-sync: invalid choice: 'sometimes' "
         "(choose from *launch-blocking*, *per-op*)"),  # quoted or not: Python's version
    ],
)  # fmt: skip
def test_a_bad_option_is_refused_as_it_is_parsed(
    pytester: pytest.Pytester, args: list[str], message: str
) -> None:
    pytester.makepyfile("def test_x(): pass")
    _refused(pytester.runpytest(*args), message)


@pytest.mark.parametrize(
    ("ini", "env", "message"),
    [
        ("cuda_devices = one", "",
         "cuda_devices = one (ini): 'one' is not a device index; use indices into the visible "
         "devices such as 0 or cuda:0, a list such as 0,1 or 'all'"),
        ("", "0,0", "PYTEST_CUDA_DEVICES=0,0: cuda:0 is listed twice"),
        ("cuda_leak_tolerance = lots", "",
         "cuda_leak_tolerance (ini): tolerance must be a size in bytes >= 0 (an int or a "
         "string such as \"4KiB\"), got 'lots' (not a memory size: 'lots'; use bytes or a "
         "number with a unit such as '512MiB', '40GiB' or '1.5GB')"),
        ("cuda_leak_holder_search = soon", "",
         "cuda_leak_holder_search (ini) takes seconds > 0 (or none for no limit), got 'soon'"),
    ],
)  # fmt: skip
def test_a_bad_environment_or_ini_value_is_a_usage_error_at_configure(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ini: str, env: str, message: str
) -> None:
    # Checked whatever the run does: no leak option, no device test here.
    monkeypatch.setenv("PYTEST_CUDA_DEVICES", env)
    pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile("def test_x(): pass")
    _refused(pytester.runpytest(), message)


# ---------------------------------------------------------------------------
# A mode switched off with -p no: takes its options with it.

GIVEN = {
    "cuda_leak_check": "--cuda-leak-check",
    "cuda_leak_trace": "--cuda-leak-trace",
    "cuda_leak_report": "--cuda-leak-report=leaks.json",
    "cuda_leak_reset_caches": "--cuda-leak-reset-caches",
    "cuda_leak_reruns": "--cuda-leak-reruns=1",
    "cuda_memory_report": "--cuda-memory-report=3",
    "cuda_limit_memory": "--cuda-limit-memory=1024",
    "cuda_oom": "--cuda-oom=skip",
    "cuda_memory_snapshot": "--cuda-memory-snapshot=snaps",
    "cuda_sync": "--cuda-sync=per-op",
    "cuda_on_poison": "--cuda-on-poison=stop",
    "cuda_rerun_blocking": "--cuda-rerun-blocking",
    "cuda_ranks": "--cuda-ranks=env",
    "cuda_rank_logs": "--cuda-rank-logs=logs",
}


@pytest.mark.parametrize(
    ("mode", "dest"),
    [(mode, dest) for mode, options in MODE_OPTIONS.items() for dest, _ in options],
)
def test_an_option_of_a_switched_off_mode_is_a_usage_error(
    pytester: pytest.Pytester, mode: str, dest: str
) -> None:
    pytester.makepyfile("def test_x(): pass")
    given = GIVEN[dest]
    result = pytester.runpytest(given, "-p", f"no:{mode}")
    _refused(result, f"{given} needs {mode}, which -p no:{mode} switched off: drop one of the two")
    assert not (pytester.path / "leaks.json").exists()
    assert not (pytester.path / "snaps").exists()


def test_launch_blocking_with_the_sync_mode_switched_off_is_refused_too(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile("def test_x(): pass")
    mode = "pytest_cuda.sync_plugin"
    result = pytester.runpytest("--cuda-sync=launch-blocking", "-p", f"no:{mode}")
    _refused(
        result,
        f"--cuda-sync=launch-blocking needs {mode}, which -p no:{mode} switched off: "
        "drop one of the two",
    )


def test_every_option_is_the_core_s_or_declared_by_one_mode(pytester: pytest.Pytester) -> None:
    """A new option must say which mode it serves, or it escapes the check above."""
    core = {"--cuda-devices", "--cuda-devices-per-worker", "--cuda-require"}
    declared = [flag for options in MODE_OPTIONS.values() for _, flag in options]
    assert len(declared) == len(set(declared))
    shown = {
        word.split("=")[0].rstrip(",")
        for line in pytester.runpytest("--help").stdout.lines
        for word in line.split()
        if word.startswith("--cuda-")
    }
    assert shown == core | set(declared)
    assert {given.split("=")[0] for given in GIVEN.values()} == set(declared)


def test_the_multi_rank_mode_off_leaves_the_other_modes_options(
    pytester: pytest.Pytester,
) -> None:
    assert MODE_OPTIONS["pytest_cuda.distributed_plugin"] == (
        ("cuda_ranks", "--cuda-ranks"),
        ("cuda_rank_logs", "--cuda-rank-logs"),
    )
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest(
        "--cuda-leak-check", "--cuda-on-poison=stop", "-p", "no:pytest_cuda.distributed_plugin"
    )
    result.assert_outcomes(passed=1)


# ---------------------------------------------------------------------------
# --cuda-leak-report: checked at configure, written atomically, claimed only when written.


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/proc/self/x", "--cuda-leak-report=/proc/self/x: cannot create a file in /proc/self "
         "(No such file or directory)"),
        ("/", "--cuda-leak-report=/: / is a folder; name a file in it"),
        ("missing/leaks.json", "--cuda-leak-report=missing/leaks.json: the folder {here}/missing "
         "does not exist; create it first"),
    ],
)  # fmt: skip
def test_a_report_that_cannot_be_written_stops_the_run_before_any_test(
    pytester: pytest.Pytester, path: str, message: str
) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("--cuda-leak-check", f"--cuda-leak-report={path}")
    _refused(result, message.format(here=pytester.path))
    assert "written to" not in result.stdout.str() + result.stderr.str()
    assert list(pytester.path.glob(".*tmp")) == []


def test_a_report_file_is_written_atomically_and_said_so(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted("def test_clean(fake_cuda):\n    x = fake_cuda.tensor(64)\n    del x\n")
    (pytester.path / "out").mkdir()
    (pytester.path / "out" / "leaks.json").write_text("the previous run's\n")
    result = pytester.runpytest("--cuda-leak-check", "--cuda-leak-report=out/leaks.json")
    assert result.ret == pytest.ExitCode.OK
    document = json.loads((pytester.path / "out" / "leaks.json").read_text())
    assert document["summary"]["checked"] == 1
    assert sorted(p.name for p in (pytester.path / "out").iterdir()) == ["leaks.json"]
    result.stdout.fnmatch_lines(
        ["cuda leak check: 1 test checked, no leak; report written to out/leaks.json"]
    )


def test_a_report_that_fails_at_the_end_is_said_so_and_fails_the_run(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    # The folder was there at configure; a test removes it.
    planted(
        """
        import shutil

        def test_removes_the_folder(fake_cuda):
            shutil.rmtree("out")
        """
    )
    (pytester.path / "out").mkdir()
    result = pytester.runpytest("--cuda-leak-check", "--cuda-leak-report=out/leaks.json")
    assert result.ret == pytest.ExitCode.INTERNAL_ERROR
    result.stdout.fnmatch_lines(
        [
            f"--cuda-leak-report: could not write {pytester.path}/out/leaks.json: *No such "
            "file or directory*; exit status 3",
            "cuda leak check: 1 test checked, no leak",
            "*= 1 passed in *",
        ]
    )
    output = result.stdout.str() + result.stderr.str()
    assert "written to" not in output
    assert "INTERNALERROR" not in output
    assert "Traceback" not in output


def test_a_run_that_failed_keeps_its_exit_status_when_the_report_fails_too(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(
        """
        import shutil

        def test_removes_the_folder_and_fails(fake_cuda):
            shutil.rmtree("out")
            assert False
        """
    )
    (pytester.path / "out").mkdir()
    result = pytester.runpytest("--cuda-leak-check", "--cuda-leak-report=out/leaks.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["--cuda-leak-report: could not write *: *No such file*"])
    result.stdout.no_fnmatch_line("*exit status*")


# ---------------------------------------------------------------------------
# The ini value cuda_leak_check: a default for --cuda-leak-check.

LEAKING = """
KEEP = []

def test_leaks(fake_cuda):
    KEEP.append(fake_cuda.tensor(4096))
"""


@pytest.mark.parametrize(
    ("ini", "args", "checked"),
    [
        ("true", [], True),
        ("false", ["--cuda-leak-check"], True),  # the command line wins
        ("true", ["-o", "cuda_leak_check=false"], False),  # pytest's own override
        ("false", [], False),
    ],
)
def test_the_ini_value_switches_the_leak_check_on(
    pytester: pytest.Pytester,
    planted: Callable[[str], None],
    ini: str,
    args: list[str],
    checked: bool,
) -> None:
    planted(LEAKING)
    pytester.makeini(f"[pytest]\ncuda_leak_check = {ini}\ncuda_leak_holder_search = none\n")
    result = pytester.runpytest(*args)
    if checked:
        assert result.parseoutcomes() == {"passed": 1, "leaked": 1}
        result.stdout.fnmatch_lines(["LEAKED test_planted.py::test_leaks - 4.0 KiB on cuda:0, *"])
    else:
        assert result.parseoutcomes() == {"passed": 1}
        result.stdout.no_fnmatch_line("*cuda leak check*")


# The ini value reaching the xdist workers, and the controller alone writing the report,
# are checked in one xdist run with the report's other facts (each worker imports torch):
# test_leak_verdicts.py::test_under_xdist_one_report_and_junit_properties_cover_every_worker.


def test_the_ini_value_is_switched_off_with_its_mode(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    # A project's ini value is no contradiction of this run's -p no: (a command-line
    # --cuda-leak-check would be).
    planted(LEAKING)
    pytester.makeini("[pytest]\ncuda_leak_check = true\n")
    result = pytester.runpytest("-p", "no:pytest_cuda.leak_plugin")
    assert result.parseoutcomes() == {"passed": 1}


def test_a_bad_ini_leak_check_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ncuda_leak_check = maybe\n")
    pytester.makepyfile("def test_x(): pass")
    _refused(
        pytester.runpytest(),
        "cuda_leak_check (ini) takes true or false: invalid truth value 'maybe'",
    )


def test_the_ini_value_is_in_help(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(["  cuda_leak_check (bool):", "*default for --cuda-leak-check*"])


def test_the_settings_are_built_in_a_pytest_child_from_the_same_sources(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    # A leak's re-run is a pytest child (pytest_cuda.child): the ini file's values reach
    # it (its report says the ini tolerance), and only this session writes the report.
    planted(LEAKING)
    pytester.makeini(
        "[pytest]\ncuda_leak_check = true\ncuda_leak_tolerance = 1KiB\n"
        "cuda_leak_holder_search = none\n"
    )
    result = pytester.runpytest("--cuda-leak-reruns=1", "--cuda-leak-report=leaks.json")
    assert result.parseoutcomes() == {"passed": 1, "leaked": 1}
    result.stdout.fnmatch_lines(
        [
            "Re-run alone in a fresh process:",
            "  test_leaks left 4.0 KiB (4,096 B) allocated on cuda:0; tolerance 1.0 KiB.",
        ]
    )
    assert result.stdout.str().count("report written to leaks.json") == 1
    rows = json.loads((pytester.path / "leaks.json").read_text())["tests"]
    assert [(row["nodeid"], row["tolerance"]) for row in rows] == [
        ("test_planted.py::test_leaks", 1024)
    ]


def test_help_is_shown_whatever_the_ini_file_and_environment_say(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTEST_CUDA_DEVICES", "0,0")
    pytester.makeini("[pytest]\ncuda_leak_check = maybe\ncuda_leak_tolerance = lots\n")
    result = pytester.runpytest("--help")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["  cuda_leak_check (bool):"])
    _refused(pytester.runpytest(), "PYTEST_CUDA_DEVICES=0,0: cuda:0 is listed twice")
