"""Line profiling that charges each line for the GPU work it launched (``%lprun``'s core).

CUDA launches return at once, so a plain line profiler bills GPU work to whichever later
line waits for it (``.item()``, ``.cpu()``, printing a tensor). Here line_profiler keeps
doing the timing (its C core, its :class:`~line_profiler.LineStats`, its ``.lprof``
files), and a hook runs at every line boundary of the profiled code *before*
line_profiler reads its clock:

* Python 3.12+: a :mod:`sys.monitoring` tool with a higher id than line_profiler's
  (CPython calls tools from the highest id down).
* Python 3.11, or ``LINE_PROFILER_CORE=legacy``: a trace function wrapped around
  line_profiler's, which calls it after the hook.

Once CUDA is in use, the hook synchronizes every device that has a context (so the
line that launched the work waits for it), records CUDA events for a GPU-time column
(``gpu``), counts the synchronizing calls torch reports per line (``gpu``), and reads
the allocator's counters (``memory``). It measures its own cost and subtracts it from
every line whose time enclosed it, and it counts each multi-line statement once. All
CUDA calls go through :mod:`gpumagic.cuda`. Nothing here imports IPython.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import dis
import inspect
import linecache
import sys
import textwrap
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from threading import get_ident
from typing import TYPE_CHECKING, Any, cast

from line_profiler import LineProfiler, LineStats
from line_profiler._line_profiler import label as _code_label

from gpumagic import cuda

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import CodeType, FrameType

__all__ = [
    "GpuLineProfiler",
    "LineExtras",
    "LineProfileResult",
    "ProfilerBusy",
    "patched_builtins_profile",
]

Label = tuple[str, int, str]
Marks = tuple[int, int, int, int]

#: sys.monitoring ids above line_profiler's (``PROFILER_ID`` = 2), tried in order.
_TOOL_IDS = (3, 4, 5)
_TOOL_NAME = "gpumagic %lprun"
#: How many finished GPU intervals may wait before the hook reads their events.
_DRAIN_EVERY = 256


class ProfilerBusy(RuntimeError):
    """The hook cannot be installed (every usable sys.monitoring tool id is taken)."""


@dataclass
class LineExtras:
    """What gpumagic measured for one line beside line_profiler's hits and time.

    Everything is inclusive, like line_profiler's time: a line that calls a function
    also carries the GPU time, synchronizing calls and allocations of that call.
    """

    gpu_ms: float = 0.0
    gpu_spans: int = 0
    syncs: int = 0
    mem_delta: int = 0
    mem_peak: int = 0
    mem_peak_bound: bool = False
    mem_hits: int = 0

    def add(self, other: LineExtras) -> None:
        """Fold ``other`` (another physical line of the same statement) into this one."""
        self.gpu_ms += other.gpu_ms
        self.gpu_spans += other.gpu_spans
        self.syncs += other.syncs
        self.mem_delta += other.mem_delta
        self.mem_hits += other.mem_hits
        if other.mem_peak > self.mem_peak:
            self.mem_peak, self.mem_peak_bound = other.mem_peak, other.mem_peak_bound


class _CodeInfo:
    """What the hook keeps per profiled code object (it outlives one session)."""

    __slots__ = ("costs", "entries", "extras", "label", "multi", "stmts")

    def __init__(self, code: CodeType) -> None:
        self.label: Label = _code_label(code)
        self.stmts, self.multi = statement_lines(code)
        #: ns of gpumagic's own work that line_profiler billed to each physical line
        self.costs: dict[int, int] = {}
        #: how often each multi-line statement was entered
        self.entries: dict[int, int] = {}
        self.extras: dict[int, LineExtras] = {}

    def extra(self, line: int) -> LineExtras:
        found = self.extras.get(line)
        if found is None:
            found = self.extras[line] = LineExtras()
        return found


@dataclass
class _Record:
    """Counters over all sessions of one profiler."""

    codes: dict[CodeType, _CodeInfo] = field(default_factory=dict)
    cuda_used: bool = False
    devices: tuple[int, ...] = ()
    syncs: int = 0
    capture_skips: int = 0
    sync_floor_ns: int = 0
    gpu_unmeasured: int = 0
    failure: str | None = None
    hook: str = "none"
    wall_s: float = 0.0


class _Open:
    """The line a frame is on, as the hook saw it open."""

    __slots__ = ("code", "event", "info", "line", "marks", "spent", "stmt", "syncs")

    def __init__(self, code: CodeType, info: _CodeInfo) -> None:
        self.code = code
        self.info = info
        self.line = 0
        self.stmt = 0
        self.spent = 0
        self.event: Any = None
        self.marks: dict[int, Marks] | None = None
        self.syncs = 0


def _peak_above(start: Marks, end: Marks) -> tuple[int, bool]:
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


def _calibration_frame() -> FrameType:
    """A frame of a code object nobody profiles, for measuring the hook's own cost."""
    return sys._getframe()


