"""The sync plugin's per-test hooks, imported only when they have work.

:mod:`pytest_cuda.sync.plugin` is imported on every pytest run; it imports this module
(and with it the seam and the cure's modules) only when a sync mode is asked for, when
the checks after each test phase start (a CUDA library is imported, or an option of
the plugin is given), or on an xdist controller.

* :class:`SyncModes` wraps the body of each test that asks in its CUDA checks (per-op
  synchronize, no implicit synchronization);
* :class:`PhaseChecks` checks the CUDA context after each test phase, blames the test
  that left a sticky error, adds a CUDA failure's site, re-run and repro command to its
  report, and keeps the poisoned context from the tests after it;
* :class:`XdistCulprits` reports the culprits once on an xdist controller.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING

import pytest

from gpumagic import cuda
from gpumagic.cuda_errors import CudaErrorInfo, classify
from gpumagic.stacks import FrameFilter
from pytest_cuda.child import ChildRun, Workdirs, child_argv_for, child_env, write_nodeids
from pytest_cuda.markers import check_no_arguments
from pytest_cuda.repro import (
    FailureSite,
    describe_sync_op,
    failure_site,
    repro_command,
)
from pytest_cuda.sync.continuation import Continuation, SkipRemaining, report_from_data
from pytest_cuda.sync.poison import Culprit, Surfaced
from pytest_cuda.sync.poison_report import (
    LAUNCH_BLOCKING,
    SUMMARY_NAME,
    WORKER_EXIT_STATUS,
    Action,
    PoisonSummary,
    note,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Generator, Iterator

__all__ = ["PhaseChecks", "SyncModes", "XdistCulprits", "no_implicit_sync"]

_ASYNC = pytest.StashKey[dict[str, Surfaced]]()


# ---------------------------------------------------------------------------
# per-op sync and implicit-sync checks, for the tests that ask for them.


class SyncModes:
    """Wraps the body of each test that asks (option or marker) in its CUDA checks."""

    def __init__(self, config: pytest.Config, *, per_op_all: bool) -> None:
        self.config = config
        self.per_op_all = per_op_all

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """A marker given arguments it would ignore is an error, not a silent no-op."""
        for name in ("cuda_sync", "cuda_no_sync"):
            for mark in item.iter_markers(name):
                try:
                    check_no_arguments(mark.args, mark.kwargs)
                except ValueError as exc:
                    malformed = f"malformed @pytest.mark.{name} on {item.nodeid}: {exc}"
                else:
                    continue
                # Outside the except: pytest would show the ValueError first, then
                # "During handling of the above exception" and this.
                pytest.fail(malformed, pytrace=False)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, object, object]:
        per_op = self.per_op_all or item.get_closest_marker("cuda_sync") is not None
        no_sync = item.get_closest_marker("cuda_no_sync") is not None
        if not (per_op or no_sync):
            return (yield)
        status = cuda.status()
        if not status.available:
            if per_op:
                note(self.config, f"per-op sync did nothing: CUDA unavailable: {status.reason}")
            if no_sync:
                note(
                    self.config, f"cuda_no_sync checked nothing: CUDA unavailable: {status.reason}"
                )
            return (yield)
        with contextlib.ExitStack() as stack:
            if no_sync:
                stack.enter_context(no_implicit_sync(self.config))
            if per_op:
                stack.enter_context(cuda.sync_after_each_op(note=_per_op_note))
            return (yield)


def _per_op_note(op: str) -> str:
    """What per-op sync adds to the error its synchronize raised right after ``op``."""
    return (
        f"pytest_cuda: raised by the synchronize right after {op} (per-op sync): "
        "this op queued the kernel that failed"
    )


@contextlib.contextmanager
def no_implicit_sync(config: pytest.Config) -> Iterator[None]:
    """Fail the test if the block makes the host wait for the GPU implicitly."""
    status = cuda.status()
    if not status.available:
        note(config, f"cuda_no_sync checked nothing: CUDA unavailable: {status.reason}")
        yield
        return
    try:
        with cuda.forbid_implicit_sync():
            yield
    except RuntimeError as error:
        if cuda.SYNC_WARNING_MESSAGE not in str(error):
            raise
        op = error.op if isinstance(error, cuda.ImplicitSyncError) else None
        site = failure_site(
            error.__traceback__, FrameFilter.default().is_user, relative_to=config.rootpath
        )
        where = f" at {site.describe()}" if site else ""
        # from None: the report is this one line, not torch's error followed by "During
        # handling of the above exception, another exception occurred".
        raise pytest.fail.Exception(
            f"cuda_no_sync: implicit host-device synchronization: {describe_sync_op(op)}{where}",
            pytrace=False,
        ) from None


# ---------------------------------------------------------------------------
# Poisoned contexts: the check after each test, the blame, the containment.


def _may_be_cuda(error: BaseException) -> bool:
    """Assertions and pytest outcomes may quote a CUDA error; they are not one."""
    return isinstance(error, Exception) and not isinstance(error, AssertionError)


def _is_interrupt(error: BaseException) -> bool:
    return isinstance(error, KeyboardInterrupt | SystemExit | pytest.exit.Exception)


class PhaseChecks:
    """After each test phase that ran with a CUDA context: is the context still usable?

    Registered by :meth:`pytest_cuda.sync.plugin.PoisonGuard.start_checking`, which
    passes what these hooks use: ``check`` (the guard's health check, one device
    synchronize that returns at once where torch has not initialised CUDA), the
    ``--cuda-on-poison`` ``action`` and ``--cuda-rerun-blocking``.
    """

    def __init__(
        self,
        config: pytest.Config,
        check: Callable[[], cuda.AsyncCudaError | None],
        *,
        action: Action,
        rerun_blocking: bool,
    ) -> None:
        self.config = config
        self.check = check
        self.action = action
        self.rerun_blocking = rerun_blocking
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
            summary = self.config.pluginmanager.get_plugin(SUMMARY_NAME)
            if isinstance(summary, PoisonSummary):
                summary.listen(self.config.pluginmanager)
            if self.action in ("stop", "stop-child"):
                item.session.shouldstop = (
                    f"pytest_cuda: {item.nodeid} left a sticky CUDA error ({info.text}); "
                    + (
                        "stopping (--cuda-on-poison=stop)"
                        if self.action == "stop"
                        else "this continuation process stops here"
                    )
                )
        if raised is None:
            part = "body" if when == "call" else when
            hint = (
                "the re-run below shows the line that queued it"
                if self.rerun_blocking
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
                "action": self.action,
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
            site = failure_site(excinfo.tb, FrameFilter.default().is_user, relative_to=rootpath)
            test_line = failure_site(excinfo.tb, relative_to=rootpath, in_file=item.path)
            if site is not None:
                report.cuda_failure_site = site.to_dict()  # type: ignore[attr-defined]
            if test_line is not None and test_line != site:
                report.cuda_failure_test_line = test_line.to_dict()  # type: ignore[attr-defined]
        lines = []
        if poisoned_here:
            assert culprit is not None
            lines.append(_poison_text(culprit, self.action))
        if info is not None and self.rerun_blocking:
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
            ("--cuda-sync=launch-blocking", "--cuda-internal-rerun"),
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
        action = self.action
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
        self.record(report)

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
