"""Multi-rank tests: the ``cuda_distributed`` marker, a rank's identity, and the report.

Pure logic (no torch; pytest only for a stash key): the plugin
(:mod:`pytest_cuda.distributed.plugin`) parses the marker here, the launcher
(:mod:`pytest_cuda.distributed.launch`) collects one :class:`RankOutcome` per rank, and
:func:`verdict` turns them into what pytest reports.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

import pytest

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from pytest_cuda.distributed.world import LaunchedWorld

__all__ = [
    "CPU_BACKENDS",
    "FAILURE_GRACE_S",
    "LAUNCHED_WORLD",
    "MARKER",
    "RANK_DEVICES",
    "DistributedSpec",
    "RankInfo",
    "RankOutcome",
    "Verdict",
    "devices_needed",
    "parse_distributed_marker",
    "rank_devices",
    "verdict",
]

MARKER = "cuda_distributed"
KEYWORDS = ("world_size", "backend", "timeout", "fresh_group", "isolate")
#: Backends whose ranks run on the CPU: they need no GPU, so CI can run them.
CPU_BACKENDS = frozenset({"gloo", "mpi"})
#: How much of each rank's output and stack a report shows (the end of it).
MAX_TEXT_LINES = 60
#: After a rank fails, how long the others may take to finish before they are stopped.
FAILURE_GRACE_S = 5.0
#: A rank seen dead is the headline over a rank that failed less than this before the
#: launcher saw the death: the survivor's error (gloo's "Connection reset by peer")
#: comes within milliseconds of a peer's death, before the launcher's next look.
DEATH_MARGIN_S = 0.5

#: The device index of each rank, stashed on a test by the device check before it runs.
RANK_DEVICES = pytest.StashKey[tuple[int, ...]]()
#: This process's place in a launched run (``--cuda-ranks=env``), stashed on the config.
LAUNCHED_WORLD: pytest.StashKey[LaunchedWorld] = pytest.StashKey()

State = Literal["passed", "failed", "skipped", "xfailed", "stopped", "exited"]


@dataclass(frozen=True)
class DistributedSpec:
    """``cuda_distributed(world_size=2, backend="nccl", timeout=60, fresh_group=False,
    isolate=False)``; ``backend`` in lower case, as torch compares it."""

    #: How many rank processes run the test.
    world_size: int = 2
    #: The process group's backend (``"nccl"``, ``"gloo"``...).
    backend: str = "nccl"
    #: Seconds the test may take on its ranks before they are stopped and their stacks
    #: shown.
    timeout: float = 60.0
    #: Build the process group for this test and destroy it after (warm ranks).
    fresh_group: bool = False
    #: Run this test in fresh rank processes of its own, not the warm ones.
    isolate: bool = False

    @property
    def uses_cuda(self) -> bool:
        """Whether each rank gets a CUDA device of its own (every backend but gloo/mpi)."""
        return self.backend.split(":")[0] not in CPU_BACKENDS or "cuda:" in self.backend


def parse_distributed_marker(
    args: Sequence[object], kwargs: Mapping[str, object]
) -> DistributedSpec:
    """The marker's arguments → a spec; :class:`ValueError` says which one is wrong."""
    # Imported here: the plugin imports this module on every run, CUDA tests or not.
    from pytest_cuda.markers import check_keywords

    check_keywords(args, kwargs, KEYWORDS)
    size = kwargs.get("world_size", 2)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"world_size must be a positive integer, got {size!r}")
    backend = kwargs.get("backend", "nccl")
    if not isinstance(backend, str) or not backend.strip():
        raise ValueError(f'backend must be a name such as "nccl" or "gloo", got {backend!r}')
    timeout = kwargs.get("timeout", 60)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    switches = {name: kwargs.get(name, False) for name in ("fresh_group", "isolate")}
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    return DistributedSpec(
        size,
        backend.strip().lower(),
        float(timeout),
        fresh_group=bool(switches["fresh_group"]),
        isolate=bool(switches["isolate"]),
    )


