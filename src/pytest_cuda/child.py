"""A pytest child of this session: a fresh process that runs some of its tests.

Three modes start one: the poison continuation (the tests after a culprit, in a process
whose CUDA context is whole), ``--cuda-rerun-blocking`` (a failed test again with
``CUDA_LAUNCH_BLOCKING=1``) and ``--cuda-leak-reruns`` (a leaking test alone). All three
keep the user's command line (its options, ini overrides and plugins), so the child
collects and configures as this session did, narrowed to the tests it is given
(:data:`NARROW_OPTION`: :class:`ResumedRun`, registered by pytest_cuda's own plugin
whichever modes are on), with a ``--basetemp`` and a cache of its own, without xdist.
Its results come back through a file of events (:class:`EventWriter` on its side,
:class:`ChildRun` here). The modes share this module, and name neither each other nor
each other's plugins.

No torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import warnings
    from collections.abc import Generator, Iterable, Mapping, Sequence

__all__ = [
    "NARROW_OPTION",
    "ChildRun",
    "EventWriter",
    "ResumedRun",
    "Workdirs",
    "child_argv",
    "child_argv_for",
    "child_env",
    "read_nodeids",
    "run_as_child",
    "write_nodeids",
]

#: The hidden option that makes a pytest process a child: it runs the test ids its
#: parent wrote to the work directory the option names (:func:`write_nodeids`).
NARROW_OPTION = "--cuda-internal-resume"
NODEIDS_FILE = "nodeids.json"


def child_argv_for(config: pytest.Config, workdir: Path, extra: tuple[str, ...]) -> list[str]:
    """The command line of a child that runs the tests of this session written to
    ``workdir`` (:func:`write_nodeids`), with the options in ``extra``."""
    manager = config.pluginmanager
    return child_argv(
        config.invocation_params.args,
        workdir,
        no_xdist=manager.has_plugin("xdist"),
        cache=manager.has_plugin("cacheprovider"),
        junitxml=bool(getattr(config.option, "xmlpath", None)),
        extra=(f"{NARROW_OPTION}={workdir}", *extra),
    )


# ---------------------------------------------------------------------------
# The fresh process: its command line, and the test ids it runs.


def child_argv(
    args: Sequence[str],
    workdir: Path,
    *,
    python: str = sys.executable,
    no_xdist: bool = False,
    cache: bool = True,
    junitxml: bool = False,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line of a pytest process that runs some of this session's tests.

    ``args`` are this session's own (``config.invocation_params.args``), so the child
    collects the same way; the internal option in ``extra`` then narrows the run to the
    test ids in ``workdir``. The child gets its own ``--basetemp`` (pytest would
    otherwise clear or prune the parent's) and cache directory, runs without xdist,
    and writes any JUnit XML of its own aside: the parent's report holds every result.
    """
    argv = [python, "-m", "pytest", *args]
    argv.append(f"--basetemp={workdir / 'basetemp'}")
    if cache:
        argv += ["-o", f"cache_dir={workdir / 'cache'}"]
    if no_xdist:
        argv += ["-n", "0", "--dist", "no"]
    if junitxml:
        argv.append(f"--junitxml={workdir / 'junit.xml'}")
    argv += list(extra)
    return argv


def write_nodeids(workdir: Path, nodeids: Iterable[str]) -> None:
    """The test ids a child runs, in order (a file: a long list fits no command line)."""
    (workdir / NODEIDS_FILE).write_text(json.dumps(list(nodeids)))


def read_nodeids(workdir: Path) -> list[str]:
    ids = json.loads((workdir / NODEIDS_FILE).read_text())
    return [str(nodeid) for nodeid in ids]


# ---------------------------------------------------------------------------
# The channel: the child appends one JSON object per line; the parent tails the file.

EVENTS_FILE = "events.jsonl"
OUTPUT_FILE = "output.log"


