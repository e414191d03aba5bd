"""How ``%lprun``'s boundary hook is put in front of line_profiler's clock.

* Python 3.12+: a :mod:`sys.monitoring` tool with a higher id than line_profiler's
  (CPython calls tools from the highest id down): :class:`MonitoringInstaller`.
* Python 3.11, or ``LINE_PROFILER_CORE=legacy``: a trace function wrapped around
  line_profiler's, which calls it after the hook: :class:`TraceInstaller`.

With ``--gpu`` and without ``--memory``, once the hook is armed, both switch to callbacks
that only synchronize (unless ``--no-sync``) and record each boundary raw
(:attr:`BoundaryHook.raw`), replayed after the run.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from gpumagic.lineprof_hook import CALIBRATION_CODE, BoundaryHook, calibration_frame
from gpumagic.lineprof_raw import measure_raw_cost, raw_recorder

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import CodeType, FrameType

    from gpumagic.lineprof_raw import BoundaryRecord, RawEvent

    #: sys.monitoring's line, exit (return, yield) and raise callbacks.
    Callbacks = tuple[
        Callable[[CodeType, int], None],
        Callable[[CodeType, int, Any], None],
        Callable[[CodeType, int, BaseException], None],
    ]

__all__ = [
    "MonitoringInstaller",
    "ProfilerBusy",
    "TraceInstaller",
    "restore_trace",
    "uses_legacy_trace",
]

#: sys.monitoring ids above line_profiler's (``PROFILER_ID`` = 2), tried in order.
_TOOL_IDS = (3, 4, 5)
_TOOL_NAME = "gpumagic %lprun"


class ProfilerBusy(RuntimeError):
    """The hook cannot be installed (every usable sys.monitoring tool id is taken)."""


class MonitoringInstaller:
    """Python 3.12+: a sys.monitoring tool whose id is above line_profiler's."""

    kind = "sys.monitoring"

    def __init__(self, hook: BoundaryHook, codes: list[CodeType]) -> None:
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
        callbacks = _callbacks(hook, _live_record(hook), frozenset(self.codes))
        hook.measure_residual(_calibration(callbacks))
        self._register(callbacks)
        hook.go_raw = self.go_raw
        local = events.LINE | events.PY_RETURN | events.PY_YIELD
        for code in self.codes:
            mon.set_local_events(tool, code, local)
        # Exception events cannot be local; line_profiler listens to them globally too.
        mon.set_events(tool, events.RAISE | events.RERAISE)

    def _register(self, callbacks: Callbacks) -> None:
        """Make ``callbacks`` (line, exit, raise) the tool's."""
        mon: Any = getattr(sys, "monitoring")  # noqa: B009 (absent before 3.12)
        events = mon.events
        tool = self.tool
        on_line, on_exit, on_raise = callbacks
        mon.register_callback(tool, events.LINE, on_line)
        mon.register_callback(tool, events.PY_RETURN, on_exit)
        mon.register_callback(tool, events.PY_YIELD, on_exit)
        mon.register_callback(tool, events.RAISE, on_raise)
        mon.register_callback(tool, events.RERAISE, on_raise)

    def go_raw(self) -> None:
        """Switch to callbacks that only append each boundary to the hook's raw record
        (called by the hook once armed, with ``--gpu`` and without ``--memory``)."""
        hook = self.hook
        codes = frozenset(self.codes)
        scratch: list[RawEvent] = []
        scratch_callbacks = _callbacks(hook, raw_recorder(hook, scratch), codes)
        hook.raw_cost = measure_raw_cost(_calibration(scratch_callbacks), scratch)
        if self.tool is not None and hook.raw is not None:
            self._register(_callbacks(hook, raw_recorder(hook, hook.raw), codes))

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


def _live_record(hook: BoundaryHook) -> BoundaryRecord:
    """Records one boundary through the hook's live bookkeeping (until it records raw)."""
    boundary = hook.boundary
    clock = time.perf_counter_ns

    def record(code: CodeType, line: int, key: int) -> None:
        boundary(clock(), code, line, key, line != 0)

    return record


