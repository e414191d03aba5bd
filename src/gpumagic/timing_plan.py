"""What ``%cudatime`` asks for and decides: its options, and the pure rules the engine
(:mod:`gpumagic.timing`) follows: how long a run is, when to stop, what to warn about,
and the verdict.

Pure: no CUDA, no clock, no IPython. Every function takes what it decides on and
returns its decision, so each rule is tested on numbers alone.
"""

from __future__ import annotations

import itertools
import math
import operator
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gpumagic.timing_result import FIRST_CALL_WARNING, IQR_RUNS, TIMES
from gpumagic.units import format_time, quantile

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from gpumagic.timing_result import CudaTimeResult

__all__ = [
    "CLOCK_OUTLIER_CHOICES",
    "FEWEST_RUNS",
    "MIN_RUNS",
    "TIMERS",
    "Body",
    "Loops",
    "Run",
    "TimingOptions",
    "block_target",
    "enough_runs",
    "loops_for",
    "rel_iqr",
    "side_work",
    "unroll_for",
    "verdict",
    "warnings_for",
]

SIDE_WORK_MIN = 100e-6  # a device sync this much slower than when idle: side-stream work
SIDE_WORK_SHARE = 0.05  # ... and at least this share of the timed streams' time
MIN_RUNS = 7  # runs before the noise criterion may stop a measurement (as %timeit's 7)
MIN_COLD_RUNS = 15  # single cold calls vary more: more of them before the noise stop
DRIFT = 0.05  # warn when the first run was this much faster than the later ones
FEWEST_RUNS = 3  # runs measured while they fit in the budget (one always is)
NOISE_TARGET = 0.01  # stop when IQR / median of the runs is below this
NOISE_CHECKS = 100  # runs after which the spread is checked every run; then less often
COLD_NOISE_TARGET = 0.02  # single cold calls vary more
NOISY = 0.10  # warn above this relative IQR (torch.utils.benchmark uses 10 %)
FLOOR_FACTOR = 5  # warn when the result is within this many timing floors
FIRST_CALL_FACTOR = FIRST_CALL_WARNING  # warn when the first call took this many times longer
GRAPH_REPLAY_TARGET = 2e-3  # GPU seconds per graph replay, for the unroll factor
GRAPH_MAX_UNROLL = 256
MAX_COUNT = sys.maxsize  # loops, runs and warm-up calls Python can count in one loop
MAX_PRECISION = 17  # significant digits a float holds
CUDA_OPTIONS = ("cold", "graph", "kernels", "validate", "sync_check")
TIMERS = ("events", "cupti")
CLOCK_OUTLIER_CHOICES = ("keep", "drop")


class Body(Protocol):
    """The timed code: ``body(n)`` runs it ``n`` times back to back."""

    def __call__(self, n: int, /) -> object: ...


class Loops:
    """A :class:`Body` from ``each``, a function that calls the body once for each item
    of the iterator it is given (``%timeit``'s template): ``loops(n)`` gives it ``n``
    items, and :meth:`started` says how many it took, so a run cut short by Ctrl-C
    still says how many loops it made (the iterator counts them, at no cost per loop)."""

    def __init__(self, each: Callable[[Iterator[None]], object]) -> None:
        self._each = each
        self._n = 0
        self._left: Iterator[None] = iter(())

    def __call__(self, n: int, /) -> None:
        self._n = n
        self._left = itertools.repeat(None, n)
        self._each(self._left)

    def started(self) -> int:
        """Loops the last call started (the one Ctrl-C cut short among them)."""
        return self._n - operator.length_hint(self._left)


