"""Debugging asynchronous CUDA errors: synchronous modes, poisoned contexts, hidden syncs.

A CUDA kernel's error surfaces at some later CUDA call, not at the line that launched
it; a device-side assert leaves the process's context unusable, so every later CUDA
test fails too. This plugin (loaded with :mod:`pytest_cuda.plugin`; ``-p
no:pytest_cuda.sync_plugin`` turns it off alone):

* ``--cuda-sync=launch-blocking`` sets ``CUDA_LAUNCH_BLOCKING=1`` before any conftest
  can create a context, ``--cuda-sync=per-op`` / ``@pytest.mark.cuda_sync``
  synchronize after every torch op, so the error is raised at its line;
* after each test that used CUDA it checks the context (one device synchronize), blames
  the test that left a sticky error and, by default, runs the remaining tests in a
  fresh process whose results join this report (``--cuda-on-poison``); an xdist worker
  is replaced instead, and the culprit is reported once;
* ``--cuda-rerun-blocking`` re-runs a CUDA failure alone with blocking launches to
  find its real line; every CUDA failure carries a repro command;
* ``@pytest.mark.cuda_no_sync`` and the ``cuda_no_sync`` fixture fail a test whose code
  makes the host wait for the GPU implicitly.

CUDA is touched only through :mod:`gpumagic.cuda`, and only in processes where torch
has initialised CUDA (or where the user asked for a CUDA check).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import pytest

import gpumagic
import pytest_cuda
from gpumagic import cuda
from pytest_cuda.continuation import (
    Continuation,
    ResumedRun,
    SkipRemaining,
    child_argv_for,
    report_from_data,
)
from pytest_cuda.poison import (
    ChildRun,
    CudaErrorInfo,
    Workdirs,
    child_env,
    classify,
    write_nodeids,
)
from pytest_cuda.repro import (
    FailureSite,
    describe_sync_op,
    failure_site,
    library_dirs,
    repro_command,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Generator, Iterator

    from _pytest.config.argparsing import Parser

__all__ = ["POISON_ACTIONS", "SYNC_MODES"]

SYNC_MODES = ("launch-blocking", "per-op")
POISON_ACTIONS = ("continue", "stop", "skip")
LAUNCH_BLOCKING = "CUDA_LAUNCH_BLOCKING"
#: Exit status of an xdist worker that ends itself after a sticky CUDA error.
WORKER_EXIT_STATUS = 3

CUDA_SYNC_MARKER_DOC = (
    "cuda_sync: synchronize after every torch operation of this test (as "
    "--cuda-sync=per-op does for every test), so an asynchronous CUDA error is raised "
    "at the op and line that caused it."
)
CUDA_NO_SYNC_MARKER_DOC = (
    "cuda_no_sync: fail the test if its body makes the host wait for the GPU "
    "implicitly (.item(), .cpu(), nonzero(), bool(tensor)...), naming the op and the "
    'line. Uses torch.cuda.set_sync_debug_mode("error") and restores the previous '
    "mode; explicit torch.cuda.synchronize() and syncs outside torch are not seen. "
    "The cuda_no_sync fixture does the same for a with-block."
)

Action = Literal["continue", "stop", "skip", "replace-worker", "stop-child"]


@dataclass(frozen=True)
class DebugOptions:
    """This process's debug options, checked once in ``pytest_configure``."""

    sync: str | None
    on_poison: str
    rerun_blocking: bool
    action: Action
    #: This process is a child running some of a parent session's tests.
    resume: Path | None
    #: ... and re-runs one failing test with blocking launches.
    rerun: bool
    downgraded: str | None = None


_OPTIONS = pytest.StashKey[DebugOptions]()
_NOTES = pytest.StashKey[dict[str, None]]()


@dataclass(frozen=True)
class Surfaced:
    """An error the post-phase check found; ``failed_phase``: it alone failed the phase."""

    error: cuda.AsyncCudaError
    failed_phase: bool