_CALIBRATION_CODE = _calibration_frame.__code__


class _BoundaryHook:
    """Runs at every line boundary of the profiled code, before line_profiler's clock."""

    def __init__(self, record: _Record, *, sync: bool, gpu: bool, memory: bool) -> None:
        self.record = record
        self.codes = record.codes
        self.sync = sync
        self.gpu = gpu
        self.memory = memory
        self.frames: dict[int, _Open] = {}
        self.spent: dict[int, int] = {}
        self.pending: deque[tuple[_CodeInfo, int, Any, Any]] = deque()
        self.armable = sync or gpu or memory
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
        self._synchronize = cuda.synchronize_each
        self._capturing = cuda.stream_is_capturing
        self._record_event = cuda.record_timing_event
        self._event_completed = cuda.event_completed
        self._event_span_ms = cuda.event_span_ms
        self._marks = cuda.allocation_marks

    # -- the boundary ---------------------------------------------------------------

    def boundary(self, t0: int, code: CodeType, line: int, key: int, opening: bool) -> None:
        """A LINE (``opening``) or an exit event (return, yield, raise) in the profiled
        frame ``key``, seen at ``t0``; mirrors line_profiler's per-frame bookkeeping."""
        state = self.frames.get(key)
        if state is not None and state.code is not code:
            state = None  # a stale record of another function at the same address
        waited = 0
        start_event: Any = None
        marks: dict[int, Marks] | None = None
        if self.armed or (self.armable and self._arm()):
            waited, start_event, marks = self._cuda_boundary(state, opening)
        if opening:
            if state is None:
                state = self.frames[key] = _Open(code, self.codes[code])
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
            state.event = start_event
            state.marks = marks
            state.syncs = self.warned
        elif state is None:
            prior = -1
        else:
            prior = state.spent
            closed = state.line
            info = state.info
            del self.frames[key]
        tid = get_ident()
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

    def _cuda_boundary(
        self, state: _Open | None, opening: bool
    ) -> tuple[int, Any, dict[int, Marks] | None]:
        """Synchronize, record events, read the allocator; close the line's GPU figures."""
        clock = time.perf_counter_ns
        waited = 0
        start_event: Any = None
        end_event: Any = None
        marks: dict[int, Marks] | None = None
        try:
            if self._capturing():
                self.record.capture_skips += 1
            else:
                if self.refresh_devices:
                    self._refresh_devices()
                if self.sync:
                    if self.gpu and state is not None:
                        end_event = self._record_event()  # before the wait
                    if not self.interrupted:
                        if self.need_floor:
                            self._calibrate()
                        s0 = clock()
                        self._synchronize(self.devices)
                        waited = clock() - s0
                        self.record.syncs += 1
                    if self.gpu and opening:
                        start_event = self._record_event()
                elif self.gpu:
                    start_event = end_event = self._record_event()
            if self.memory:
                marks = {d: self._marks(d) for d in self.devices}
            if self.gpu or self.memory:
                if state is not None:
                    self._close_cuda(state, end_event, marks)
                if len(self.pending) >= _DRAIN_EVERY:
                    self._drain(wait=False)
        except Exception as exc:  # a CUDA error must not break the user's code
            self._fail(exc)
        return waited, start_event, marks

    def _close_cuda(self, state: _Open, end_event: Any, marks: dict[int, Marks] | None) -> None:
        extras = state.info.extra(state.line)
        extras.syncs += self.warned - state.syncs
        if self.gpu:
            if state.event is not None and end_event is not None:
                self.pending.append((state.info, state.line, state.event, end_event))
            else:
                self.record.gpu_unmeasured += 1
        if marks is not None and state.marks is not None:
            delta = peak = 0
            exact = True
            for device, end in marks.items():
                start = state.marks.get(device, (0, 0, 0, 0))
                delta += end[0] - start[0]
                above, known = _peak_above(start, end)
                peak += above
                exact = exact and known
            extras.mem_delta += delta
            extras.mem_hits += 1
            if peak > extras.mem_peak or (peak == extras.mem_peak and exact):
                extras.mem_peak, extras.mem_peak_bound = peak, not exact

    def measure_residual(self, call: Callable[[bool], None]) -> None:
        """How much of each boundary the hook cannot time itself (entering and leaving
        its callback, handing over to line_profiler): measured around ``call`` (a
        boundary on :func:`_calibration_frame`'s code, nobody profiles it), then added
        to every boundary's cost. Leaves no trace in the profile."""
        code = _CALIBRATION_CODE
        saved = (self.armable, self.spent.copy())
        self.armable = False
        self.codes[code] = _CodeInfo(code)
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
        except Exception as exc:
            self._fail(exc)
            return False
        return True

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
        self.pending.clear()

    def _drain(self, *, wait: bool) -> None:
        """Turn finished event pairs into GPU milliseconds per line."""
        pending = self.pending
        try:
            while pending:
                info, line, start, end = pending[0]
                if not wait and not (self._event_completed(end) and self._event_completed(start)):
                    return
                pending.popleft()
                try:
                    span = self._event_span_ms(start, end)
                except Exception:  # events on two devices: no span
                    self.record.gpu_unmeasured += 1
                    continue
                extras = info.extra(line)
                extras.gpu_ms += span
                extras.gpu_spans += 1
        except Exception as exc:
            self._fail(exc)

    def finish(self) -> None:
        """After the run: read the remaining events, put the sync debug mode back."""
        try:
            if self.armed and self.pending and not self.interrupted:
                self._synchronize(self._devices_with_context())
                self._drain(wait=True)
        except Exception as exc:
            self._fail(exc)
        finally:
            self.pending.clear()
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