def devices_needed(config: pytest.Config, spec: DistributedSpec) -> int:
    """How many selected devices this process needs for a test's ranks: one per rank,
    or, in a launched run, its local rank's (the others are other processes')."""
    world = config.stash.get(LAUNCHED_WORLD, None)
    return spec.world_size if world is None else world.local_rank + 1


def rank_devices(
    config: pytest.Config, spec: DistributedSpec, selected: Sequence[int]
) -> tuple[int, ...]:
    """The device of each rank, from the ``selected`` device indices; in a launched
    run, this process's own rank's, its local rank's device (at every rank's place:
    the others' are on their own processes)."""
    world = config.stash.get(LAUNCHED_WORLD, None)
    if world is None:
        return tuple(selected[: spec.world_size])
    return (selected[world.local_rank],) * spec.world_size


@dataclass(frozen=True)
class RankInfo:
    """What the ``cuda_rank`` fixture gives each rank of a ``cuda_distributed`` test.

    ``device`` is the rank's own ``torch.device`` (``cuda:<i>``, made current; ``cpu``
    for the gloo backend) and ``group`` the default process group, initialised before
    the test and destroyed after it.
    """

    #: This rank's index, 0 to ``world_size - 1``.
    rank: int
    #: How many ranks run the test.
    world_size: int
    #: The rank's ``torch.device``.
    device: Any
    #: The process group's backend.
    backend: str
    #: The default process group of ``torch.distributed``, set up before the test.
    group: Any = None

    @property
    def is_first(self) -> bool:
        """Rank 0, the one that usually writes files or prints."""
        return self.rank == 0