class EventWriter:
    """The child's end: one JSON object per line, flushed at once."""

    def __init__(self, workdir: Path) -> None:
        self._file = (workdir / EVENTS_FILE).open("a", encoding="utf-8")

    def write(self, event: str, **fields: Any) -> None:
        self._file.write(json.dumps({"event": event, **fields}, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class ChildRun:
    """A pytest process started for some of this session's tests, and its events.

    Its own terminal output goes to ``output.log`` in its work directory, so the
    parent's report stays one report; :meth:`output_tail` shows it when it fails.
    """

    def __init__(self, argv: Sequence[str], workdir: Path, *, cwd: Path, env: Mapping[str, str]):
        self.argv = list(argv)
        self.workdir = workdir
        events = workdir / EVENTS_FILE
        events.touch()
        self._events = events.open("rb")
        self._buffer = b""
        with (workdir / OUTPUT_FILE).open("wb") as output:
            self.process = subprocess.Popen(
                self.argv,
                cwd=cwd,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
            )

    def next_event(self) -> dict[str, Any] | None:
        """The next event; blocks while the child runs. ``None`` once it has ended
        and every event it wrote has been read."""
        delay = 0.0005
        while True:
            line = self._read_line()
            if line is not None:
                event: dict[str, Any] = json.loads(line)
                return event
            if self.process.poll() is not None:
                # What it wrote just before it ended; a line it did not finish is dropped.
                line = self._read_line()
                return None if line is None else dict(json.loads(line))
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _read_line(self) -> bytes | None:
        while b"\n" not in self._buffer:
            chunk = self._events.read()
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def output_tail(self, lines: int = 25) -> str:
        """The last lines of the child's own terminal output."""
        try:
            text = (self.workdir / OUTPUT_FILE).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def wait(self) -> int:
        return self.process.wait()

    def stop(self, timeout: float = 5.0) -> None:
        """End the child if it still runs (the parent session is ending early)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._events.close()


class Workdirs:
    """Numbered work directories under one temporary directory, removed at the end."""

    def __init__(self) -> None:
        self._root: Path | None = None
        self._count = 0

    def new(self, label: str) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="pytest-cuda-"))
        self._count += 1
        path = self._root / f"{label}-{self._count}"
        path.mkdir(mode=0o700)
        return path

    def discard(self, path: Path) -> None:
        """Remove one work directory once its child is done."""
        shutil.rmtree(path, ignore_errors=True)

    def remove(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child, with ``extra`` on top."""
    env = dict(os.environ)
    env.update(extra or {})
    # pytest sets it for the test that is running here; the child sets its own.
    with contextlib.suppress(KeyError):
        del env["PYTEST_CURRENT_TEST"]
    return env


# ---------------------------------------------------------------------------
# The child's side: run the parent's tests, write their events.


def run_as_child(config: pytest.Config, workdir: Path) -> None:
    """Make this process a child (:data:`NARROW_OPTION`): it runs the test ids its
    parent wrote to ``workdir``, in their order, and writes their events there."""
    if not (workdir / NODEIDS_FILE).is_file():
        raise pytest.UsageError(f"{NARROW_OPTION}={workdir}: no {NODEIDS_FILE} there")
    config.pluginmanager.register(ResumedRun(config, workdir), "cuda.resumed-run")


class ResumedRun:
    """In a child process: run only the parent's remaining tests, in the parent's order,
    and write every event the parent replays."""

    def __init__(self, config: pytest.Config, workdir: Path) -> None:
        self.config = config
        self.wanted = read_nodeids(workdir)
        self.events = EventWriter(workdir)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        by_id: dict[str, pytest.Item] = {}
        for item in items:
            by_id.setdefault(item.nodeid, item)
        keep = [by_id[nodeid] for nodeid in self.wanted if nodeid in by_id]
        kept = {id(item) for item in keep}
        deselected = [item for item in items if id(item) not in kept]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
        items[:] = keep
        self.events.write("plan", nodeids=[item.nodeid for item in keep])

    def pytest_runtest_logstart(self, nodeid: str, location: tuple[str, int | None, str]) -> None:
        self.events.write("logstart", nodeid=nodeid, location=location)

    @pytest.hookimpl(trylast=True)  # the report as every other plugin left it
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        self.events.write("report", report=data)

    def pytest_runtest_logfinish(self, nodeid: str, location: tuple[str, int | None, str]) -> None:
        self.events.write("logfinish", nodeid=nodeid, location=location)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, object, object]:
        # Outside pytest's warnings plugin, which records a test's warnings after the
        # test's logfinish: "done" tells the parent that nothing more of it will come.
        try:
            return (yield)
        finally:
            self.events.write("done", nodeid=item.nodeid)

    def pytest_warning_recorded(
        self,
        warning_message: warnings.WarningMessage,
        when: str,
        nodeid: str,
        location: tuple[str, int, str] | None,
    ) -> None:
        category = warning_message.category
        self.events.write(
            "warning",
            message=str(warning_message.message),
            category=getattr(category, "__name__", "UserWarning"),
            category_module=getattr(category, "__module__", "builtins"),
            filename=warning_message.filename,
            lineno=warning_message.lineno,
            when=when,
            nodeid=nodeid,
            location=location,
        )

    def pytest_sessionfinish(self, exitstatus: int) -> None:
        self.events.write("finish", exitstatus=int(exitstatus))

    def pytest_unconfigure(self) -> None:
        self.events.close()