class _MonitoringInstaller:
    """Python 3.12+: a sys.monitoring tool whose id is above line_profiler's."""

    kind = "sys.monitoring"

    def __init__(self, hook: _BoundaryHook, codes: list[CodeType]) -> None:
        self.hook = hook
        self.codes = codes
        self.tool: int | None = None

    def install(self) -> None:
        mon: Any = getattr(sys, "monitoring")  # noqa: B009 (absent before 3.12)
        events = mon.events
        for tool in _TOOL_IDS:
            if mon.get_tool(tool) is None:
                mon.use_tool_id(tool, _TOOL_NAME)
                self.tool = tool
                break
        else:
            taken = ", ".join(f"{t} ({mon.get_tool(t)})" for t in _TOOL_IDS)
            raise ProfilerBusy(
                f"sys.monitoring tool ids {taken} are all taken; gpumagic needs one of them "
                "to run before line_profiler (id 2). Free one, or use --no-sync."
            )
        hook = self.hook
        boundary = hook.boundary
        codes = set(self.codes)
        getframe = sys._getframe
        clock = time.perf_counter_ns

        def on_line(code: CodeType, line: int) -> None:
            boundary(clock(), code, line, id(getframe(1)), True)

        def on_exit(code: CodeType, offset: int, value: object) -> None:
            boundary(clock(), code, 0, id(getframe(1)), False)

        def on_raise(code: CodeType, offset: int, exc: BaseException) -> None:
            if code in codes:
                if isinstance(exc, KeyboardInterrupt):
                    hook.interrupted = True
                boundary(clock(), code, 0, id(getframe(1)), False)

        def calibrate(opening: bool) -> None:
            if opening:
                on_line(_CALIBRATION_CODE, 1)
            else:
                on_exit(_CALIBRATION_CODE, 0, None)

        hook.measure_residual(calibrate)
        tool = self.tool
        mon.register_callback(tool, events.LINE, on_line)
        mon.register_callback(tool, events.PY_RETURN, on_exit)
        mon.register_callback(tool, events.PY_YIELD, on_exit)
        mon.register_callback(tool, events.RAISE, on_raise)
        mon.register_callback(tool, events.RERAISE, on_raise)
        local = events.LINE | events.PY_RETURN | events.PY_YIELD
        for code in self.codes:
            mon.set_local_events(tool, code, local)
        # Exception events cannot be local; line_profiler listens to them globally too.
        mon.set_events(tool, events.RAISE | events.RERAISE)

    def uninstall(self) -> None:
        tool = self.tool
        if tool is None:
            return
        mon: Any = getattr(sys, "monitoring")  # noqa: B009 (absent before 3.12)
        events = mon.events
        try:
            mon.set_events(tool, 0)
            for code in self.codes:
                mon.set_local_events(tool, code, 0)
            for event in (
                events.LINE,
                events.PY_RETURN,
                events.PY_YIELD,
                events.RAISE,
                events.RERAISE,
            ):
                mon.register_callback(tool, event, None)
        finally:
            mon.free_tool_id(tool)
            self.tool = None


