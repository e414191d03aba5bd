"""Each kernel, copy and memset charged to the profiled line that launched it
(``%lprun --gpu``'s core): pure Python, no torch, no IPython.

Input: the profiler's record (:class:`~gpumagic.cuda.kernel_trace.KernelTrace`: device
work, the runtime calls that launched it, and the torch ops recorded while autograd's
backward ran), the line timeline of each thread
(:class:`~gpumagic.lineprof_timeline.LineStacks`) and the clock fit between the two. For
each piece of device work:

* the runtime call that launched it (``cudaLaunchKernel``...) gives its OS thread and
  host time, and the timeline the stack of profiled lines running then: the innermost
  line is charged *self*, every line of the stack (each once) *inclusive*;
* work launched inside autograd's backward node ``XBackward0`` (linked to a torch op
  under the node) is charged to the forward line that built the node instead: torch
  records the forward's sequence number and thread on the node, and the timeline the
  sequence number each line boundary saw, hence the line that built it;
* other work launched under a torch op (the seed gradient, gradient accumulation) goes
  by the op's thread and host time: the line that called ``backward()``;
* a graph replay is one entry, charged to the replay line (the captured lines get
  nothing);
* what no profiled line launched is counted apart: outside the profiled lines, on
  threads that ran none, or not linked to any launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gpumagic.cuda.kernel_trace import HostOp, KernelTrace
    from gpumagic.lineprof_timeline import ClockFit, Label, LineStacks, Stack

__all__ = ["ENGINE_PREFIX", "GpuAttribution", "LineGpu", "attribute"]

#: How torch names autograd's engine running one backward node.
ENGINE_PREFIX = "autograd::engine::evaluate_function"
_GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")


@dataclass
class LineGpu:
    """GPU time charged to one line (ns). ``total`` includes what the functions it
    called launched, ``self`` only what it launched itself; ``backward_*`` is the part of
    each that autograd's backward ran for the graph nodes this line built."""

    self_ns: int = 0
    total_ns: int = 0
    backward_self_ns: int = 0
    backward_total_ns: int = 0
    launches: int = 0  # launches charged to the line itself (a graph replay counts once)

    def add(self, other: LineGpu) -> None:
        self.self_ns += other.self_ns
        self.total_ns += other.total_ns
        self.backward_self_ns += other.backward_self_ns
        self.backward_total_ns += other.backward_total_ns
        self.launches += other.launches


