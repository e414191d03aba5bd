"""Whether two sets of runs differ beyond their noise: a distribution-free interval for
the ratio of their typical times.

The method is the Mann-Whitney rank test's interval (Hodges-Lehmann, exact): on the
log of each run's per-loop time, the ``m * n`` differences between a run of one set
and a run of the other, sorted, give the interval ``[d(k), d(mn - k + 1)]``, where
``k`` is the largest count for which the rank test's null distribution puts at most
half of ``1 - LEVEL`` below ``k``. It assumes only that runs are independent draws of
each set's timing; no normality, no bootstrap seed. Few runs give a wide (or no)
interval, not a false verdict: 5 runs each is the fewest that reach the level.

Runs of one call are not independent of the call, though: two back-to-back calls of
the same body drift apart by about the spread of their own runs. So the interval is
then widened, at both ends, by the larger interquartile range over the median of the
two sets: a difference within that noise is not called a difference.

Pure: no torch, no IPython.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumagic.units import quantile

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["LEVEL", "RatioInterval", "ratio_interval"]

#: Confidence of the interval. 99 %, not 95 %: at 95 % one identical pair in 20 would
#: still be called different, and users compare many pairs.
LEVEL = 0.99
#: Runs of each set beyond which evenly spaced quantiles of it stand in (the interval
#: only widens: fewer runs are counted).
MAX_RUNS = 400
#: Up to this many runs in all the rank test's null distribution is counted exactly;
#: beyond, its normal approximation (with continuity correction) is used.
EXACT_UP_TO = 60


@dataclass(frozen=True)
class RatioInterval:
    """An interval for ``a / b``, the ratio of two sets' typical per-loop times."""

    #: Lower end; ``0.0`` when the runs are too few to bound it.
    low: float
    #: Upper end; ``inf`` when the runs are too few to bound it.
    high: float
    #: Its confidence (:data:`LEVEL`).
    level: float = LEVEL

    @property
    def bounded(self) -> bool:
        """Whether the runs were enough for a finite interval."""
        return self.low > 0 and math.isfinite(self.high)

    @property
    def holds_one(self) -> bool:
        """Whether ``a`` and ``b`` may take the same time: no difference within the noise."""
        return self.low <= 1.0 <= self.high

    def text(self) -> str:
        """``"0.97-1.04x"`` (en dash, times sign), or ``"n/a"`` when unbounded."""
        if not self.bounded:
            return "n/a"
        return f"{_ratio(self.low)}\u2013{_ratio(self.high)}\u00d7"


def _ratio(value: float) -> str:
    return f"{value:.3g}" if value < 100 else f"{value:,.0f}"


def ratio_interval(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> RatioInterval:
    """The interval at ``level`` for the ratio of ``a``'s typical value to ``b``'s.

    ``a`` and ``b`` are per-loop times of runs (positive). ``ValueError`` for an empty
    set or a time that is not positive and finite.
    """
    for name, values in (("a", a), ("b", b)):
        if not values:
            raise ValueError(f"ratio_interval: {name} has no runs")
        if not all(v > 0 and math.isfinite(v) for v in values):
            raise ValueError(f"ratio_interval: {name} has a time that is not positive")
    logs_a = [math.log(v) for v in _thinned(a)]
    logs_b = [math.log(v) for v in _thinned(b)]
    m, n = len(logs_a), len(logs_b)
    k = _rank_cutoff(m, n, (1 - level) / 2)
    if k < 1:
        return RatioInterval(0.0, math.inf, level)
    differences = sorted(x - y for x in logs_a for y in logs_b)
    # Runs within one call are not independent of the call: back-to-back calls of the
    # same body drift apart by about the spread each shows. Widened by that spread, a
    # difference smaller than the noise is not called one (issue 39).
    drift = 1 + max(_spread(a), _spread(b))
    low, high = math.exp(differences[k - 1]), math.exp(differences[m * n - k])
    return RatioInterval(low / drift, high * drift, level)


def _spread(values: Sequence[float]) -> float:
    """The interquartile range over the median."""
    median = quantile(values, 0.5)
    return (quantile(values, 0.75) - quantile(values, 0.25)) / median


def _thinned(values: Sequence[float]) -> list[float]:
    if len(values) <= MAX_RUNS:
        return list(values)
    return [quantile(values, i / (MAX_RUNS - 1)) for i in range(MAX_RUNS)]


def _rank_cutoff(m: int, n: int, tail: float) -> int:
    """The largest ``k`` with P(U < k) <= ``tail`` under the rank test's null hypothesis
    (``U``: Mann-Whitney's count of pairs with the first set's value below)."""
    if m + n <= EXACT_UP_TO:
        counts = _u_counts(m, n)
        total = math.comb(m + n, m)
        below = 0
        for k, count in enumerate(counts):
            if below + count > tail * total:
                return k
            below += count
        return len(counts)
    mean = m * n / 2
    sd = math.sqrt(m * n * (m + n + 1) / 12)
    # P(U <= k - 1) ~ Phi((k - 1 + 0.5 - mean) / sd) <= tail
    z = _normal_quantile(tail)
    return max(0, math.floor(mean + z * sd + 0.5))


def _u_counts(m: int, n: int) -> list[int]:
    """How many of the ``C(m + n, m)`` orderings give ``U = 0, 1, ..., m * n``."""
    # previous[j][u]: orderings of i - 1 values of the first set and j of the second.
    previous = [[1] for _ in range(n + 1)]  # no values of the first set: U = 0
    for _ in range(m):
        current = [[1]]  # j = 0
        for j in range(1, n + 1):
            # The largest value is from the first set (adds j to U) or the second.
            with_first = [0] * j + previous[j]
            with_second = current[j - 1]
            size = max(len(with_first), len(with_second))
            current.append(
                [
                    (with_first[u] if u < len(with_first) else 0)
                    + (with_second[u] if u < len(with_second) else 0)
                    for u in range(size)
                ]
            )
        previous = current
    return previous[n]


def _normal_quantile(p: float) -> float:
    """The standard normal's ``p`` quantile (bisection on ``erfc``; ``p`` in (0, 1))."""
    low, high = -40.0, 40.0
    for _ in range(200):
        mid = (low + high) / 2
        if 0.5 * math.erfc(-mid / math.sqrt(2)) < p:
            low = mid
        else:
            high = mid
    return (low + high) / 2