_ASYNC = pytest.StashKey[dict[str, Surfaced]]()


def pytest_addoption(parser: Parser) -> None:
    group = parser.getgroup("cuda", "CUDA devices (pytest_cuda)")
    group.addoption(
        "--cuda-sync",
        choices=SYNC_MODES,
        default=None,
        help="debug asynchronous CUDA errors. launch-blocking: set CUDA_LAUNCH_BLOCKING=1 "
        "before any conftest can create a CUDA context (xdist workers too; restored "
        "afterwards), so every kernel launch waits for its kernel. per-op: synchronize "
        "after every torch operation in each test, so the error is raised at the op and "
        "line that caused it, without a restart.",
    )
    group.addoption(
        "--cuda-on-poison",
        choices=POISON_ACTIONS,
        default=None,
        help="after a test leaves a sticky CUDA error (a device-side assert, an illegal "
        "address), every later CUDA call in the process fails. continue (default): run "
        "the remaining tests in a fresh process and merge their results into this report "
        "(under xdist the worker is replaced); stop: end the run; skip: skip the "
        "remaining tests of the process.",
    )
    group.addoption(
        "--cuda-rerun-blocking",
        action="store_true",
        default=False,
        help="re-run each test that failed with a CUDA error once, alone, in a fresh "
        "process with CUDA_LAUNCH_BLOCKING=1, and add the line where it really failed "
        "to its report.",
    )
    group.addoption("--cuda-internal-resume", default=None, help=argparse.SUPPRESS)
    group.addoption(
        "--cuda-internal-rerun", action="store_true", default=False, help=argparse.SUPPRESS
    )


# ---------------------------------------------------------------------------
# --cuda-sync=launch-blocking: before any conftest is imported.


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    namespace = early_config.known_args_namespace
    if getattr(namespace, "cuda_sync", None) != "launch-blocking":
        return
    previous = os.environ.get(LAUNCH_BLOCKING)
    if previous != "1" and cuda.is_initialized():
        raise pytest.UsageError(
            "--cuda-sync=launch-blocking: CUDA was initialised in this process before "
            "pytest_cuda could set CUDA_LAUNCH_BLOCKING=1 (a plugin given with -p or "
            "installed with an entry point created a CUDA context when imported), so "
            "kernel launches would stay asynchronous. Set CUDA_LAUNCH_BLOCKING=1 in the "
            "environment instead, or keep that plugin from touching CUDA at import."
        )
    os.environ[LAUNCH_BLOCKING] = "1"
    early_config.add_cleanup(functools.partial(_restore_env, LAUNCH_BLOCKING, previous))


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


# ---------------------------------------------------------------------------
# Configuration: check the options, register what is switched on.


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", CUDA_SYNC_MARKER_DOC)
    config.addinivalue_line("markers", CUDA_NO_SYNC_MARKER_DOC)
    options = _options(config)
    config.stash[_OPTIONS] = options
    config.stash[_NOTES] = {}
    manager = config.pluginmanager
    if _is_xdist_controller(config):
        manager.register(XdistCulprits(), "cuda.poison-xdist")
    else:
        manager.register(PoisonGuard(config, options), "cuda.poison")
    if options.resume is not None:
        manager.register(ResumedRun(config, options.resume), "cuda.resumed-run")
    elif not hasattr(config, "workerinput") and not _is_xdist_controller(config):
        manager.register(PoisonSummary(), "cuda.poison-summary")
    if options.sync == "per-op":
        _register_sync_modes(config)


