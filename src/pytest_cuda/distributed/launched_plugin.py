"""pytest glue for a launched run: ``pytest --cuda-ranks=env`` under torchrun, srun or mpirun.

Every process the launcher started runs this pytest command. :func:`open_launched` (at
configure) reads the rank from the launcher's environment and reaches the launcher's
store; :class:`LaunchedPlugin` then:

* compares every rank's collection after it (one clear error naming the differing ids);
* on rank 0, runs the session as usual: ordinary tests here, a ``cuda_distributed``
  test on the first ``world_size`` ranks (:mod:`pytest_cuda.distributed.plugin` sends
  the others their orders at its set-up), the one terminal report, the JUnit XML and
  the leak report;
* on the other ranks, replaces the test loop: each waits for rank 0's orders and runs
  the tests it is given (its fixtures, its own rank), its terminal output going to
  ``--cuda-rank-logs`` (else nowhere), and ends with rank 0's exit status, so every
  launcher sees a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import pytest

from gpumagic import cuda
from pytest_cuda.distributed.launched import LaunchedRun, Order
from pytest_cuda.distributed.ranks import LAUNCHED_WORLD, MARKER, parse_distributed_marker
from pytest_cuda.distributed.world import LaunchError, launched_world
from pytest_cuda.settings import settings_of

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["ORDER", "LaunchedPlugin", "check_launched", "launched_run", "open_launched"]

NAME = "cuda.launched"
#: Rank 0's order that made another rank run a test, stashed on the test.
ORDER = pytest.StashKey[Order]()
_RUN = pytest.StashKey[LaunchedRun]()


def launched_run(config: pytest.Config) -> LaunchedRun | None:
    """This process's launched run, ``None`` without ``--cuda-ranks=env``."""
    return config.stash.get(_RUN, None)


def check_launched(config: pytest.Config) -> None:
    """Before configure: a process without a launcher's rank, or with pytest-xdist, is a
    usage error; a rank but rank 0 writes no JUnit XML and no leak report."""
    option = config.option
    if (
        getattr(option, "dist", "no") != "no"
        or getattr(option, "numprocesses", None)
        or getattr(option, "tx", None)
    ):
        raise pytest.UsageError(
            "--cuda-ranks=env runs one pytest process per rank, which the launcher "
            "starts; it does not go with pytest-xdist's -n/--dist: drop one of the two"
        )
    try:
        world = launched_world(os.environ)
    except LaunchError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[LAUNCHED_WORLD] = world
    if world.rank != 0:  # rank 0 writes the one JUnit XML and the one leak report
        config.option.xmlpath = None
        config.option.cuda_leak_report = None


def open_launched(config: pytest.Config) -> None:
    """At configure's end (pytest's terminal reporter exists): join the launched run,
    register its hooks, quiet the terminal of a rank but rank 0."""
    world = config.stash[LAUNCHED_WORLD]
    try:
        run = LaunchedRun.open(world)
    except (cuda.StoreGone, RuntimeError) as exc:
        raise pytest.UsageError(
            f"--cuda-ranks=env: {world.describe()} could not reach the run's store at "
            f"{world.master_addr}:{world.master_port}: {exc}"
        ) from None
    config.stash[_RUN] = run
    plugin = LaunchedPlugin(run, settings_of(config).rank_logs)
    config.pluginmanager.register(plugin, NAME)
    plugin.quiet(config)