@dataclass
class RankOutcome:
    """How one rank ended, read back by the launcher."""

    #: The rank's index.
    rank: int
    #: Its device (``"cuda:1"``, ``"cpu"``).
    device: str
    #: ``passed``, ``failed``, ``skipped``, ``xfailed``, ``stopped`` (by the timeout or
    #: another rank's failure) or ``exited`` (the process ended on its own).
    state: State
    #: How long its test took.
    seconds: float = 0.0
    #: Its failure or skip message.
    message: str = ""
    #: Its failure's traceback, as pytest shows it.
    traceback: str = ""
    #: The line it failed at, or was at when stopped.
    where: str = ""
    #: Its Python stack when it was stopped (a hung rank).
    stack: str = ""
    #: What it printed.
    stdout: str = ""
    #: What it wrote to stderr.
    stderr: str = ""
    #: The warnings it raised: (category, message, file, line).
    warnings: list[tuple[str, str, str, int]] = field(default_factory=list)
    #: When it ended, in seconds from the test's start.
    finished_at: float = 0.0
    #: Its test body had ended, and it was still waiting for the others when stopped.
    waiting: bool = False
    #: Whether it had started the test function (its set-up was done).
    started: bool = True
    #: What a skipped or xfailed rank left behind for the next test (its ranks were
    #: replaced), one line each.
    leftovers: list[str] = field(default_factory=list)
    #: Its leak check's report (:meth:`pytest_cuda.leaks.report.LeakReport.to_dict`),
    #: when the check applied and the test body ended well.
    leak: dict[str, Any] | None = None
    #: The host of a launched run's rank (``--cuda-ranks=env``), else empty.
    host: str = ""
    #: The node (the launcher's node rank) of a launched run's rank, else ``None``.
    node: int | None = None

    def label(self) -> str:
        """``"rank 1 (cuda:1)"``, as reports name the rank; a launched run's rank with
        its host and node, ``"rank 1 on host-b (node 1, cuda:0)"``."""
        if self.host:
            return f"rank {self.rank} on {self.host} (node {self.node}, {self.device})"
        return f"rank {self.rank} ({self.device})"

    def who(self) -> str:
        """``rank 1``; a launched run's rank, ``rank 1 on host-b (node 1)``."""
        where = f" on {self.host} (node {self.node})" if self.host else ""
        return f"rank {self.rank}{where}"

    def to_dict(self) -> dict[str, Any]:
        """As plain data (JSON), for a launched run's rank 0 to read."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankOutcome:
        """The outcome :meth:`to_dict` wrote (fields this version does not know are
        left out)."""
        known = {f.name for f in fields(cls)}
        found = {name: value for name, value in data.items() if name in known}
        found["warnings"] = [tuple(w) for w in found.get("warnings", [])]
        return cls(**found)

    @property
    def reusable(self) -> bool:
        """It ended well and left nothing behind for the next test: no state, no
        leaked memory."""
        leaked = bool(self.leak and self.leak.get("leaked"))
        return self.state in ("passed", "skipped", "xfailed") and not self.leftovers and not leaked


@dataclass(frozen=True)
class Verdict:
    """What pytest reports: ``outcome`` is passed, failed, skipped or xfailed."""

    outcome: Literal["passed", "failed", "skipped", "xfailed"]
    text: str


def _tail(text: str, lines: int = MAX_TEXT_LINES) -> str:
    kept = text.rstrip().splitlines()
    if len(kept) <= lines:
        return "\n".join(kept)
    return "\n".join([f"... ({len(kept) - lines} earlier lines left out)", *kept[-lines:]])


def _indent(text: str) -> str:
    return "\n".join(f"    {line}" if line else "" for line in text.splitlines())


def _headline(outcome: RankOutcome) -> str:
    at = f" at {outcome.where}" if outcome.where else ""
    return f"{outcome.message}{at}"


def _describe(outcome: RankOutcome, stop_reason: str, first: RankOutcome | None) -> list[str]:
    """The block of text about one rank."""
    timing = f"after {outcome.seconds:.1f} s"
    waited = f", then waited for the other ranks until {stop_reason}" if outcome.waiting else ""
    if outcome.state in ("passed", "skipped", "xfailed"):
        why = f": {outcome.message}" if outcome.state != "passed" else ""
        lines = [f"{outcome.label()}: {outcome.state} {timing}{why}{waited}"]
        return lines + _stack_lines(outcome)
    if outcome.state == "failed":
        later = ""
        if first is not None and first is not outcome:
            how = "died" if first.state == "exited" else "failed"
            later = f" (after rank {first.rank} had {how})"
        lines = [f"{outcome.label()}: failed {timing}{later}: {_headline(outcome)}"]
        if outcome.traceback:
            lines.append(_indent(_tail(outcome.traceback)))
        return lines
    if outcome.state == "exited":
        lines = [
            f"{outcome.label()}: the process ended {timing} without a result ({outcome.message})"
        ]
        if outcome.stderr:
            lines += ["  its stderr ends with:", _indent(_tail(outcome.stderr, 25))]
        return lines
    doing = "still running" if outcome.started else "still setting up (had not started the test)"
    lines = [f"{outcome.label()}: {doing} {timing}, {stop_reason}: stopped."]
    return lines + _stack_lines(outcome)


def _stack_lines(outcome: RankOutcome) -> list[str]:
    if not (outcome.waiting or outcome.state == "stopped"):
        return []
    stack = _without_runner(outcome.stack)
    if not stack:
        return ["  (no Python stack came back: the process did not answer the dump signal)"]
    return ["  Its Python stack when stopped (most recent call first):", _indent(_tail(stack))]


def _without_runner(stack: str) -> str:
    """A faulthandler dump without the frames that only start the rank."""
    here = f"{os.sep}pytest_cuda{os.sep}distributed{os.sep}"
    runner = ('File "<frozen runpy>"', f"{here}rank_main.py", f"{here}module_import.py")
    return "\n".join(line for line in stack.splitlines() if not any(r in line for r in runner))


def verdict(
    outcomes: Sequence[RankOutcome],
    spec: DistributedSpec,
    *,
    timed_out: Literal["timeout", "startup", "failure"] | None,
    name: str,
    startup_s: float = 0.0,
) -> Verdict:
    """The test's result from its ranks': the first rank to fail decides the headline;
    a timeout names the ranks that never finished; every rank's state follows."""
    failed = _first_failure_first(outcomes)
    stopped = [o for o in outcomes if o.state == "stopped"]
    if timed_out == "startup":
        names = ", ".join(o.who() for o in stopped if not o.started)
        headline = (
            f"{name}: the ranks did not all start within {startup_s:g} s (Python, torch, "
            f"CUDA and the process group's rendezvous): {names} never started the test"
        )
        stop_reason = f"the start-up limit of {startup_s:g} s ran out"
    elif timed_out == "failure":  # a launched run's rank, stopped for another's failure
        headline = f"{name}: stopped after a rank on another host failed (rank 0 reports it)"
        stop_reason = "a rank on another host failed"
    elif timed_out:
        names = ", ".join(o.who() for o in stopped) or "the ranks"
        headline = (
            f"{name}: timed out after {spec.timeout:g} s (cuda_distributed timeout): "
            f"{names} never finished"
        )
        stop_reason = f"the test's timeout of {spec.timeout:g} s ran out"
    elif failed:
        first = failed[0]
        where = f" on {first.host} (node {first.node})" if first.host else ""
        headline = (
            f"{name}: rank {first.rank} of {spec.world_size}{where} failed: {_headline(first)}"
        )
        stop_reason = f"{FAILURE_GRACE_S:g} s after rank {first.rank} failed"
    elif stopped:  # pragma: no cover - stopped ranks come with a timeout or a failure
        headline, stop_reason = f"{name}: ranks were stopped", "stopped"
    else:
        return _not_failed(outcomes)
    lines = [headline, ""]
    for outcome in sorted(outcomes, key=lambda o: o.rank):
        lines += _describe(outcome, stop_reason, failed[0] if failed else None)
    if timed_out in ("timeout", "startup"):
        lines += [
            "",
            "A rank that never joins a collective leaves the others waiting in it: the "
            "stacks above show where each rank was. Raise timeout= in the marker if the "
            "test is only slow.",
        ]
    return Verdict("failed", "\n".join(lines))