def _options(config: pytest.Config) -> DebugOptions:
    sync: str | None = config.getoption("cuda_sync")
    given: str | None = config.getoption("cuda_on_poison")
    rerun_blocking: bool = config.getoption("cuda_rerun_blocking")
    resume_dir: str | None = config.getoption("cuda_internal_resume")
    rerun: bool = config.getoption("cuda_internal_rerun")
    resume = Path(resume_dir) if resume_dir else None
    if resume is not None and not (resume / "nodeids.json").is_file():
        raise pytest.UsageError(f"--cuda-internal-resume={resume_dir}: no nodeids.json there")
    if rerun:
        rerun_blocking = False
    elif rerun_blocking and sync == "launch-blocking":
        raise pytest.UsageError(
            "--cuda-rerun-blocking re-runs CUDA failures with CUDA_LAUNCH_BLOCKING=1, which "
            "--cuda-sync=launch-blocking already sets for the whole run: use one of them."
        )
    debugging = bool(config.getoption("usepdb", False) or config.getoption("trace", False))
    on_poison = given or "continue"
    downgraded = None
    if debugging and on_poison == "continue" and resume is None:
        if given:
            raise pytest.UsageError(
                "--cuda-on-poison=continue runs the remaining tests in a fresh process, "
                "where --pdb/--trace cannot reach them: use --cuda-on-poison=stop or skip."
            )
        on_poison, downgraded = "stop", "stop (continue is not possible under --pdb/--trace)"
    action = cast("Action", on_poison)
    if resume is not None:
        action = "stop-child"
    elif hasattr(config, "workerinput") and on_poison == "continue":
        action = "replace-worker"
    return DebugOptions(sync, on_poison, rerun_blocking, action, resume, rerun, downgraded)


def _is_xdist_controller(config: pytest.Config) -> bool:
    return (
        not hasattr(config, "workerinput")
        and getattr(config.option, "dist", "no") != "no"
        and not config.getoption("collectonly")
    )


def _register_sync_modes(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin("cuda.sync-modes"):
        per_op = config.stash[_OPTIONS].sync == "per-op"
        config.pluginmanager.register(SyncModes(config, per_op_all=per_op), "cuda.sync-modes")


def pytest_report_header(config: pytest.Config) -> list[str]:
    options = config.stash[_OPTIONS]
    parts = []
    if options.sync == "launch-blocking":
        parts.append("--cuda-sync=launch-blocking (CUDA_LAUNCH_BLOCKING=1)")
    elif options.sync == "per-op":
        parts.append("--cuda-sync=per-op (synchronize after every torch op)")
    if options.downgraded:
        parts.append(f"--cuda-on-poison={options.downgraded}")
    elif config.getoption("cuda_on_poison"):
        parts.append(f"--cuda-on-poison={options.on_poison}")
    if options.rerun_blocking:
        parts.append("--cuda-rerun-blocking")
    if not parts:
        return []
    lines = ["cuda debug: " + ", ".join(parts)]
    status = cuda.status()
    if not status.available:
        lines.append(f"cuda debug: these have no effect here: CUDA unavailable: {status.reason}")
    return lines


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The markers switch the sync modes on for their tests only; a run without them
    # pays nothing per test.
    names = ("cuda_sync", "cuda_no_sync")
    if any(item.get_closest_marker(name) for item in items for name in names):
        _register_sync_modes(config)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    notes = config.stash.get(_NOTES, {})
    for note in notes:
        terminalreporter.write_line(f"cuda debug: {note}", yellow=True)


def _note(config: pytest.Config, text: str) -> None:
    config.stash.setdefault(_NOTES, {})[text] = None


# ---------------------------------------------------------------------------
# per-op sync and implicit-sync checks, for the tests that ask for them.


class SyncModes:
    """Wraps the body of each test that asks (option or marker) in its CUDA checks."""

    def __init__(self, config: pytest.Config, *, per_op_all: bool) -> None:
        self.config = config
        self.per_op_all = per_op_all

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, object, object]:
        per_op = self.per_op_all or item.get_closest_marker("cuda_sync") is not None
        no_sync = item.get_closest_marker("cuda_no_sync") is not None
        if not (per_op or no_sync):
            return (yield)
        status = cuda.status()
        if not status.available:
            if per_op:
                _note(self.config, f"per-op sync did nothing: CUDA unavailable: {status.reason}")
            if no_sync:
                _note(
                    self.config, f"cuda_no_sync checked nothing: CUDA unavailable: {status.reason}"
                )
            return (yield)
        with contextlib.ExitStack() as stack:
            if no_sync:
                stack.enter_context(_no_implicit_sync(self.config))
            if per_op:
                stack.enter_context(cuda.sync_after_each_op())
            return (yield)