@dataclass(frozen=True)
class TimingOptions:
    """What ``%cudatime``'s options ask for. ``ValueError`` names a bad value."""

    #: Calls of the body per run (``-n``); ``None``: sized to the budget.
    loops: int | None = None
    #: Runs (``-r``); ``None``: until the spread is small or the budget is spent.
    repeat: int | None = None
    #: Warm-up calls (``-w``); ``None``: until two batches agree within 10 %.
    warmup: int | None = None
    #: Seconds for warm-up and runs, after the first call (``--budget``).
    budget: float = 1.0
    #: Significant digits shown (``-p``).
    precision: int = 3
    #: Flush the L2 cache before each call and time single calls (``--cold``).
    cold: bool = False
    #: Capture the body in a CUDA graph and time its replays (``--graph``).
    graph: bool = False
    #: CUPTI kernel time, busy fraction and verdict (``--kernels``).
    kernels: bool = False
    #: Also compare the events with CUPTI for the same loops (``--validate``).
    validate: bool = False
    #: Count and place the body's host synchronizations (``--sync-check``).
    sync_check: bool = False
    #: The GPU to time on (``--device N``); ``None``: the current device.
    device: int | None = None
    #: Time on the host even with a GPU (``--device cpu``).
    host_only: bool = False
    #: FLOPs per loop (``--flops``); ``None``: counted.
    flops: float | None = None
    #: Bytes moved per loop (``--bytes``); ``None``: counted.
    bytes: float | None = None
    #: Whether to count FLOPs and bytes in one more call (``--no-count``: no).
    count: bool = True
    #: The headline's clock (``--timer``): ``"events"`` (CUDA events around runs of
    #: back-to-back loops) or ``"cupti"`` (CUPTI's kernel time of profiled runs of the
    #: same loops, the events shown beside it).
    timer: str = "events"
    #: Runs whose SM clock was far off the median clock (``--clock-outliers``):
    #: ``"keep"`` them in the numbers (a note names them) or ``"drop"`` them.
    clock_outliers: str = "keep"
    #: ``--device`` as the user typed it (``cuda:1``, ``cuda``), for messages; ``None``
    #: when not given.
    device_spec: str | None = None

    def __post_init__(self) -> None:
        for name, low, high in (
            ("loops", 1, MAX_COUNT),
            ("repeat", 1, MAX_COUNT),
            ("warmup", 0, MAX_COUNT),
            ("precision", 1, MAX_PRECISION),
        ):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name} must be at least {low}, got {value}")
            if value is not None and value > high:
                raise ValueError(f"{name} must be at most {high:,}, got {value:,}")
        if not (self.budget > 0 and math.isfinite(self.budget)):
            raise ValueError(f"the budget must be a positive number of seconds, got {self.budget}")
        for name in ("flops", "bytes"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, got {value}")
        if self.device is not None and self.device < 0:
            raise ValueError(f"the device index must be 0 or more, got {self.device}")
        for name, choices in (("timer", TIMERS), ("clock_outliers", CLOCK_OUTLIER_CHOICES)):
            value = getattr(self, name)
            if value not in choices:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} takes {' or '.join(choices)}, not {value!r}")

    def cuda_only(self) -> list[str]:
        """The options given that need CUDA, as the user typed them."""
        given = ["--" + n.replace("_", "-") for n in CUDA_OPTIONS if getattr(self, n)]
        if self.timer != "events":
            given.append(f"--timer {self.timer}")
        if self.clock_outliers != "keep":
            given.append(f"--clock-outliers {self.clock_outliers}")
        if not self.host_only and (self.device is not None or self.device_spec):
            given.append(f"--device {self.device_spec or self.device}")
        return given


@dataclass(frozen=True)
class Run:
    """One run: ``loops`` calls; times in seconds for the whole run."""

    #: Calls of the body in this run.
    loops: int
    #: GPU seconds of the run from CUDA events (``nan`` on the host).
    gpu: float
    #: Host wall seconds of the run, devices synchronized.
    host: float
    #: Host seconds until the last call returned (launching, for GPU work).
    enqueue: float
    # Host seconds from the timed streams' end (polled, so no wake-up latency) to the
    # devices' idle: other streams' work the timed streams did not wait for.
    #: Host seconds from the timed streams' end to the devices' idle.
    tail: float = 0.0
    #: The SM clock in MHz read right after the run; ``None`` when not read.
    sm_mhz: int | None = None
    #: NVML's clocks event reasons read with it (a bit mask); ``None`` when not read.
    clock_reasons: int | None = None

    @property
    def per_loop(self) -> float:
        """The longer of the two clocks, per loop (the GPU's is NaN on the host)."""
        gpu = 0.0 if math.isnan(self.gpu) else self.gpu
        return max(self.host, gpu) / max(self.loops, 1)