def _first_failure_first(outcomes: Sequence[RankOutcome]) -> list[RankOutcome]:
    """The failed and dead ranks, the one to blame first.

    By when each failed; but a rank that died (no result: ``os._exit``, a signal) goes
    before a rank whose error came less than :data:`DEATH_MARGIN_S` before the launcher
    saw the death, as a peer's broken connection does.
    """
    failed = sorted(
        (o for o in outcomes if o.state in ("failed", "exited")), key=lambda o: o.finished_at
    )
    dead = [o for o in failed if o.state == "exited"]
    if not dead:
        return failed
    death = dead[0]
    earlier = [
        o
        for o in failed
        if o.state == "failed" and o.finished_at < death.finished_at - DEATH_MARGIN_S
    ]
    first = earlier[0] if earlier else death
    return [first, *(o for o in failed if o is not first)]


def _not_failed(outcomes: Sequence[RankOutcome]) -> Verdict:
    """Every rank passed, skipped or xfailed: skipped (or xfailed) if any rank was,
    saying which ranks when not all of them."""
    for state in ("xfailed", "skipped"):
        ranks = [o for o in outcomes if o.state == state]
        if not ranks:
            continue
        reason = ranks[0].message
        if len(ranks) == len(outcomes):
            text = f"on every rank: {reason}" if len(outcomes) > 1 else reason
        else:
            others = ", ".join(
                f"rank {o.rank} {o.state}"
                for o in sorted(outcomes, key=lambda o: o.rank)
                if o.state != state
            )
            which = ", ".join(str(o.rank) for o in ranks)
            plural = "s" if len(ranks) > 1 else ""
            text = f"{state} on rank{plural} {which} only ({others}): {reason}"
        left = [f"rank {o.rank} left {line}" for o in outcomes for line in o.leftovers]
        if left:
            text += " [" + "; ".join(left) + "; its ranks were replaced]"
        return Verdict(state, text)
    return Verdict("passed", "")