def _callbacks(hook: BoundaryHook, record: BoundaryRecord, codes: frozenset[CodeType]) -> Callbacks:
    """sys.monitoring's line, exit and raise callbacks, each a boundary for ``record``."""
    getframe = sys._getframe

    def on_line(code: CodeType, line: int) -> None:
        record(code, line, id(getframe(1)))

    def on_exit(code: CodeType, offset: int, value: object) -> None:
        record(code, 0, id(getframe(1)))

    def on_raise(code: CodeType, offset: int, exc: BaseException) -> None:
        if code in codes:
            if isinstance(exc, KeyboardInterrupt):
                hook.interrupted = True
            record(code, 0, id(getframe(1)))

    return on_line, on_exit, on_raise


def _calibration(callbacks: Callbacks) -> Callable[[bool], None]:
    """One boundary of ``callbacks`` on :data:`CALIBRATION_CODE` (nobody profiles it):
    a line (``opening``) or an exit."""
    on_line, on_exit, _ = callbacks

    def call(opening: bool) -> None:
        if opening:
            on_line(CALIBRATION_CODE, 1)
        else:
            on_exit(CALIBRATION_CODE, 0, None)

    return call


class TraceInstaller:
    """Python 3.11 (and line_profiler's legacy core): a trace function around
    line_profiler's, which runs the hook first and then calls line_profiler."""

    kind = "sys.settrace"

    def __init__(self, hook: BoundaryHook, codes: list[CodeType]) -> None:
        self.hook = hook
        self.codes = frozenset(codes)
        self.local: Callable[..., Any] | None = None
        self.live = _live_record(hook)
        #: what records a boundary: live, then raw once the hook records raw (go_raw)
        self.record: BoundaryRecord = self.live

    def _make_local(self, then: Callable[..., Any]) -> Callable[..., Any]:
        """The frame-local trace function: the hook first, then ``then`` (line_profiler)."""
        hook = self.hook

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "line":
                self.record(frame.f_code, frame.f_lineno, id(frame))
            elif event == "return":
                self.record(frame.f_code, 0, id(frame))
            elif event == "exception" and issubclass(arg[0], KeyboardInterrupt):
                hook.interrupted = True
            then(frame, event, arg)
            return local

        return local

    def _calibration(self) -> Callable[[bool], None]:
        """One boundary (a line, ``opening``, or a return) of a frame nobody profiles,
        through the trace function with nothing behind it."""
        frame = calibration_frame()
        bare = self._make_local(lambda *args: None)
        return lambda opening: bare(frame, "line" if opening else "return", None)

    def calibrate(self) -> None:
        """Measure the hook's unseen cost; before line_profiler is enabled (its trace
        function would time the calibration itself). Without line_profiler behind the
        hook, the part of its call before it reads its clock stays billed (a fraction of
        a µs) rather than its whole call being subtracted."""
        self.hook.measure_residual(self._calibration())

    def go_raw(self) -> None:
        """Measure the raw boundary's unseen cost, then record each boundary in
        :attr:`BoundaryHook.raw`."""
        hook = self.hook
        scratch: list[RawEvent] = []
        self.record = raw_recorder(hook, scratch)
        try:
            hook.raw_cost = measure_raw_cost(self._calibration(), scratch)
        finally:
            self.record = self.live if hook.raw is None else raw_recorder(hook, hook.raw)

    def install(self) -> None:
        """Wrap the trace function line_profiler has just installed."""
        manager: Any = sys.gettrace()
        if manager is None:
            raise ProfilerBusy("line_profiler did not install its trace function")
        codes = self.codes
        self.hook.go_raw = self.go_raw
        forward_all = bool(getattr(manager, "wrap_trace", False))
        local = self.local = self._make_local(manager)

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

    def adopt_running_frames(self) -> None:
        """Put the hook in front of line_profiler in the profiled frames already running
        (the hook was installed while they ran: CUDA started within the session)."""
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame.f_code in self.codes:
                frame.f_trace = self.local
            frame = frame.f_back

    def uninstall(self) -> None:
        """Stop recording raw (a frame still running goes back to the live boundary);
        line_profiler's own disable puts its predecessor back."""
        self.record = self.live


def uses_legacy_trace() -> bool:
    from line_profiler import _diagnostics

    return bool(getattr(_diagnostics, "USE_LEGACY_TRACE", sys.version_info < (3, 12)))


def restore_trace(before: Callable[..., Any] | None) -> None:
    """line_profiler restores the trace function it found; make sure it did."""
    if sys.gettrace() is not before:
        sys.settrace(before)