@contextlib.contextmanager
def _no_implicit_sync(config: pytest.Config) -> Iterator[None]:
    status = cuda.status()
    if not status.available:
        _note(config, f"cuda_no_sync checked nothing: CUDA unavailable: {status.reason}")
        yield
        return
    try:
        with cuda.forbid_implicit_sync():
            yield
    except RuntimeError as error:
        if cuda.SYNC_WARNING_MESSAGE not in str(error):
            raise
        op = error.op if isinstance(error, cuda.ImplicitSyncError) else None
        site = failure_site(error.__traceback__, _skip_dirs(), relative_to=config.rootpath)
        where = f" at {site.describe()}" if site else ""
        pytest.fail(
            f"cuda_no_sync: implicit host-device synchronization: {describe_sync_op(op)}{where}",
            pytrace=False,
        )


@pytest.fixture
def cuda_no_sync(
    request: pytest.FixtureRequest,
) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """Forbid implicit host-device synchronization in a block: ``with cuda_no_sync(): ...``.

    Inside the block, an op that makes the host wait for the GPU (``.item()``,
    ``.cpu()``, ``nonzero()``, ``bool(tensor)``, boolean-mask indexing...) fails the
    test with the op and the line. Uses ``torch.cuda.set_sync_debug_mode("error")`` and
    restores the previous mode. Not seen: explicit ``torch.cuda.synchronize()`` or
    ``Event``/``Stream.synchronize()``, syncs outside torch (CuPy, extensions), and the
    ops torch's prototype mode misses (``torch.distributed``, ``torch.sparse``). The
    mode is process-wide while the block runs. Without CUDA the block checks nothing
    and the run ends with a note. ``@pytest.mark.cuda_no_sync`` covers a whole test.
    """
    return functools.partial(_no_implicit_sync, request.config)


def _skip_dirs() -> tuple[str, ...]:
    """Frames that are not the user's: libraries, torch (once imported), ours."""
    ours = (Path(gpumagic.__file__).parent, Path(pytest_cuda.__file__).parent)
    return library_dirs((*ours, cuda.torch_package_dir()))


# ---------------------------------------------------------------------------
# Poisoned contexts: the check after each test, the blame, the containment.


@dataclass(frozen=True)
class Culprit:
    nodeid: str
    when: str
    error: CudaErrorInfo


def _may_be_cuda(error: BaseException) -> bool:
    """Assertions and pytest outcomes may quote a CUDA error; they are not one."""
    return isinstance(error, Exception) and not isinstance(error, AssertionError)


def _is_interrupt(error: BaseException) -> bool:
    return isinstance(error, KeyboardInterrupt | SystemExit | pytest.exit.Exception)