def _make_local(hook: _BoundaryHook, then: Callable[..., Any]) -> Callable[..., Any]:
    """The frame-local trace function: the hook first, then ``then`` (line_profiler)."""
    boundary = hook.boundary
    clock = time.perf_counter_ns

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            boundary(clock(), frame.f_code, frame.f_lineno, id(frame), True)
        elif event == "return":
            boundary(clock(), frame.f_code, 0, id(frame), False)
        elif event == "exception" and issubclass(arg[0], KeyboardInterrupt):
            hook.interrupted = True
        then(frame, event, arg)
        return local

    return local


class _TraceInstaller:
    """Python 3.11 (and line_profiler's legacy core): a trace function around
    line_profiler's, which runs the hook first and then calls line_profiler."""

    kind = "sys.settrace"

    def __init__(self, hook: _BoundaryHook, codes: list[CodeType]) -> None:
        self.hook = hook
        self.codes = frozenset(codes)

    def calibrate(self) -> None:
        """Measure the hook's unseen cost; before line_profiler is enabled (its trace
        function would time the calibration itself). Without line_profiler behind the
        hook, the part of its call before it reads its clock stays billed (a fraction of
        a µs) rather than its whole call being subtracted."""
        frame = _calibration_frame()
        bare = _make_local(self.hook, lambda *args: None)
        self.hook.measure_residual(
            lambda opening: bare(frame, "line" if opening else "return", None)
        )

    def install(self) -> None:
        """Wrap the trace function line_profiler has just installed."""
        manager: Any = sys.gettrace()
        if manager is None:
            raise ProfilerBusy("line_profiler did not install its trace function")
        codes = self.codes
        forward_all = bool(getattr(manager, "wrap_trace", False))
        local = _make_local(self.hook, manager)

        def forward(frame: FrameType, event: str, arg: Any) -> Any:
            manager(frame, event, arg)
            return forward

        def on_call(frame: FrameType, event: str, arg: Any) -> Any:
            if frame.f_code in codes:
                manager(frame, event, arg)
                return local
            if forward_all:
                manager(frame, event, arg)
                return forward
            return None

        sys.settrace(on_call)

    def uninstall(self) -> None:
        """Nothing to do: line_profiler's own disable puts its predecessor back."""