# -- sizing ----------------------------------------------------------------------------


def block_target(budget: float) -> float:
    """Seconds one run should take: 1/25 of the budget, within 2 ms and 250 ms."""
    return min(max(budget / 25, 2e-3), 0.25)


def unroll_for(per_loop: float) -> int:
    """Loops captured in one CUDA graph, so a replay takes about 2 ms."""
    if per_loop <= 0:
        return GRAPH_MAX_UNROLL
    return max(1, min(GRAPH_MAX_UNROLL, math.ceil(GRAPH_REPLAY_TARGET / per_loop)))


def loops_for(options: TimingOptions, per_loop: float, unroll: int) -> tuple[int, str | None]:
    """Loops per run (``-n``, or enough for :func:`block_target`), a multiple of
    ``unroll``; and a note when ``-n`` had to be rounded up to one."""
    if options.loops is not None:
        loops = options.loops
    else:
        target = block_target(options.budget)
        loops = max(1, round(target / per_loop)) if per_loop > 0 else 1000
    note = None
    if loops % unroll:
        loops += unroll - loops % unroll
        if options.loops is not None:
            note = f"-n rounded up to {loops}, a multiple of the {unroll} loops in the graph"
    return loops, note


# -- stopping --------------------------------------------------------------------------


def rel_iqr(values: Sequence[float]) -> float:
    """IQR / median; infinite when the median is not positive."""
    median = quantile(values, 0.5)
    if not median > 0:
        return math.inf
    return (quantile(values, 0.75) - quantile(values, 0.25)) / median


def enough_runs(
    options: TimingOptions, values: Sequence[float], *, now: float, next_run: float, deadline: float
) -> bool:
    """Whether to stop after these runs (``values``: their primary clock): ``-r`` runs
    done; or enough runs with a relative IQR under the noise target; or the ``deadline``
    has passed (a run started before it was the last: the budget holds to one run); or
    the next run (taking ``next_run`` seconds from ``now``) would end after it and the
    fewest runs are in."""
    count = len(values)
    if options.repeat is not None:
        return count >= options.repeat
    if count and now >= deadline:
        return True
    if count >= FEWEST_RUNS and now + next_run > deadline:
        return True
    noise = COLD_NOISE_TARGET if options.cold else NOISE_TARGET
    fewest = MIN_COLD_RUNS if options.cold else MIN_RUNS
    return count >= fewest and _noise_due(count) and rel_iqr(values) <= noise


