"""A host clock for timing tests that advances only when told to (tests only).

Swapped in for ``gpumagic.timing``'s clock (``monkeypatch.setattr(timing, "time",
clock)``), it makes the engine's sizing, stopping and statistics exact however loaded
the machine is: a body made with :meth:`FakeClock.body` takes exactly its time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable


class FakeClock:
    """A host clock that advances only when told to: timing logic without load noise."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def body(self, seconds: float) -> Callable[[], None]:
        """A body that takes exactly ``seconds`` on this clock."""

        def run() -> None:
            self.advance(seconds)

        return run
