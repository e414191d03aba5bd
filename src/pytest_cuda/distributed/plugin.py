"""pytest glue for multi-rank tests: the ``cuda_distributed`` marker, the ``cuda_rank``
fixture.

A test marked ``@pytest.mark.cuda_distributed(world_size=2, backend="nccl",
timeout=60)`` is set up as usual in the pytest process (its fixtures, its
parametrization), then its function runs in ``world_size`` rank processes, one rank
each, pinned to its own device of the selected ones (``--cuda-devices``; an outer
``CUDA_VISIBLE_DEVICES`` is respected) with the default process group initialised
through a store on a free localhost port. The ranks are warm
(:mod:`pytest_cuda.distributed.pool`): started by the first test of their world size,
backend and devices, kept with their process group for the next, and replaced after a
test that failed or left state behind; ``fresh_group=True`` gives a test a process
group of its own, ``isolate=True`` fresh processes of its own. The fixture values
the function takes are pickled and sent to every rank; ``cuda_rank`` is each rank's own
(:class:`~pytest_cuda.distributed.ranks.RankInfo`).

The test fails if any rank fails: the report names the rank, its traceback and the
state of the others, with each rank's output as a report section. A test still running
after ``timeout`` seconds is stopped with every rank's Python stack in the report. The
leak check (``--cuda-leak-check``, the ``cuda_leak_check`` marker), the memory limit
(``--cuda-limit-memory``, the ``cuda_limit_memory`` marker: each rank's peak on its own
device) and the post-test CUDA health check run inside each rank. Loaded with
:mod:`pytest_cuda.plugin` (its ``MODE_PLUGINS``); the device requirement (one device
per rank on a GPU backend) is checked there with every other ``cuda`` requirement.
"""

from __future__ import annotations

import builtins
import pickle
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

from pytest_cuda.distributed.ranks import MARKER, RANK_DEVICES, RankInfo, parse_distributed_marker
from pytest_cuda.leaks.plugin import CHECKER_NAME, LIMITER_NAME
from pytest_cuda.settings import settings_of

if TYPE_CHECKING:
    from pytest_cuda.distributed.job import RankJob
    from pytest_cuda.distributed.pool import RankPools
    from pytest_cuda.distributed.ranks import DistributedSpec, RankOutcome
    from pytest_cuda.leaks.engine import LeakSettings

__all__ = ["PendingRank", "rank_pools"]

RANK_FIXTURE = "cuda_rank"
_POOLS = pytest.StashKey["RankPools"]()
#: The ranks' warnings relayed so far this session: (category, message, file, line).
_RELAYED = pytest.StashKey[set[tuple[str, str, str, int]]]()


class PendingRank:
    """``cuda_rank`` in the pytest process: the real one exists only in each rank.

    Fixtures run once, in the pytest process, before the ranks start; one that reads
    ``cuda_rank`` gets this, and any attribute explains why there is none yet.
    """

    def __getattr__(self, name: str) -> NoReturn:
        raise AttributeError(
            f"cuda_rank.{name} is known only inside each rank's process: fixtures of a "
            "cuda_distributed test are set up once, in the pytest process, and their "
            "values are sent to every rank. Build per-rank state in the test body "
            "from cuda_rank."
        )

    def __repr__(self) -> str:
        return "<cuda_rank: given to each rank process when the test runs>"


@pytest.fixture
def cuda_rank(request: pytest.FixtureRequest) -> RankInfo:
    """This rank of a ``cuda_distributed`` test: ``rank``, ``world_size``, ``device``
    (its own ``cuda:<i>``, made current; ``cpu`` for gloo), ``backend`` and ``group``
    (the default process group, initialised before the test and destroyed after)."""
    if request.node.get_closest_marker(MARKER) is None:
        pytest.fail(
            f"{request.node.nodeid}: the cuda_rank fixture is given only to tests marked "
            "@pytest.mark.cuda_distributed(world_size=N), which run in N rank processes",
            pytrace=False,
        )
    return PendingRank()  # type: ignore[return-value]  # the ranks get a RankInfo


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    mark = pyfuncitem.get_closest_marker(MARKER)
    if mark is None:
        return None
    try:
        spec = parse_distributed_marker(mark.args, mark.kwargs)
    except ValueError as exc:
        malformed = f"malformed @pytest.mark.{MARKER} on {pyfuncitem.nodeid}: {exc}"
    else:
        _run(pyfuncitem, spec)
        return True
    pytest.fail(malformed, pytrace=False)  # outside the except: no "During handling"


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    # Before the other plugins configure. Read raw: the settings are built at configure,
    # once pytest-xdist has set --dist from -n (their xdist_controller reads it).
    if getattr(config.option, "cuda_ranks", None) == "env":
        from pytest_cuda.distributed.launched_plugin import check_launched

        check_launched(config)


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    if settings_of(config).ranks == "env":  # after the terminal reporter's
        from pytest_cuda.distributed.launched_plugin import open_launched

        open_launched(config)