def _uses_legacy_trace() -> bool:
    from line_profiler import _diagnostics

    return bool(getattr(_diagnostics, "USE_LEGACY_TRACE", sys.version_info < (3, 12)))


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


# -- torch.compile and nn.Module ----------------------------------------------------


def _is_torch_compiled(obj: object) -> bool:
    return getattr(obj, "_torchdynamo_orig_callable", None) is not None or (
        type(obj).__name__ == "OptimizedModule" and hasattr(obj, "_orig_mod")
    )


def _is_nn_module(obj: object) -> bool:
    return any(
        cls.__name__ == "Module" and cls.__module__ == "torch.nn.modules.module"
        for cls in type(obj).__mro__
    )


def _compiled_calls(func: Any, code: CodeType) -> list[tuple[int, str]]:
    """Lines of ``code`` that load a torch.compile'd global: they run it as one step."""
    namespace = getattr(func, "__globals__", None)
    if not isinstance(namespace, dict):
        return []
    found = []
    for instruction in dis.get_instructions(code):
        if instruction.opname not in ("LOAD_GLOBAL", "LOAD_NAME"):
            continue
        name = instruction.argval
        if isinstance(name, str) and _is_torch_compiled(namespace.get(name)):
            line = instruction.positions.lineno if instruction.positions else None
            if line is not None:
                found.append((line, name))
    return found


# -- the profiler -------------------------------------------------------------------


@dataclass
class LineProfileResult:
    """One profile: line_profiler's stats (host time per line, GPU-correct when
    synchronized) plus what gpumagic measured per line, and what to tell the user."""

    stats: LineStats
    extras: dict[Label, dict[int, LineExtras]]
    sync: bool
    gpu: bool
    memory: bool
    cuda_used: bool
    devices: tuple[int, ...]
    syncs: int
    capture_skips: int
    sync_floor_ns: int
    gpu_unmeasured: int
    failure: str | None
    hook: str
    wall_s: float
    statements: dict[Label, dict[int, int]]
    notes: list[str] = field(default_factory=list)
    message: str | None = None

    @property
    def gpu_columns(self) -> bool:
        """Whether the table has the GPU-time and sync columns."""
        return self.gpu and self.cuda_used

    @property
    def memory_columns(self) -> bool:
        """Whether the table has the memory columns."""
        return self.memory and self.cuda_used