@dataclass
class GpuAttribution:
    """Every piece of device work of a run, charged to lines or counted apart (ns)."""

    lines: dict[Label, dict[int, LineGpu]] = field(default_factory=dict)
    total_ns: int = 0
    work: int = 0  # kernels, copies and memsets recorded
    outside_ns: int = 0  # launched while no profiled line was running on its thread
    other_threads_ns: int = 0  # launched on a thread that ran no profiled line
    unlinked_ns: int = 0  # no launching op nor runtime call in the record
    backward_ns: int = 0  # launched by autograd's backward
    backward_to_forward_ns: int = 0  # of which charged to the forward line
    graph_replays: int = 0
    graph_ns: int = 0

    @property
    def charged_ns(self) -> int:
        """Device time charged to some line (each piece of work once, as *self*)."""
        return self.total_ns - self.outside_ns - self.other_threads_ns - self.unlinked_ns

    def line(self, label: Label, stmt: int) -> LineGpu:
        per_label = self.lines.setdefault(label, {})
        found = per_label.get(stmt)
        if found is None:
            found = per_label[stmt] = LineGpu()
        return found

    def add(self, other: GpuAttribution) -> None:
        """Fold another session's figures into these."""
        for label, per_line in other.lines.items():
            for stmt, figures in per_line.items():
                self.line(label, stmt).add(figures)
        for name in (
            "total_ns",
            "work",
            "outside_ns",
            "other_threads_ns",
            "unlinked_ns",
            "backward_ns",
            "backward_to_forward_ns",
            "graph_replays",
            "graph_ns",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def _charge(self, stack: Stack, ns: int, *, backward: bool, first: bool) -> None:
        innermost = stack[-1]
        for where in set(stack):
            figures = self.line(*where)
            figures.total_ns += ns
            if backward:
                figures.backward_total_ns += ns
            if where == innermost:
                figures.self_ns += ns
                if backward:
                    figures.backward_self_ns += ns
                if first:
                    figures.launches += 1


def _engine_nodes(ops: tuple[HostOp, ...]) -> dict[int, HostOp]:
    """For each op run by autograd's engine, the innermost engine op around it (itself
    included): a backward node when it carries its forward's sequence number."""
    found: dict[int, HostOp] = {}
    by_thread: dict[int, list[HostOp]] = {}
    for op in ops:
        by_thread.setdefault(op.thread, []).append(op)
    for thread_ops in by_thread.values():
        thread_ops.sort(key=lambda op: (op.start_ns, -op.end_ns))
        open_ops: list[tuple[HostOp, HostOp | None]] = []
        for op in thread_ops:
            while open_ops and open_ops[-1][0].end_ns <= op.start_ns:
                open_ops.pop()
            outer = open_ops[-1][1] if open_ops else None
            mine = op if op.backward_node or op.name.startswith(ENGINE_PREFIX) else None
            if mine is not None and outer is not None and not mine.backward_node:
                mine = outer if outer.backward_node else mine
            nearest = mine or outer
            if nearest is not None:
                found[op.id] = nearest
            open_ops.append((op, nearest))
    return found


def attribute(  # noqa: PLR0915 (one pass over the work, every case said)
    trace: KernelTrace,
    stacks: LineStacks,
    clock: ClockFit,
    *,
    threads: Mapping[int, int],
    os_threads: Mapping[int, int],
    session_thread: int,
) -> GpuAttribution:
    """Charge ``trace``'s device work to the lines of ``stacks``.

    ``threads`` maps torch's thread ids to the timeline's, ``os_threads`` the OS thread
    ids CUPTI reports for runtime calls; ``session_thread`` is the thread that ran the
    profiled statement and called ``backward()``: autograd's engine threads work for it
    while it waits there. A backward node whose forward thread ``threads`` does not
    know was built on the session thread when ``threads`` is empty (no mark made it
    into the record), else on a thread of no timeline: it stays on the backward line.
    """
    result = GpuAttribution()
    ops = {op.id: op for op in trace.ops}
    engine = _engine_nodes(trace.ops)
    calls = {call.correlation: call for call in trace.calls}
    graphs = {c.correlation for c in trace.calls if c.name.startswith(_GRAPH_LAUNCHES)}
    seen: set[tuple[int, int]] = set()
    replays: set[int] = set()
    to_host = clock.to_host
    for work in trace.work:
        ns = work.duration_ns
        result.total_ns += ns
        result.work += 1
        launch = (work.correlation, work.op) if work.correlation else (0, id(work))
        first = launch not in seen
        seen.add(launch)
        if work.correlation in graphs:
            result.graph_ns += ns
            replays.add(work.correlation)
        op = ops.get(work.op) if work.op else None
        thread: int | None
        if op is not None:
            node = engine.get(op.id)
            if node is not None:
                result.backward_ns += ns
                if node.backward_node:
                    fwd_thread = threads.get(node.fwd_thread)
                    if fwd_thread is None and not threads:
                        fwd_thread = session_thread
                    if fwd_thread is not None:
                        stack = stacks.built(fwd_thread, node.seq)
                        if stack:
                            result.backward_to_forward_ns += ns
                            result._charge(stack, ns, backward=True, first=first)
                            continue
                # Not a node a profiled line built: charge where backward() was called.
                thread = threads.get(op.thread, session_thread)
            else:
                thread = threads.get(op.thread)
            at = op.start_ns
        else:
            call = calls.get(work.correlation)
            if call is None:
                result.unlinked_ns += ns
                continue
            thread = os_threads.get(call.thread)
            at = call.start_ns
        if thread is None:
            result.other_threads_ns += ns
            continue
        stack = stacks.at(thread, to_host(at))
        if not stack:
            result.outside_ns += ns
            continue
        result._charge(stack, ns, backward=False, first=first)
    result.graph_replays = len(replays)
    return result