@pytest.hookimpl(trylast=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """The ranks' start-up, in the test's set-up (issue 40): the warm ranks start, if
    none are running, and join the test's process group, so that its call is its
    body's and its timeout counts from when every rank started the body."""
    mark = item.get_closest_marker(MARKER)
    if mark is None or not isinstance(item, pytest.Function):
        return
    try:
        spec = parse_distributed_marker(mark.args, mark.kwargs)
    except ValueError:
        return  # the call says so
    from pytest_cuda.distributed.launched_plugin import ORDER, launched_run

    run = launched_run(item.config)
    if run is not None and spec.world_size > run.world.world_size:
        pytest.skip(
            f"cuda_distributed(world_size={spec.world_size}) needs {spec.world_size} ranks; "
            f"{run.world.launcher} started {run.world.world_size} (--cuda-ranks=env)"
        )
    if spec.isolate and run is None:
        return  # fresh ranks of its own, started by its call
    job = _rank_job(item, spec, call=b"")
    pool = rank_pools(item.config).pool(job)
    if run is not None:
        from pytest_cuda.distributed.launched import LaunchedPool, prepare_launched

        assert isinstance(pool, LaunchedPool)  # the run's pools are
        failed = prepare_launched(item, pool, job, Path.cwd(), item.stash.get(ORDER, None))
    else:
        failed = pool.prepare(job, Path.cwd())
    if failed is not None:
        from pytest_cuda.distributed.launch import startup_limit
        from pytest_cuda.distributed.ranks import verdict

        outcomes, timed_out = failed
        _add_sections(item, outcomes, "setup")
        name = f"{item.name} (starting its ranks)"
        text = verdict(
            outcomes, spec, timed_out=timed_out, name=name, startup_s=startup_limit(spec)
        )
        pytest.fail(text.text, pytrace=False)


def rank_pools(config: pytest.Config) -> RankPools:
    """This session's warm rank pools, made on first use and closed with the session."""
    pools = config.stash.get(_POOLS, None)
    if pools is None:
        from pytest_cuda.distributed.launched_plugin import launched_run
        from pytest_cuda.distributed.pool import RankPools

        run = launched_run(config)
        if run is None:
            pools = RankPools()
        else:
            from pytest_cuda.distributed.launched import LaunchedPool

            pools = RankPools(lambda key, folder, servers: LaunchedPool(key, folder, run, servers))
        config.stash[_POOLS] = pools
        config.add_cleanup(pools.close)
    return pools


def _rank_job(
    item: pytest.Function, spec: DistributedSpec, *, call: bytes | None = None
) -> RankJob:
    """The job of the test's ranks; ``call``: instead of the pickled test (a warm-up's)."""
    from pytest_cuda.distributed.job import RankJob

    devices: tuple[int, ...] = ()
    if spec.uses_cuda:
        devices = item.stash.get(RANK_DEVICES, ())
        if len(devices) < spec.world_size:
            pytest.fail(
                f"{item.nodeid}: no CUDA devices were set aside for its "
                f"{spec.world_size} ranks (is the cuda plugin's device check switched off?)",
                pytrace=False,
            )
    return RankJob(
        name=item.name,
        module=item.module.__name__,
        module_file=str(item.path),
        call=_pickled_call(item) if call is None else call,
        wants_rank=RANK_FIXTURE in item._fixtureinfo.argnames,
        spec=spec,
        devices=devices,
        leak=_rank_leak_settings(item),
        limit=_rank_limit(item),
    )


def _run(item: pytest.Function, spec: DistributedSpec) -> None:
    from pytest_cuda.distributed.launch import run_ranks, startup_limit
    from pytest_cuda.distributed.launched_plugin import launched_run
    from pytest_cuda.distributed.ranks import verdict

    job = _rank_job(item, spec)
    run = launched_run(item.config)
    if spec.isolate and run is None:
        folder = Path(tempfile.mkdtemp(prefix="pytest-cuda-ranks-"))
        try:
            servers = rank_pools(item.config).servers
            outcomes, timed_out = run_ranks(job, folder, cwd=Path.cwd(), servers=servers)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    else:
        outcomes, timed_out = rank_pools(item.config).pool(job).run(job, Path.cwd())
    if run is not None and run.lost:
        item.session.shouldstop = (
            f"--cuda-ranks=env: the hosts of rank(s) {', '.join(map(str, run.lost))} stopped "
            "answering; the run ends with the results so far"
        )
    _add_sections(item, outcomes)
    _warn(item, outcomes)
    _merge_leaks(item, outcomes)
    result = verdict(
        outcomes, spec, timed_out=timed_out, name=item.name, startup_s=startup_limit(spec)
    )
    if result.outcome == "failed":
        pytest.fail(result.text, pytrace=False)
    if result.outcome == "skipped":
        # Reported at the test's line, as a skip in an ordinary test body is.
        raise pytest.skip.Exception(result.text, _use_item_location=True)
    if result.outcome == "xfailed":
        pytest.xfail(result.text)


def _pickled_call(item: pytest.Function) -> bytes:
    """The test function and its arguments, pickled; a clear error names what cannot be."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    kwargs = {
        name: item.funcargs[name] for name in item._fixtureinfo.argnames if name != RANK_FIXTURE
    }
    problems = []
    for name, value in kwargs.items():
        try:
            pickle.dumps(value)
        except Exception as exc:
            kind = "parameter" if name in params else "fixture"
            problems.append(f"  {kind} {name!r} ({type(value).__qualname__}): {exc}")
    function, error = _rank_function(item.obj)
    if error is not None:
        problems.append(
            f"  the test function {item.name} itself: {error} (define it at module or class "
            "level, not inside another function)"
        )
    if problems:
        pytest.fail(
            f"{item.nodeid}: a cuda_distributed test's arguments are pickled and sent to "
            "each rank's process; these cannot be:\n"
            + "\n".join(problems)
            + "\nPass what the ranks need to build them (a path, a config, a seed), or "
            "build them in the test body.",
            pytrace=False,
        )
    return pickle.dumps((function, kwargs))


def _rank_function(obj: object) -> tuple[object, Exception | None]:
    """What the ranks call: the test function, or the first object down the chain of
    ``__wrapped__`` that pickles, where another plugin wrapped the test in a function of
    its own (pytest-memray does, with :func:`functools.wraps`, to track the pytest
    process's memory while the test runs; the ranks are other processes). A wrapper at
    module level that pickles is kept: it is the test as its module defines it. With
    nothing that pickles, the innermost error: the one about the test function."""
    seen: set[int] = set()
    while True:
        try:
            pickle.dumps(obj)
        except Exception as exc:
            error = exc
        else:
            return obj, None
        seen.add(id(obj))
        wrapped = getattr(obj, "__wrapped__", None)
        if wrapped is None or id(wrapped) in seen:
            return obj, error
        obj = wrapped


def _rank_leak_settings(item: pytest.Item) -> LeakSettings | None:
    """How the checker planned to check this test (each rank checks itself the same
    way), or ``None`` when the leak check does not apply to it."""
    if item.config.pluginmanager.get_plugin(CHECKER_NAME) is None:
        return None  # no checker registered: leaks.checker is not even imported
    from pytest_cuda.leaks.checker import checked_for_leaks

    return checked_for_leaks(item)


def _rank_limit(item: pytest.Item) -> tuple[int, str] | None:
    """The memory limit planned for this test (each rank is held to it on its own
    device), or ``None``."""
    if item.config.pluginmanager.get_plugin(LIMITER_NAME) is None:
        return None  # no limit in this run: leaks.limiter is not even imported
    from pytest_cuda.leaks.limiter import planned_limit

    return planned_limit(item)


def _merge_leaks(item: pytest.Item, outcomes: list[RankOutcome]) -> None:
    """The ranks' leak reports, for the test's own verdict at its teardown."""
    found = [outcome.leak for outcome in outcomes if outcome.leak is not None]
    if found:
        from pytest_cuda.leaks.checker import add_rank_reports

        add_rank_reports(item, found)


def _add_sections(item: pytest.Item, outcomes: list[RankOutcome], when: str = "call") -> None:
    for outcome in outcomes:
        if outcome.stdout:
            item.add_report_section(when, f"stdout ({outcome.who()})", outcome.stdout)
        if outcome.stderr:
            item.add_report_section(when, f"stderr ({outcome.who()})", outcome.stderr)


def _warn(item: pytest.Item, outcomes: list[RankOutcome]) -> None:
    """A rank's warnings, raised again here so pytest's summary shows them: each one
    (category, message, file and line) once a session, naming the ranks that raised it.
    Every rank process imports torch, and a fresh one imports it again: its import
    warnings ("Failed to initialize NumPy") are one warning, not one per rank start."""
    relayed = item.config.stash.setdefault(_RELAYED, set())
    ranks: dict[tuple[str, str, str, int], list[int]] = {}
    for outcome in outcomes:
        for category_name, message, filename, lineno in outcome.warnings:
            key = (category_name, message, filename, lineno)
            if key not in relayed:
                ranks.setdefault(key, []).append(outcome.rank)
    for key, raised_by in ranks.items():
        relayed.add(key)
        category_name, message, filename, lineno = key
        names = ", ".join(str(rank) for rank in sorted(set(raised_by)))
        who = f"rank {names}" if len(set(raised_by)) == 1 else f"ranks {names}"
        category: Any = getattr(builtins, category_name, None)
        text = f"{who}: {message}"
        if not (isinstance(category, type) and issubclass(category, Warning)):
            category = UserWarning
            text = f"{who}: {category_name}: {message}"
        warnings.warn_explicit(text, category, filename, lineno, module=item.name)