class GpuLineProfiler(LineProfiler):
    """line_profiler's ``LineProfiler``, with each line charged for its GPU work.

    ``sync`` synchronizes the devices in use after every profiled line (so the host
    time of a line includes the GPU work it launched); ``gpu`` adds CUDA events per line
    and counts synchronizing calls; ``memory`` reads the allocator per line. Use
    :meth:`add_target` for the callables, :meth:`session` around the code to profile;
    :meth:`get_stats` returns line_profiler ``LineStats`` with gpumagic's own cost
    removed and multi-line statements counted once.
    """

    def __init__(
        self, *functions: Any, sync: bool = True, gpu: bool = False, memory: bool = False
    ) -> None:
        self.sync = sync
        self.gpu = gpu
        self.memory = memory
        self.notes: list[str] = []
        self._record = _Record()
        self._original_codes: list[tuple[Any, CodeType]] = []
        self._compiled_lines: dict[Label, list[tuple[int, str]]] = {}
        super().__init__(*functions)

    # -- targets --------------------------------------------------------------------

    def add_function(self, func: Any) -> None:
        """line_profiler's ``add_function``, remembering the code it replaces (so it can
        be put back) and the torch.compile'd calls in it."""
        owner = func if hasattr(func, "__code__") else getattr(func, "__func__", None)
        original = getattr(owner, "__code__", None)
        super().add_function(func)
        if owner is None or original is None:
            return
        self._original_codes.append((owner, original))
        code = owner.__code__
        calls = _compiled_calls(owner, code)
        if calls:
            self._compiled_lines.setdefault(_code_label(code), []).extend(calls)

    def add_target(self, obj: Any, name: str | None = None) -> int:
        """Profile ``obj``: a function, method, property, partial, class, an
        ``nn.Module`` (its ``forward``), or a torch.compile'd callable (which cannot be
        line-profiled: said in :attr:`notes`). Returns how many functions were added."""
        shown = name or getattr(obj, "__qualname__", None) or type(obj).__name__
        if _is_torch_compiled(obj):
            self.notes.append(
                f"{shown} is torch.compile'd: it runs as generated code, so it has no line "
                "timings of its own and shows as one opaque line in the functions that "
                "call it. Profile the uncompiled function to see its lines."
            )
            return 0
        if _is_nn_module(obj) and not callable(getattr(obj, "__code__", None)):
            forward = getattr(obj, "forward", None)
            if forward is not None:
                self.notes.append(f"{shown} is an nn.Module: profiling its forward().")
                obj = forward
        added = int(self.add_callable(obj))
        if not added:
            self.notes.append(f"{shown}: nothing line-profilable (a C function or a builtin?).")
        return added

    def restore_code(self) -> None:
        """Give back each profiled function the code object it had before line_profiler
        padded it (caches keyed on code objects, like Dynamo's, keep matching)."""
        profiled = set(self._profiled_codes())
        for owner, original in self._original_codes:
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                if owner.__code__ in profiled and owner.__code__ is not original:
                    owner.__code__ = original
        self._original_codes.clear()

    # -- running --------------------------------------------------------------------

    def _profiled_codes(self) -> list[CodeType]:
        """The (padded) code objects line_profiler watches."""
        return list(cast("Any", self).code_hash_map)

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Profile the code run inside the block. Every trace function, monitoring tool
        id, warning filter and torch setting touched is put back on exit, whatever the
        block raised (KeyboardInterrupt included)."""
        codes = self._profiled_codes()
        record = self._record
        for code in codes:
            if code not in record.codes:
                record.codes[code] = _CodeInfo(code)
        hook = _BoundaryHook(record, sync=self.sync, gpu=self.gpu, memory=self.memory)
        legacy = _uses_legacy_trace()
        installer: _MonitoringInstaller | _TraceInstaller = (
            _TraceInstaller(hook, codes) if legacy else _MonitoringInstaller(hook, codes)
        )
        trace_before = sys.gettrace()
        started = time.perf_counter()
        with contextlib.ExitStack() as stack:
            if self.gpu:
                stack.enter_context(hook.counting_sync_warnings())
            stack.callback(hook.finish)
            if not codes:
                record.hook = "none"
            elif isinstance(installer, _TraceInstaller):
                stack.callback(_restore_trace, trace_before)
                installer.calibrate()
                self.enable_by_count()
                stack.callback(self.disable_by_count)
                installer.install()
                stack.callback(installer.uninstall)
                record.hook = installer.kind
            else:
                installer.install()
                stack.callback(installer.uninstall)
                self.enable_by_count()
                stack.callback(self.disable_by_count)
                record.hook = installer.kind
            try:
                yield
            finally:
                record.wall_s += time.perf_counter() - started

    def runctx(self, cmd: str, globals: dict[str, Any], locals: dict[str, Any]) -> GpuLineProfiler:
        """Run ``cmd`` under :meth:`session` (line_profiler's ``runctx``)."""
        with self.session():
            exec(cmd, globals, locals)
        return self

    # -- results --------------------------------------------------------------------

    def raw_stats(self) -> LineStats:
        """line_profiler's stats as its C core recorded them (gpumagic's cost included,
        one row per physical line)."""
        return super().get_stats()

    def get_stats(self) -> LineStats:
        """line_profiler ``LineStats`` with gpumagic's own per-line cost removed and each
        multi-line statement counted once, on its first line."""
        raw = self.raw_stats()
        unit = raw.unit
        infos = self._infos_by_label()
        timings: dict[Label, list[tuple[int, int, int]]] = {}
        for label, rows in raw.timings.items():
            stmts: dict[int, int] = {}
            costs: dict[int, int] = {}
            entries: dict[int, int] = {}
            for info in infos.get(label, []):
                stmts.update(info.stmts)
                for line, cost in info.costs.items():
                    costs[line] = costs.get(line, 0) + cost
                for line, count in info.entries.items():
                    entries[line] = entries.get(line, 0) + count
            firsts = set(stmts.values())
            merged: dict[int, list[int]] = {}
            for line, hits, duration in rows:
                corrected = max(0, duration - round(costs.get(line, 0) * 1e-9 / unit))
                stmt = stmts.get(line, line)
                slot = merged.get(stmt)
                if slot is None:
                    merged[stmt] = [hits, corrected]
                else:
                    slot[0] = max(slot[0], hits)
                    slot[1] += corrected
            timings[label] = [
                (stmt, entries.get(stmt, hits) if stmt in firsts else hits, duration)
                for stmt, (hits, duration) in sorted(merged.items())
            ]
        return LineStats(timings, unit)

    def _infos_by_label(self) -> dict[Label, list[_CodeInfo]]:
        found: dict[Label, list[_CodeInfo]] = {}
        for info in self._record.codes.values():
            found.setdefault(info.label, []).append(info)
        return found

    def result(self, message: str | None = None) -> LineProfileResult:
        """Everything measured so far, ready for :mod:`gpumagic.lineprof_report`."""
        record = self._record
        statements: dict[Label, dict[int, int]] = {}
        extras: dict[Label, dict[int, LineExtras]] = {}
        for label, infos in self._infos_by_label().items():
            mapping = statements.setdefault(label, {})
            per_line = extras.setdefault(label, {})
            for info in infos:
                mapping.update(info.stmts)
                for line, measured in info.extras.items():
                    stmt = info.stmts.get(line, line)
                    per_line.setdefault(stmt, LineExtras()).add(measured)
        notes = list(self.notes)
        for label, calls in self._compiled_lines.items():
            for line, name in sorted(set(calls)):
                notes.append(
                    f"{label[2]} line {line} calls torch.compile'd {name}: it runs as one "
                    "opaque step (its own lines are not profiled)."
                )
        return LineProfileResult(
            stats=self.get_stats(),
            extras=extras,
            sync=self.sync,
            gpu=self.gpu,
            memory=self.memory,
            cuda_used=record.cuda_used,
            devices=record.devices,
            syncs=record.syncs,
            capture_skips=record.capture_skips,
            sync_floor_ns=record.sync_floor_ns,
            gpu_unmeasured=record.gpu_unmeasured,
            failure=record.failure,
            hook=record.hook,
            wall_s=record.wall_s,
            statements=statements,
            notes=notes,
            message=message,
        )


def _restore_trace(before: Callable[..., Any] | None) -> None:
    """line_profiler restores the trace function it found; make sure it did."""
    if sys.gettrace() is not before:
        sys.settrace(before)


_ABSENT = object()


@contextlib.contextmanager
def patched_builtins_profile(profiler: object) -> Iterator[None]:
    """``builtins.profile`` is the profiler inside the block (``@profile`` works, as in
    line_profiler's ``%lprun``); whatever was there before is put back."""
    before = builtins.__dict__.get("profile", _ABSENT)
    builtins.__dict__["profile"] = profiler
    try:
        yield
    finally:
        if before is _ABSENT:
            builtins.__dict__.pop("profile", None)
        else:
            builtins.__dict__["profile"] = before