class LaunchedPlugin:
    """The hooks of one rank of a launched run."""

    def __init__(self, run: LaunchedRun, logs: str | None) -> None:
        self.run = run
        self.logs = logs
        self._log: IO[str] | None = None
        #: This test's failed (or skipped) set-up and call reports, by phase.
        self._failed: dict[str, pytest.TestReport] = {}

    def quiet(self, config: pytest.Config) -> None:
        """Another rank is quiet on the terminal: its terminal report goes to its log,
        or nowhere. Called once pytest's reporter exists, before it writes."""
        if self.run.first:
            return
        if self.logs:
            Path(self.logs).mkdir(parents=True, exist_ok=True)
            path = Path(self.logs) / f"rank{self.run.world.rank}.log"
        else:
            path = Path(os.devnull)
        self._log = path.open("w", encoding="utf-8")
        manager = config.pluginmanager
        old = manager.get_plugin("terminalreporter")
        if old is not None:
            manager.unregister(old)
            manager.register(pytest.TerminalReporter(config, self._log), "terminalreporter")

    def pytest_unconfigure(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def pytest_report_header(self) -> list[str]:
        world = self.run.world
        return [
            f"cuda ranks: {world.world_size} started by {world.launcher}; this is "
            f"{world.describe().partition(', started')[0]}; store "
            f"{world.master_addr}:{world.master_port}"
        ]

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if session.config.option.collectonly:
            return
        error = self.run.check_collection([item.nodeid for item in session.items])
        if error:
            raise pytest.UsageError(error)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool | None:
        """Another rank's loop: the tests rank 0 orders, until it says the run ended."""
        if self.run.first or session.config.option.collectonly:
            return None
        if session.testsfailed and not session.config.option.continue_on_collection_errors:
            return None  # pytest's own loop stops the run
        mine = _own_tests(session.items, self.run.world.rank)
        try:
            while (order := self.run.receive()) is not None:
                item = session.items[order.index]
                item.stash[ORDER] = order
                self._failed.clear()
                later = [i for i in mine if i > order.index]
                nextitem = session.items[later[0]] if later else None
                item.ihook.pytest_runtest_protocol(item=item, nextitem=nextitem)
                self._answer_unset(order)
        except cuda.StoreGone as exc:
            session.shouldfail = f"rank 0 is gone, this rank's run ends: {exc}"
        return True

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when in ("setup", "call") and not report.passed:
            self._failed[report.when] = report

    def _answer_unset(self, order: Order) -> None:
        """A test whose set-up (or call) failed or skipped here before its rank ran its
        job never sent that job's outcome: send one in its rank's stead, for rank 0 not
        to wait for it."""
        store, rank = self.run.store, self.run.world.rank
        for when, job in (("setup", "warmup"), ("call", "test")):
            report = self._failed.get(when)
            key = f"outcome/{store.prefix}{order.number}/{job}/{rank}"
            if report is None or store.has(key):
                continue
            how = "skipped" if report.skipped else "failed"
            outcome: dict[str, Any] = {
                "rank": rank,
                "device": "not started",
                "state": "failed",
                "message": f"its {when} {how} on this rank: {_reason(report)}",
                "traceback": report.longreprtext,
                "host": self.run.world.host,
                "node": self.run.world.node,
            }
            store.set(key, json.dumps(outcome))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.run.first:
            self.run.end(exitstatus)
            return
        if self.run.exitstatus is None:
            try:
                if self.run.store.wait(["end"], 30.0):
                    self.run.exitstatus = int(self.run.store.get("end"))
            except cuda.StoreGone:
                pass
        found = self.run.exitstatus
        session.exitstatus = found if found is not None else pytest.ExitCode.INTERNAL_ERROR
        with contextlib.suppress(cuda.StoreGone):
            self.run.bye()


def _reason(report: pytest.TestReport) -> str:
    """A failed or skipped report's one line: the exception, or the skip's reason."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
        return str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message).splitlines()[0]
    lines = report.longreprtext.strip().splitlines()
    return lines[-1] if lines else "no reason given"


def _own_tests(items: Sequence[pytest.Item], rank: int) -> list[int]:
    """The indices of the tests this rank may be ordered to run: ``cuda_distributed``
    tests with more than ``rank`` ranks."""
    found = []
    for index, item in enumerate(items):
        mark = item.get_closest_marker(MARKER)
        if mark is None:
            continue
        try:
            spec = parse_distributed_marker(mark.args, mark.kwargs)
        except ValueError:
            continue
        if spec.world_size > rank:
            found.append(index)
    return found