class PoisonGuard:
    """After each test phase that ran with a CUDA context: is the context still usable?

    The check is one device synchronize (:func:`gpumagic.cuda.async_error`) and is
    skipped entirely in processes where torch has not initialised CUDA.
    """

    def __init__(self, config: pytest.Config, options: DebugOptions) -> None:
        self.config = config
        self.options = options
        #: The health check; tests swap it to simulate a sticky error without a GPU.
        self.check: Callable[[], cuda.AsyncCudaError | None] = cuda.async_error
        self.culprit: Culprit | None = None
        self.workdirs = Workdirs()
        self.continuation: Continuation | None = None
        self._contained = False

    # -- the check --------------------------------------------------------
    # trylast: inside pytest's output capture, so what a failing kernel prints when the
    # check synchronizes (a device-side assert's condition) lands in this test's report.

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, object, object]:
        # Only a failing setup is checked: a fixture's GPU work that fails later is
        # caught after the body, on the same test.
        try:
            return (yield)
        except BaseException as raised:
            if not _is_interrupt(raised) and not isinstance(raised, pytest.skip.Exception):
                self._after(item, "setup", raised)
            raise

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, object, object]:
        try:
            result = yield
        except BaseException as raised:
            if not _is_interrupt(raised):
                self._after(item, "call", raised)
            raise
        self._after(item, "call", None)
        return result

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, object, object]:
        raised: BaseException | None = None
        result: object = None
        try:
            result = yield
        except BaseException as error:
            if _is_interrupt(error):
                raise
            raised = error
        found: BaseException | None = None
        try:
            self._after(item, "teardown", raised)
        except pytest.fail.Exception as error:
            found = error
        if self.culprit is not None and self.culprit.nodeid == item.nodeid:
            _teardown_everything(item)
        if raised is not None:
            raise raised
        if found is not None:
            raise found
        return result

    def _after(self, item: pytest.Item, when: str, raised: BaseException | None) -> None:
        """Check the context after a phase; fail the phase if only the check saw an error."""
        if self.culprit is not None:
            return  # the context is known to be unusable; nothing more to learn here
        error = self.check()
        if error is None:
            return
        item.stash.setdefault(_ASYNC, {})[when] = Surfaced(error, failed_phase=raised is None)
        info = classify(error.message) or CudaErrorInfo(
            error.message.strip().splitlines()[0] if error.message.strip() else "unknown error",
            None,
            error.sticky,
        )
        if error.sticky:
            self.culprit = Culprit(item.nodeid, when, info)
            if self.options.action in ("stop", "stop-child"):
                item.session.shouldstop = (
                    f"pytest_cuda: {item.nodeid} left a sticky CUDA error ({info.text}); "
                    + (
                        "stopping (--cuda-on-poison=stop)"
                        if self.options.action == "stop"
                        else "this continuation process stops here"
                    )
                )
        if raised is None:
            part = "body" if when == "call" else when
            hint = (
                "the re-run below shows the line that queued it"
                if self.options.rerun_blocking
                else "--cuda-rerun-blocking or --cuda-sync=per-op show the line that queued it"
            )
            pytest.fail(
                f"pytest_cuda: an asynchronous CUDA error surfaced after the test's {part} "
                f"returned: {info.describe()}\nIt comes from GPU work this test queued; {hint}.",
                pytrace=False,
            )

    # -- the report -------------------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        culprit = self.culprit
        poisoned_here = (
            culprit is not None and culprit.nodeid == item.nodeid and culprit.when == call.when
        )
        if poisoned_here:
            assert culprit is not None
            report.cuda_poison = {  # type: ignore[attr-defined]
                "error": culprit.error.describe(),
                "action": self.options.action,
            }
        excinfo = call.excinfo
        if not report.failed or excinfo is None:
            return report
        surfaced = item.stash.get(_ASYNC, {}).get(call.when)
        own_error = surfaced is None or not surfaced.failed_phase
        info = classify(str(excinfo.value)) if own_error and _may_be_cuda(excinfo.value) else None
        if info is None and surfaced is not None:
            info = classify(surfaced.error.message)
        if info is None and not poisoned_here:
            return report
        if info is not None and own_error:
            # Where the test's own exception came from: the true line when launches
            # are synchronous (the re-run reads it from here).
            rootpath = item.config.rootpath
            site = failure_site(excinfo.tb, _skip_dirs(), relative_to=rootpath)
            test_line = failure_site(excinfo.tb, (), relative_to=rootpath, in_file=item.path)
            if site is not None:
                report.cuda_failure_site = site.to_dict()  # type: ignore[attr-defined]
            if test_line is not None and test_line != site:
                report.cuda_failure_test_line = test_line.to_dict()  # type: ignore[attr-defined]
        lines = []
        if poisoned_here:
            assert culprit is not None
            lines.append(_poison_text(culprit, self.options.action))
        if info is not None and self.options.rerun_blocking:
            lines.append(self._rerun_blocking(item))
        if info is not None:
            lines.append(f"reproduce: {self._repro(item)}")
        _add_section(report, "pytest_cuda", "\n".join(lines))
        return report

    def _repro(self, item: pytest.Item) -> str:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            devices = cuda.status().devices
            visible = ",".join(str(d.index) for d in devices) if devices else None
        return repro_command(
            item.nodeid,
            visible_devices=visible,
            rootdir=item.config.rootpath,
            cwd=item.config.invocation_params.dir,
        )

    def _rerun_blocking(self, item: pytest.Item) -> str:
        """Run ``item`` alone in a fresh process with blocking launches; what it found."""
        config = item.config
        workdir = self.workdirs.new("rerun")
        write_nodeids(workdir, [item.nodeid])
        argv = child_argv_for(
            config,
            workdir,
            (
                "--cuda-sync=launch-blocking",
                f"--cuda-internal-resume={workdir}",
                "--cuda-internal-rerun",
            ),
        )
        child = ChildRun(
            argv, workdir, cwd=config.invocation_params.dir, env=child_env({LAUNCH_BLOCKING: "1"})
        )
        reports = []
        try:
            while (event := child.next_event()) is not None:
                if event["event"] == "report":
                    reports.append(report_from_data(config, event["report"]))
            status = child.wait()
            return _describe_rerun(reports, status, child.output_tail())
        finally:
            child.stop()
            self.workdirs.discard(workdir)

    # -- containment ------------------------------------------------------

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        culprit = self.culprit
        if culprit is None or culprit.nodeid != nodeid or self._contained:
            return
        self._contained = True
        action = self.options.action
        if action == "replace-worker":
            # xdist replaces a worker that dies and re-sends its pending tests to the
            # others; dying before "test complete" makes xdist name this test as the one
            # it crashed on, and XdistCulprits keeps that from counting it twice.
            self.workdirs.remove()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(WORKER_EXIT_STATUS)
        manager = self.config.pluginmanager
        if action == "skip":
            reason = (
                f"pytest_cuda: {culprit.nodeid} left a sticky CUDA error in this process "
                f"({culprit.error.text}) (--cuda-on-poison=skip)"
            )
            manager.register(SkipRemaining(reason), "cuda.poison-skip")
        elif action == "continue":
            self.continuation = Continuation(self.config, self.workdirs)
            manager.register(self.continuation, "cuda.poison-continue")

    def pytest_unconfigure(self) -> None:
        if self.continuation is not None:
            self.continuation.stop()
        self.workdirs.remove()


