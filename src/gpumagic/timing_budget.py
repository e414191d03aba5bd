"""How ``%cudatime`` spends its budget (``--budget``: 1 s by default, from the end of the
first call) and what it says about it.

The budget has four parts, in this order:

1. **warm-up and sizing**: a quarter of it (:data:`WARMUP_SHARE`); a warm-up batch that
   could end past the share is not started;
2. **the counters' set-up**, outside the budget: the first count of a process loads what
   torch's dispatch needs (several hundred modules, seconds on some machines), once a
   session like the first call, so it does not take the runs' time; timed on its own
   (here when the warm-up's estimate says the counting call fits, else just before it)
   and said when it is long;
3. **the runs**: a run starts only before the budget, less the counting call's
   reserve, is spent, so the measurement ends within its budget plus one run (the
   fewest runs, 3, are made while they fit; one always is);
4. **the counting call**: one more call of the body, its time reserved before the runs
   (at most :data:`COUNT_SHARE` of the budget); left out when, by the runs' median, it
   would take more than that share and more than :data:`COUNT_ALWAYS` (a call that
   short is always made: a small ``--budget`` keeps its counts).

Pure: takes times, returns decisions and sentences; no clock, no CUDA, no IPython.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpumagic.units import format_time

__all__ = [
    "COUNT_ALWAYS",
    "COUNT_SHARE",
    "WARMUP_SHARE",
    "BudgetSpent",
    "count_estimate",
    "count_reserve",
    "count_skipped",
    "format_wait",
    "wait_note",
]

WARMUP_SHARE = 0.25  # of the budget, for warm-up and sizing
COUNT_SHARE = 0.25  # of the budget, at most, for the counting call (its estimate)
COUNT_ALWAYS = 0.1  # seconds: a counting call estimated this short is always made
COUNT_CALLS = 2.0  # the counting call's estimate, in calls of the body (the counters' cost)
WORTH_SAYING = 0.10  # a counting phase over this share of the budget is said
LONG_WAIT = 5.0  # seconds past the budget: the runs' expected length is said first
FEWEST_SAID = 7  # fewer runs than this (as MIN_RUNS): the note says where the budget went


@dataclass(frozen=True)
class BudgetSpent:
    """Where a measurement's time went after its first call, in host seconds."""

    #: The budget (``--budget``).
    budget: float
    #: Warm-up, calibration and sizing, runs started over after a resize included.
    warmup: float
    #: The runs kept.
    runs: float
    #: The counting call and, at the first count of a process, the counters' set-up;
    #: 0 when no count was made.
    count: float = 0.0
    #: The part of :attr:`count` that set up the counters (the first count of a process).
    count_setup: float = 0.0
    #: Why the counting call was left out; empty when it was made or not asked for.
    count_skipped: str = ""

    @property
    def total(self) -> float:
        """The whole measurement after the first call."""
        return self.warmup + self.runs + self.count

    @property
    def in_budget(self) -> float:
        """What the budget covers: :attr:`total` less the counters' set-up."""
        return self.total - self.count_setup

    @property
    def warmup_over(self) -> bool:
        """Whether warm-up and sizing took more than their share of the budget."""
        return self.warmup > WARMUP_SHARE * self.budget

    def note(self, runs: int, run_length: float, *, runs_fixed: bool) -> str | None:
        """One line on where the budget went, when it matters: fewer than 7 runs fit
        (``runs_fixed``: ``-r`` chose them), warm-up and sizing ran over their share, or
        counting took a noticeable part; then the counters' set-up when it was long (it
        is outside the budget); ``None`` when there is nothing to say."""
        warmup = f"warm-up and sizing took {format_time(self.warmup)}"
        if self.warmup_over:
            warmup += f" (their share is {format_time(WARMUP_SHARE * self.budget)})"
        counted = self.count - self.count_setup
        count = ""
        if counted > WORTH_SAYING * self.budget:
            count = f"counting FLOPs and bytes took {format_time(counted)}"
        setup = ""
        if self.count_setup > WORTH_SAYING * self.budget:
            setup = (
                f"Loading torch's counters took {format_time(self.count_setup)}, once a "
                "session and outside the budget (--no-count skips it)."
            )
        budget = f"the budget of {self.budget:g} s (--budget)"
        if runs < FEWEST_SAID and not runs_fixed:
            said = f"Only {runs} run{'s' if runs != 1 else ''} fit in {budget}: {warmup}, "
            said += f"{count}, " if count else ""
            said += f"then a run took {format_time(run_length)}."
            return f"{said} {setup}" if setup else said
        parts = [warmup] if self.warmup_over else []
        parts += [count] if count else []
        said = f"Of {budget}, " + "; ".join(parts) + "." if parts else ""
        return " ".join(filter(None, (said, setup))) or None


def count_estimate(per_loop: float) -> float:
    """Seconds the counting call is expected to take, from the body's time per loop."""
    return COUNT_CALLS * per_loop


def count_reserve(estimate: float, budget: float) -> float:
    """Seconds kept from the runs for the counting call: its estimate, at most its share."""
    return min(estimate, COUNT_SHARE * budget)


def count_skipped(estimate: float, budget: float) -> str:
    """Why the counting call is left out (``estimate`` seconds do not fit its share of
    ``budget``, and it is not short enough to make anyway); empty when it is made."""
    if estimate <= max(COUNT_SHARE * budget, COUNT_ALWAYS):
        return ""
    room = math.ceil(estimate / COUNT_SHARE)
    return (
        f"FLOPs and bytes not counted: one more call (about {format_time(estimate)}) does "
        f"not fit in the budget of {budget:g} s; --budget {room} makes room for it, or give "
        "--flops and --bytes"
    )


def format_wait(seconds: float) -> str:
    """A long wait in words: ``40 s``, ``3 min 20 s``, ``2.5 h``, ``3.1 days``."""
    if seconds < 59.5:
        return f"{seconds:.0f} s"
    if seconds < 600:
        minutes, rest = divmod(round(seconds), 60)
        return f"{minutes} min" + (f" {rest} s" if rest else "")
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def wait_note(per_loop: float, loops: int, repeat: int | None, left: float) -> str | None:
    """What to say before runs expected to end over :data:`LONG_WAIT` seconds past the
    budget (``left`` seconds of it remain): ``about 17 min for 1 run of 100,000,000
    loops; Ctrl-C stops with what has run``. ``repeat``: ``-r``, else runs until the
    budget is spent (one at least)."""
    one = per_loop * loops
    if not one > 0:
        return None
    runs = repeat if repeat is not None else max(1, math.ceil(left / one))
    if runs * one - left <= LONG_WAIT:
        return None
    return (
        f"about {format_wait(runs * one)} for {runs:,} run{'s' if runs != 1 else ''} of "
        f"{loops:,} loop{'s' if loops != 1 else ''} ({format_time(per_loop)} per loop in "
        "the warm-up); Ctrl-C stops with what has run"
    )
