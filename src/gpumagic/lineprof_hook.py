"""What runs at every line boundary of ``%lprun``'s profiled code (see :mod:`gpumagic.lineprof`).

:class:`BoundaryHook` is called before line_profiler reads its clock. Once CUDA is in
use it synchronizes every device with a context (so the line that launched the work
waits for it), counts the synchronizing calls torch reports, reads the allocator's
counters and, for ``--gpu``, records when each line ran and the thread's next autograd
sequence number then (no CUDA event, no wait:
:mod:`gpumagic.lineprof_kernels` charges each kernel to its line after the run); it
measures its own cost so the profiler can subtract it. :func:`statement_lines` maps
multi-line statements to their first line. All CUDA calls go through :mod:`gpumagic.cuda`.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import linecache
import sys
import textwrap
import time
import warnings
from dataclasses import dataclass, field
from threading import get_ident
from typing import TYPE_CHECKING, Any

from line_profiler._line_profiler import label as _code_label

from gpumagic import cuda
from gpumagic.lineprof_kernels import KernelLines, TraceCost

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import CodeType, FrameType

    from gpumagic.lineprof_attribution import GpuAttribution
    from gpumagic.lineprof_timeline import LineEvent

__all__ = [
    "CALIBRATION_CODE",
    "BoundaryHook",
    "CodeInfo",
    "Label",
    "LineExtras",
    "Marks",
    "Record",
    "calibration_frame",
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
    failure: str | None = None
    hook: str = "none"
    wall_s: float = 0.0
    #: --gpu: each kernel charged to its line (None: no GPU work was recorded)
    gpu: GpuAttribution | None = None
    gpu_failure: str | None = None
    trace_cost: TraceCost = field(default_factory=TraceCost)
    end_syncs: int = 0  # --gpu: once after each run, for the profiler's record


class _Open:
    """The line a frame is on, as the hook saw it open."""

    __slots__ = ("code", "info", "line", "marks", "spent", "stmt", "syncs", "thread")

    def __init__(self, code: CodeType, info: CodeInfo, thread: int) -> None:
        self.code = code
        self.info = info
        self.thread = thread
        self.line = 0
        self.stmt = 0
        self.spent = 0
        self.marks: dict[int, Marks] | None = None
        self.syncs = 0


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


def calibration_frame() -> FrameType:
    """A frame of a code object nobody profiles, for measuring the hook's own cost."""
    return sys._getframe()


CALIBRATION_CODE = calibration_frame.__code__