def _teardown_everything(item: pytest.Item) -> None:
    """Finish every fixture scope now, in the culprit's teardown.

    No later test of this session runs in this process, so module and session fixtures
    would otherwise be finalized at session end, where an error (a CUDA call in a
    poisoned context) is an internal error. pytest has no public API for this; the
    runner does the same when the session is about to stop (``nextitem=None``).
    """
    setup_state = getattr(item.session, "_setupstate", None)
    teardown_exact = getattr(setup_state, "teardown_exact", None)
    if teardown_exact is not None:
        teardown_exact(None)


def _poison_text(culprit: Culprit, action: Action) -> str:
    consequence = {
        "continue": "the remaining tests continue in a fresh process (--cuda-on-poison=continue)",
        "replace-worker": "this xdist worker is replaced by a fresh one, and the tests it "
        "had pending run elsewhere",
        "stop": "the run stops here (--cuda-on-poison=stop)",
        "skip": "the remaining tests of this process are skipped (--cuda-on-poison=skip)",
        "stop-child": "the remaining tests continue in another fresh process",
    }[action]
    return (
        f"this test left a sticky CUDA error ({culprit.error.describe()}): every later CUDA "
        f"call in this process would fail, so {consequence}."
    )


def _add_section(report: pytest.TestReport, title: str, text: str) -> None:
    longrepr = report.longrepr
    addsection = getattr(longrepr, "addsection", None)
    if addsection is not None:
        addsection(title, text)
    elif isinstance(longrepr, str):
        report.longrepr = f"{longrepr}\n{text}"


