"""What ``%lprun`` records per profiled code object and per profiler (see
:mod:`gpumagic.lineprof`): the counters the boundary hook fills and the results read.
Pure Python: no torch, no CUDA call.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import textwrap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from line_profiler._line_profiler import label as _code_label

from gpumagic.lineprof_kernels import TraceCost

if TYPE_CHECKING:
    from types import CodeType

    from gpumagic.lineprof_attribution import GpuAttribution

__all__ = [
    "CodeInfo",
    "Label",
    "LineExtras",
    "Marks",
    "Record",
    "peak_above",
    "statement_lines",
]

Label = tuple[str, int, str]
Marks = tuple[int, int, int, int]


@dataclass
class LineExtras:
    """What gpumagic measured for one line beside line_profiler's hits and time.

    Everything is inclusive, like line_profiler's time: a line that calls a function
    also carries the synchronizing calls and allocations of that call.
    """

    syncs: int = 0
    mem_delta: int = 0
    mem_peak: int = 0
    mem_peak_bound: bool = False
    mem_hits: int = 0

    def add(self, other: LineExtras) -> None:
        """Fold ``other`` (another physical line of the same statement) into this one."""
        self.syncs += other.syncs
        self.mem_delta += other.mem_delta
        self.mem_hits += other.mem_hits
        if other.mem_peak > self.mem_peak:
            self.mem_peak, self.mem_peak_bound = other.mem_peak, other.mem_peak_bound

    def add_memory(self, starts: dict[int, Marks], ends: dict[int, Marks]) -> None:
        """One run of the line: the allocator's marks per device at its start and end."""
        delta = peak = 0
        exact = True
        for device, end in ends.items():
            start = starts.get(device, (0, 0, 0, 0))
            delta += end[0] - start[0]
            above, known = peak_above(start, end)
            peak += above
            exact = exact and known
        self.mem_delta += delta
        self.mem_hits += 1
        if peak > self.mem_peak or (peak == self.mem_peak and exact):
            self.mem_peak, self.mem_peak_bound = peak, not exact


class CodeInfo:
    """What the hook keeps per profiled code object (it outlives one session)."""

    __slots__ = ("costs", "entries", "extras", "label", "multi", "stmts", "wheres")

    def __init__(self, code: CodeType) -> None:
        self.label: Label = _code_label(code)
        self.stmts, self.multi = statement_lines(code)
        #: ns of gpumagic's own work that line_profiler billed to each physical line
        self.costs: dict[int, int] = {}
        #: how often each multi-line statement was entered
        self.entries: dict[int, int] = {}
        self.extras: dict[int, LineExtras] = {}
        #: --gpu's timeline: ``(label, statement)`` of each statement, built once
        self.wheres: dict[int, tuple[Label, int]] = {}

    def where(self, stmt: int) -> tuple[Label, int]:
        """The timeline's ``(label, statement)`` of ``stmt`` (one tuple per statement)."""
        found = self.wheres.get(stmt)
        if found is None:
            found = self.wheres[stmt] = (self.label, stmt)
        return found

    def extra(self, line: int) -> LineExtras:
        found = self.extras.get(line)
        if found is None:
            found = self.extras[line] = LineExtras()
        return found


@dataclass
class Record:
    """Counters over all sessions of one profiler."""

    codes: dict[CodeType, CodeInfo] = field(default_factory=dict)
    cuda_used: bool = False
    devices: tuple[int, ...] = ()
    syncs: int = 0
    capture_skips: int = 0
    sync_floor_ns: int = 0
    calibration_syncs: int = 0
    failure: str | None = None
    hook: str = "none"
    wall_s: float = 0.0
    #: --gpu: each kernel charged to its line (None: no GPU work was recorded)
    gpu: GpuAttribution | None = None
    gpu_failure: str | None = None
    trace_cost: TraceCost = field(default_factory=TraceCost)
    end_syncs: int = 0  # --gpu: once after each run, for the profiler's record


def peak_above(start: Marks, end: Marks) -> tuple[int, bool]:
    """Highest allocation above the line's start while it ran, and whether it is exact.

    Without resetting torch's peak counter (that would change what the user's
    ``max_memory_allocated()`` says): exact when the line raised the process-wide peak,
    or only allocated, or only freed; otherwise an upper bound from the bytes it
    allocated.
    """
    a0, p0, c0, _ = start
    a1, p1, c1, _ = end
    if p1 > p0:
        return p1 - a0, True
    low = max(a0, a1)
    allocated = c1 - c0
    high = a0 + allocated if allocated >= 0 else p0
    if p1 == p0:
        high = min(high, p0)
    else:  # someone reset the peak counters during the line
        low = max(low, p1)
    high = max(high, low)
    return high - a0, high == low


# -- statements ---------------------------------------------------------------------


def statement_lines(code: CodeType) -> tuple[dict[int, int], frozenset[int]]:
    """Map each physical line of a multi-line statement (or compound-statement header)
    of ``code``'s source to the statement's first line; also the set of first lines.

    Empty when the source cannot be found or parsed (lambdas, ``exec`` strings).
    """
    lines = linecache.getlines(code.co_filename)
    first = code.co_firstlineno
    if not lines or first > len(lines):
        return {}, frozenset()
    try:
        block = inspect.getblock(lines[first - 1 :])
        tree = ast.parse(textwrap.dedent("".join(block)))
    except (SyntaxError, IndentationError, ValueError, TypeError, IndexError):
        return {}, frozenset()
    mapping: dict[int, int] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt):
            continue
        start = node.lineno
        decorators = getattr(node, "decorator_list", None)
        if decorators:
            start = min([start, *(d.lineno for d in decorators)])
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
            end = body[0].lineno - 1  # the header of a compound statement
        elif isinstance(node, ast.Match) and node.cases:
            end = node.cases[0].pattern.lineno - 1
        else:
            end = node.end_lineno or node.lineno
        if end <= start:
            continue
        for physical in range(start, end + 1):
            mapping.setdefault(physical + first - 1, start + first - 1)
    return mapping, frozenset(mapping.values())