def _noise_due(count: int) -> bool:
    """Whether to compute the spread after ``count`` runs: after each of the first
    ``NOISE_CHECKS``, then every ``count // NOISE_CHECKS`` runs, so that many short runs
    (``-n 1``) cost O(n log n) in all, not a sort of every run so far after each one."""
    return count <= NOISE_CHECKS or count % (count // NOISE_CHECKS) == 0


def side_work(runs: Sequence[Run], baseline_tail: float) -> list[float] | None:
    """Per-run GPU time through the devices' idle, if most runs left work on other
    streams that the timed streams did not wait for; else ``None``.

    Once the timed streams have passed their end events, a device sync returns after
    its usual latency (``baseline_tail``, measured on idle devices) unless other
    streams still run. Work the timed streams waited for (a joined side stream,
    cuBLAS's memset and GEMM) ends before the end events and adds nothing; a few tens
    of microseconds of host noise are not side work, hence the margin.
    """
    flagged = 0
    extra = []
    for r in runs:
        late = r.tail - baseline_tail
        if late > max(SIDE_WORK_MIN, SIDE_WORK_SHARE * r.gpu):
            flagged += 1
        extra.append(max(0.0, late))
    if flagged * 2 <= len(runs):
        return None
    return [r.gpu + e for r, e in zip(runs, extra, strict=True)]


# -- what to tell the user -------------------------------------------------------------


def warnings_for(result: CudaTimeResult) -> list[str]:
    """Spread, a slow first call, a fast first run, a result near the timing floor."""
    warn = []
    gpu = result.clock == "gpu"
    if result.repeat >= 3 and result.rel_iqr > NOISY:
        causes = (
            "other work on the GPU or host, clock changes, or work that varies between calls"
            if gpu
            else "other work on this machine, or work that varies between calls"
        )
        # Under 5 runs no IQR is shown: the warning names what is (min and max).
        spread = (
            f"IQR is {result.rel_iqr * 100:.0f} % of the median"
            if result.repeat >= IQR_RUNS
            else f"the runs span {(result.worst - result.best) / result.median * 100:.0f} % of "
            "the median"
        )
        warn.append(f"the spread is large: {spread} ({causes})")
    steady = result.host_time
    first = result.first_call
    if first is not None and first > 1e-3 and first > FIRST_CALL_FACTOR * steady:
        causes = (
            "compilation, autotuning, cuBLAS heuristics or lazy loading"
            if gpu
            else "imports, caches being filled, compilation or lazy initialisation"
        )
        warn.append(
            f"the first call took {format_time(first)}, {first / steady:,.0f}{TIMES} the "
            f"steady state ({causes}); it is not in the numbers"
        )
    values = result.timings
    if len(values) >= 5:
        later = quantile(values[len(values) // 2 :], 0.5)
        if later > 0 and (later - values[0]) / later > DRIFT:
            why = (
                "clocks drop under sustained load (power or thermal limits) and recover "
                "after idling; the median describes the sustained state"
                if gpu
                else "the body got slower as it ran (data or caches that grow, other work on "
                "this machine); the median describes the later runs"
            )
            warn.append(
                f"the first run was {(later - values[0]) / later * 100:.0f} % faster than the "
                f"later ones: {why}"
            )
    if result.floor and result.median < FLOOR_FACTOR * result.floor:
        warn.append(
            f"the time per loop is within {FLOOR_FACTOR}{TIMES} of the timing floor "
            f"({format_time(result.floor)} per loop here): use more loops (-n)"
            + (" or --graph" if result.clock == "gpu" and result.mode == "eager" else "")
        )
    return warn


def verdict(
    result: CudaTimeResult, runs: Sequence[Run], *, gpu_work: bool = True
) -> tuple[str, str | None]:
    """``(verdict, note)`` for a finished measurement (either may be empty).

    ``gpu_work=False``: the body never initialised CUDA. With kernel figures
    (``--kernels``), how busy the GPU was decides; for an eager GPU measurement without
    them, a host that spent most of the wall time launching gets a note.
    """
    if not gpu_work:
        return "no GPU work was launched", None
    if result.kernel_time is not None:
        busy = result.busy_fraction or 0.0
        if result.kernel_time == 0:
            return "no GPU work was launched (CPU tensors?)", None
        if busy >= 0.8:
            return f"GPU-bound: GPU busy {busy * 100:.0f} % of wall time", None
        if busy < 0.5:
            return f"launch/CPU-bound: GPU busy {busy * 100:.0f} % of wall time", None
        return f"partly launch/CPU-bound: GPU busy {busy * 100:.0f} % of wall time", None
    if result.clock != "gpu" or result.mode != "eager" or not runs:
        return "", None
    launching = quantile([r.enqueue / r.host for r in runs if r.host > 0], 0.5)
    if launching >= 0.9:
        return "", (
            f"The host spent {launching * 100:.0f} % of the wall time launching: likely "
            "launch/CPU-bound (the GPU waits for the host); --kernels measures how busy "
            "the GPU was."
        )
    return "", None