class BoundaryHook:
    """Runs at every line boundary of the profiled code, before line_profiler's clock."""

    def __init__(self, record: Record, *, sync: bool, gpu: bool, memory: bool) -> None:
        self.record = record
        self.codes = record.codes
        self.sync = sync
        self.gpu = gpu
        self.memory = memory
        self.frames: dict[int, _Open] = {}
        self.spent: dict[int, int] = {}
        #: --gpu: the profiler and the line timeline, once CUDA is in use
        self.kernels: KernelLines | None = None
        self.armable = sync or gpu or memory
        #: --gpu alone (no sync, no memory): the boundary calls nothing of CUDA
        self.timeline_only = gpu and not sync and not memory
        self.timeline_of: KernelLines | None = None
        self.timeline_thread = 0
        self.timeline_events: list[LineEvent] = []
        self.armed = False
        self.interrupted = False
        self.devices: tuple[int, ...] = ()
        self.refresh_devices = False
        self.floor = 0
        self.need_floor = False
        self.residual = 0
        self.last_cost = 0
        self.warned = 0
        self.mode_before: int | None = None
        self.restore_mode: int | None = None
        # The seam's functions, looked up once (tests swap them before a session).
        self._devices_with_context = cuda.devices_with_context
        self._visible_device_total = cuda.visible_device_total
        self._synchronize = cuda.synchronize
        self._capturing = cuda.stream_is_capturing
        self._marks = cuda.allocation_marks

    # -- the boundary ---------------------------------------------------------------

    def boundary(  # noqa: PLR0915 (the hot path: inlined on purpose)
        self, t0: int, code: CodeType, line: int, key: int, opening: bool
    ) -> None:
        """A LINE (``opening``) or an exit event (return, yield, raise) in the profiled
        frame ``key``, seen at ``t0``; mirrors line_profiler's per-frame bookkeeping."""
        state = self.frames.get(key)
        if state is not None and state.code is not code:
            state = None  # a stale record of another function at the same address
        waited = 0
        marks: dict[int, Marks] | None = None
        if self.armed or (self.armable and self._arm()):
            if self.timeline_only:
                # --gpu --no-sync: no CUDA call here; only the line's syncs to close.
                if state is not None:
                    state.info.extra(state.line).syncs += self.warned - state.syncs
            else:
                waited, marks = self._cuda_boundary(state)
        tid = get_ident()
        if opening:
            if state is None:
                state = self.frames[key] = _Open(code, self.codes[code], tid)
                prior = -1
            else:
                prior = state.spent
                closed = state.line
            info = state.info
            stmt = info.stmts.get(line, line)
            if stmt != state.stmt:
                if stmt in info.multi:
                    info.entries[stmt] = info.entries.get(stmt, 0) + 1
                state.stmt = stmt
            state.marks = marks
            state.syncs = self.warned
            kernels = self.kernels
            if kernels is not None:
                if tid == self.timeline_thread and kernels is self.timeline_of:
                    events = self.timeline_events
                else:
                    events = self._timeline(kernels, tid)
                where = info.wheres.get(stmt) or info.where(stmt)
                events.append((t0, key, where, kernels.sequence_nr()))
        elif state is None:
            prior = -1
        else:
            prior = state.spent
            closed = state.line
            info = state.info
            del self.frames[key]
            kernels = self.kernels
            if kernels is not None:
                self._timeline(kernels, tid).append((t0, key, None, kernels.sequence_nr()))
        spent = self.spent.get(tid, 0)
        cost = time.perf_counter_ns() - t0 - max(0, waited - self.floor) + self.residual
        if prior >= 0:
            costs = info.costs
            costs[closed] = costs.get(closed, 0) + spent - prior + cost
        spent += cost
        self.spent[tid] = spent
        self.last_cost = cost
        if opening:
            state.line = line  # type: ignore[union-attr]
            state.spent = spent  # type: ignore[union-attr]

    def _timeline(self, kernels: KernelLines, tid: int) -> list[LineEvent]:
        """The line timeline of thread ``tid`` (the last thread's, kept at hand)."""
        if tid != self.timeline_thread or kernels is not self.timeline_of:
            self.timeline_of = kernels
            self.timeline_thread = tid
            self.timeline_events = kernels.thread_events(tid)
        return self.timeline_events

    def _cuda_boundary(self, state: _Open | None) -> tuple[int, dict[int, Marks] | None]:
        """Synchronize, read the allocator; close the line's syncs and memory figures."""
        waited = 0
        marks: dict[int, Marks] | None = None
        try:
            if self._capturing():
                self.record.capture_skips += 1
            else:
                if self.refresh_devices:
                    self._refresh_devices()
                if self.sync and not self.interrupted:
                    if self.need_floor:
                        self._calibrate()
                    clock = time.perf_counter_ns
                    s0 = clock()
                    self._synchronize(self.devices)
                    waited = clock() - s0
                    self.record.syncs += 1
            if self.memory:
                marks = {d: self._marks(d) for d in self.devices}
            if state is not None and (self.gpu or self.memory):
                self._close_cuda(state, marks)
        except Exception as exc:  # a CUDA error must not break the user's code
            self._fail(exc)
        return waited, marks

    def _close_cuda(self, state: _Open, marks: dict[int, Marks] | None) -> None:
        extras = state.info.extra(state.line)
        extras.syncs += self.warned - state.syncs
        if marks is not None and state.marks is not None:
            delta = peak = 0
            exact = True
            for device, end in marks.items():
                start = state.marks.get(device, (0, 0, 0, 0))
                delta += end[0] - start[0]
                above, known = peak_above(start, end)
                peak += above
                exact = exact and known
            extras.mem_delta += delta
            extras.mem_hits += 1
            if peak > extras.mem_peak or (peak == extras.mem_peak and exact):
                extras.mem_peak, extras.mem_peak_bound = peak, not exact

    def measure_residual(self, call: Callable[[bool], None]) -> None:
        """How much of each boundary the hook cannot time itself (entering and leaving
        its callback, handing over to line_profiler): measured around ``call`` (a
        boundary on :func:`calibration_frame`'s code, nobody profiles it), then added
        to every boundary's cost. Leaves no trace in the profile."""
        code = CALIBRATION_CODE
        saved = (self.armable, self.spent.copy())
        self.armable = False
        self.codes[code] = CodeInfo(code)
        clock = time.perf_counter_ns
        samples = []
        try:
            for index in range(400):
                t = clock()
                call(index % 2 == 0)
                samples.append(clock() - t - self.last_cost)
        finally:
            del self.codes[code]
            for key in [k for k, state in self.frames.items() if state.code is code]:
                del self.frames[key]
            self.armable, self.spent = saved
        samples.sort()
        self.residual = max(0, samples[len(samples) // 2])

    def _arm(self) -> bool:
        """Start the CUDA work once the process has a CUDA context."""
        if self.record.failure is not None:
            self.armable = False
            return False
        try:
            devices = self._devices_with_context()
            if not devices:
                return False
            self.devices = devices
            self.refresh_devices = self._visible_device_total() > len(devices)
            self.armed = True
            self.record.cuda_used = True
            self.record.devices = tuple(sorted(set(self.record.devices) | set(devices)))
            if self.sync:
                self.need_floor = True
                if not self._capturing():
                    self._calibrate()
            if self.gpu:
                self.mode_before = cuda.get_sync_debug_mode()
                if self.mode_before == 0:
                    cuda.set_sync_debug_mode(1)
                    self.restore_mode = 0
                self._start_kernels()
        except Exception as exc:
            self._fail(exc)
            return False
        return True

    def _start_kernels(self) -> None:
        """Start recording the GPU work (``--gpu``); the lines already running on this
        thread (CUDA started within the run) open the timeline."""
        record = self.record
        try:
            if cuda.profiler_running():
                record.gpu_failure = (
                    "a torch.profiler was already recording: --gpu needs its own, so there "
                    "is no GPU Time (stop the other profiler, or leave out --gpu)"
                )
                return
            if self._capturing():
                record.gpu_failure = "CUDA graph capture was running when --gpu would start"
                return
            tid = get_ident()
            running = [
                (tid, key, (state.info.label, state.stmt))
                for key, state in self.frames.items()
                if state.thread == tid
            ]
            self.kernels = KernelLines(self.devices, running)
        except Exception as exc:
            record.gpu_failure = f"torch.profiler could not start: {type(exc).__name__}: {exc}"

    def _refresh_devices(self) -> None:
        devices = self._devices_with_context()
        if devices != self.devices:
            self.devices = devices
            self.record.devices = tuple(sorted(set(self.record.devices) | set(devices)))
            self.refresh_devices = self._visible_device_total() > len(devices)

    def _calibrate(self) -> None:
        """The cost of a synchronize on an idle GPU: not the line's GPU work."""
        self.need_floor = False
        sync = self._synchronize
        clock = time.perf_counter_ns
        sync(self.devices)
        samples = []
        for _ in range(15):
            t = clock()
            sync(self.devices)
            samples.append(clock() - t)
        self.floor = sorted(samples)[len(samples) // 2]
        self.record.sync_floor_ns = self.floor

    def _fail(self, exc: Exception) -> None:
        self.record.failure = f"{type(exc).__name__}: {exc}".strip()
        self.armed = False
        self.armable = False

    def finish(self) -> None:
        """After the run: charge the recorded GPU work to its lines, put the sync debug
        mode back."""
        kernels, self.kernels = self.kernels, None
        record = self.record
        try:
            if kernels is not None:
                found = kernels.finish(wait=not self.interrupted)
                record.end_syncs += not self.interrupted
                if record.gpu is None:
                    record.gpu = found
                else:
                    record.gpu.add(found)
                cost = record.trace_cost
                cost.start_s += kernels.cost.start_s
                cost.stop_s += kernels.cost.stop_s
                cost.match_s += kernels.cost.match_s
        except Exception as exc:
            record.gpu_failure = f"the GPU work could not be read: {type(exc).__name__}: {exc}"
        finally:
            if self.restore_mode is not None:
                with contextlib.suppress(Exception):
                    cuda.set_sync_debug_mode(self.restore_mode)
                self.restore_mode = None

    @contextlib.contextmanager
    def counting_sync_warnings(self) -> Iterator[None]:
        """Count torch's "synchronizing CUDA operation" warnings instead of showing them;
        every other warning is shown as usual. Filters and ``showwarning`` are put back."""
        with warnings.catch_warnings():
            shown = warnings.showwarning
            warnings.filterwarnings("always", message=cuda.SYNC_WARNING_MESSAGE)

            def showwarning(  # noqa: PLR0917 (warnings.showwarning's signature)
                message: Warning | str,
                category: type[Warning],
                filename: str,
                lineno: int,
                file: Any = None,
                line: str | None = None,
            ) -> None:
                if str(message).startswith(cuda.SYNC_WARNING_MESSAGE):
                    self.warned += 1
                    if self.mode_before == 1:  # the user asked for these warnings
                        shown(message, category, filename, lineno, file, line)
                    return
                shown(message, category, filename, lineno, file, line)

            warnings.showwarning = showwarning
            yield


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
