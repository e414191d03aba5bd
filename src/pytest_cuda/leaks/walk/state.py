"""What the holder walk carries (:mod:`pytest_cuda.leaks.walk.holders`): a leaked storage
and where its walk got, a node of the walk, the walk's time limit, the boundary of the
heap the caller froze, and where a walk ended at an object only C++ holds. Pure Python.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pytest_cuda.leaks.walk.paths import Step, render
from pytest_cuda.leaks.walk.roots import held_from_outside
from pytest_cuda.leaks.walk.young import counts_references

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["OUTSIDE", "Boundary", "Budget", "Node", "Target", "end_path", "ended"]

#: The kind of a path that starts at an object no Python object refers to.
OUTSIDE = "no Python root: C++ holds where the path starts"


@dataclass(slots=True)
class Target:
    """One leaked storage: a tensor that shows it, its size and device."""

    obj: object
    key: tuple[str, int]
    nbytes: int
    device: str
    tensors: int = 1
    #: Other tensors that show the storage (a view and its base): walked from too, as
    #: one of them may be held from Python while only C++ holds the other.
    others: list[object] = field(default_factory=list)
    path: str = ""
    kind: str = ""
    note: str = ""
    alive: bool = False
    #: Where its walk ended at an object no Python object refers to: (rank, depth,
    #: that object named, the steps down from it), the best one (see :func:`ended`).
    end: tuple[int, int, str, list[Step]] | None = None
    #: Which of its tensors (``obj`` or one of ``others``) the path starts at.
    origin: object = None


class Budget:
    """The walk's time limit: ``spent()`` once it is over (never, without a limit)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds, self.ran_out = seconds, False
        self.deadline = None if seconds is None else time.perf_counter() + seconds

    def spent(self) -> bool:
        self.ran_out = self.ran_out or (
            self.deadline is not None and time.perf_counter() > self.deadline
        )
        return self.ran_out


class Boundary:
    """The older heap the caller froze: while ``young``, :func:`gc.get_referrers` sees
    only the test's objects; :meth:`thaw` once, before the whole heap is scanned."""

    def __init__(self, thaw: Callable[[], None] | None) -> None:
        self._thaw = thaw
        self.young = thaw is not None and counts_references()
        if not self.young:
            self.thaw()  # the references cannot be counted here: scan the whole heap

    def thaw(self) -> None:
        self.young = False
        if self._thaw is not None:
            thaw, self._thaw = self._thaw, None
            thaw()


@dataclass(slots=True)
class Node:
    obj: object
    steps: list[Step]
    target: Target
    through: set[str] = field(default_factory=set)
    #: The target's tensor this walk started from.
    origin: object = None


def ended(node: Node) -> None:
    """``node``'s object is alive and no Python object refers to it: keep it as where
    its target's walk ended, if it says more than the end kept (a recognised holder,
    else the nearest)."""
    rank, named = held_from_outside(node.obj)
    end = (rank, len(node.steps), named, node.steps)
    if node.target.end is None or end[:2] < node.target.end[:2]:
        node.target.end = end


def end_path(target: Target) -> str:
    """The path from where the target's walk ended, or ``""`` when it met no end."""
    return "" if target.end is None else render(target.end[2], target.end[3])