def _describe_rerun(reports: list[pytest.TestReport], status: int, tail: str) -> str:
    head = "re-run alone in a fresh process with CUDA_LAUNCH_BLOCKING=1"
    failed = next((r for r in reports if r.failed), None)
    if failed is not None:
        phase = "" if failed.when == "call" else f" in {failed.when}"
        lines = [f"{head}: failed{phase}"]
        site = FailureSite.from_dict(getattr(failed, "cuda_failure_site", None))
        test_line = FailureSite.from_dict(getattr(failed, "cuda_failure_test_line", None))
        for label, where in (("at", site), ("called from", test_line)):
            if where is not None:
                lines.append(f"  {label} {where.path}:{where.lineno} in {where.function}")
                if where.source:
                    lines.append(f"      {where.source}")
        crash = getattr(failed.longrepr, "reprcrash", None)
        message = getattr(crash, "message", None) or str(failed.longrepr).strip()
        if message:
            lines.append("  " + message.splitlines()[0])
        return "\n".join(lines)
    if any(r.skipped for r in reports):
        skipped = next(r for r in reports if r.skipped)
        reason = skipped.longrepr[2] if isinstance(skipped.longrepr, tuple) else skipped.longrepr
        return f"{head}: skipped ({reason})"
    if reports:
        return (
            f"{head}: passed. Alone, the test does not fail: the failure needs what earlier "
            "tests left behind in this process, or it is intermittent."
        )
    return f"{head}: it did not run (exit status {status}):\n{tail}"


# ---------------------------------------------------------------------------
# Reporting the culprits, once.


@dataclass(eq=False)  # registered as a plugin: pytest keeps plugins in sets
class PoisonSummary:
    """The session's culprits, in a section of the terminal summary."""

    culprits: list[tuple[str, dict[str, Any], str | None]] = field(default_factory=list)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        poison = getattr(report, "cuda_poison", None)
        if isinstance(poison, dict):
            self.culprits.append((report.nodeid, poison, getattr(report, "worker_id", None)))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.culprits:
            return
        terminalreporter.write_sep("=", "CUDA context poisoned", yellow=True)
        for nodeid, poison, worker in self.culprits:
            consequence = {
                "continue": "the tests after it ran in a fresh process",
                "stop-child": "the tests after it ran in another fresh process",
                "replace-worker": f"xdist worker {worker or '?'} was replaced; the test is "
                "reported once, above",
                "stop": "the run stopped there (--cuda-on-poison=stop)",
                "skip": "the tests after it in that process were skipped",
            }.get(str(poison.get("action")), "")
            terminalreporter.write_line(
                f"{nodeid} left a sticky CUDA error: {poison.get('error')}; {consequence}"
            )


class XdistCulprits(PoisonSummary):
    """On the xdist controller: a worker that ended itself after a culprit is replaced by
    xdist, which then reports "worker crashed while running <culprit>". The culprit's
    own failure has already been reported, so that second report is not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if getattr(report, "cuda_poison_duplicate", False):
            return
        if isinstance(getattr(report, "cuda_poison", None), dict):
            self.seen.add(report.nodeid)
        super().pytest_runtest_logreport(report)

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: pytest.TestReport) -> None:
        if crashitem in self.seen:
            report.outcome = "passed"
            report.cuda_poison_duplicate = True  # type: ignore[attr-defined]

    @pytest.hookimpl(tryfirst=True)
    def pytest_report_teststatus(self, report: pytest.TestReport) -> tuple[str, str, str] | None:
        if getattr(report, "cuda_poison_duplicate", False):
            return "", "", ""
        return None
