"""What runs at every line boundary of ``%lprun``'s profiled code (see :mod:`gpumagic.lineprof`).

:class:`BoundaryHook` is called before line_profiler reads its clock. Once CUDA is in
use it synchronizes every device with a context (so the line that launched the work
waits for it), counts the synchronizing calls torch reports, reads the allocator's
counters and, for ``--gpu``, records when each line ran and the thread's next autograd
sequence number then (no CUDA event, no wait:
:mod:`gpumagic.lineprof_kernels` charges each kernel to its line after the run); it
measures its own cost so the profiler can subtract it. All CUDA calls go through
:mod:`gpumagic.cuda`; :func:`statement_lines` and :func:`peak_above` are lineprof_record's.

With ``--gpu`` and without ``--memory`` (whose allocator reads belong to each boundary)
the installer switches, once the hook is armed, to callbacks that only synchronize
unless ``--no-sync`` (:attr:`BoundaryHook.raw_wait`) and record each boundary
(:mod:`gpumagic.lineprof_raw`); :meth:`BoundaryHook.finish` replays them through the live
boundary's bookkeeping (:meth:`BoundaryHook._advance`). ``--gpu``'s line timeline holds
an entry per boundary anyway; without it the live boundary keeps nothing per boundary,
so a long loop's memory stays flat.
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from threading import get_ident, get_native_id
from typing import TYPE_CHECKING, Any

from gpumagic import cuda
from gpumagic.lineprof_kernels import KernelLines
from gpumagic.lineprof_record import CodeInfo, peak_above, statement_lines

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import CodeType, FrameType

    from gpumagic.lineprof_raw import RawEvent
    from gpumagic.lineprof_record import Marks, Record
    from gpumagic.lineprof_timeline import LineEvent

__all__ = [
    "CALIBRATION_CODE",
    "BoundaryHook",
    "calibration_frame",
    "peak_above",
    "statement_lines",
]


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
        #: torch's synchronizing-call warnings so far, by thread: each goes to the line its
        #: own thread was on
        self.warned: dict[int, int] = {}
        self.mode_before: int | None = None
        self.restore_mode: int | None = None
        #: --gpu without --memory, once armed: the boundaries recorded raw, replayed by
        #: finish()
        self.raw: list[RawEvent] | None = None
        #: what a raw boundary calls first: the synchronize (None: --no-sync, or failed)
        self.raw_wait: Callable[[], object] | None = None
        #: the native id of each thread seen in :attr:`raw` (CUPTI names threads so)
        self.natives: dict[int, int] = {}
        #: the thread's next autograd sequence number, for the raw callbacks
        self.raw_seq: Callable[[], int] = int
        #: what each raw boundary costs (measured once: charged to each, in the replay)
        self.raw_cost = 0
        #: set by the installer: switch its callbacks to the raw ones (see go_raw)
        self.go_raw: Callable[[], None] | None = None
        # The seam's functions, looked up once (tests swap them before a session).
        self._devices_with_context = cuda.devices_with_context
        self._visible_device_total = cuda.visible_device_total
        self._synchronize = cuda.synchronize
        self._capturing = cuda.stream_is_capturing
        self._marks = cuda.allocation_marks

    # -- the boundary ---------------------------------------------------------------

    def boundary(self, t0: int, code: CodeType, line: int, key: int, opening: bool) -> None:
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
                    self._close_syncs(state)
            else:
                waited, marks = self._cuda_boundary(state)
        kernels = self.kernels
        seq = 0 if kernels is None else kernels.sequence_nr()
        adjust = self.residual - max(0, waited - self.floor)
        self._advance(t0, get_ident(), key, code, line, opening, state, marks, seq, 0, adjust)

    def _advance(  # noqa: PLR0917 (the hot path: one call, no packing)
        self,
        t0: int,
        tid: int,
        key: int,
        code: CodeType,
        line: int,
        opening: bool,
        state: _Open | None,
        marks: dict[int, Marks] | None,
        seq: int,
        end: int,
        adjust: int,
    ) -> None:
        """The bookkeeping of one boundary, live or replayed: the frame's line, the
        statement entered, the timeline event, and the hook's cost (``end - t0 +
        adjust``; ``end`` 0: now) charged to the line it closes."""
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
            state.syncs = self.warned.get(tid, 0)
            kernels = self.kernels
            if kernels is not None:
                if tid == self.timeline_thread and kernels is self.timeline_of:
                    events = self.timeline_events
                else:
                    events = self._timeline(kernels, tid)
                where = info.wheres.get(stmt) or info.where(stmt)
                events.append((t0, key, where, seq))
        elif state is None:
            prior = -1
        else:
            prior = state.spent
            closed = state.line
            info = state.info
            del self.frames[key]
            kernels = self.kernels
            if kernels is not None:
                self._timeline(kernels, tid).append((t0, key, None, seq))
        spent = self.spent.get(tid, 0)
        cost = (end or time.perf_counter_ns()) - t0 + adjust
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
            self.timeline_events = kernels.thread_events(tid, self.natives.get(tid))
        return self.timeline_events

    # -- the raw record (--gpu without --memory) ----------------------------------------

    def _start_raw(self, go_raw: Callable[[], None]) -> None:
        """From now on the installer's callbacks only synchronize (unless --no-sync) and
        record each boundary raw. The synchronizes of their calibration are not counted."""
        kernels = self.kernels
        record = self.record
        self.raw_seq = int if kernels is None else kernels.sequence_nr
        self.raw_wait = self._cuda_boundary if self.sync else None
        self.raw = []
        counted = record.syncs, record.capture_skips
        try:
            go_raw()
        except BaseException:
            self.raw = self.raw_wait = None
            raise
        finally:
            record.calibration_syncs += record.syncs - counted[0]
            record.syncs, record.capture_skips = counted

    def note_thread(self, tid: int) -> None:
        """A raw callback saw thread ``tid`` (the calling thread) for the first time."""
        self.natives[tid] = get_native_id()

    def replay(self) -> None:
        """Run the raw record through the live boundary's bookkeeping, in the order it
        was recorded (every thread's boundaries and warnings interleaved as they came)."""
        raw, self.raw = self.raw, None
        if not raw:
            return
        frames = self.frames
        cost = self.raw_cost
        advance = self._advance
        for t0, tid, key, code, line, seq in raw:
            if code is None:
                self.warned[tid] = self.warned.get(tid, 0) + 1
                continue
            state = frames.get(key)
            if state is not None:
                if state.code is not code:
                    state = None
                else:
                    self._close_syncs(state)
            advance(t0, tid, key, code, line, line != 0, state, None, seq, t0, cost)

    def _cuda_boundary(self, state: _Open | None = None) -> tuple[int, dict[int, Marks] | None]:
        """Synchronize, read the allocator; close the line's syncs and memory figures
        (a raw boundary's :attr:`raw_wait`: no state, nothing to close; its wait stays
        billed to the line it closes, as the raw cost taken off is an idle one's)."""
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
            if state is not None:
                if self.gpu:
                    self._close_syncs(state)
                if marks is not None and state.marks is not None:
                    state.info.extra(state.line).add_memory(state.marks, marks)
        except Exception as exc:  # a CUDA error must not break the user's code
            self._fail(exc)
        return waited, marks

    def _close_syncs(self, state: _Open) -> None:
        """Charge the synchronizing calls its thread made since ``state``'s line opened
        to that line (no entry for a line that made none)."""
        warned = self.warned.get(state.thread, 0)
        if warned != state.syncs:
            state.info.extra(state.line).syncs += warned - state.syncs

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
            if self.gpu and not self.memory and self.go_raw is not None:
                self._start_raw(self.go_raw)  # within this boundary: its cost is ours
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
        self.record.calibration_syncs += 1 + len(samples)

    def _fail(self, exc: Exception) -> None:
        self.record.failure = f"{type(exc).__name__}: {exc}".strip()
        self.armed = False
        self.armable = False
        self.raw_wait = None

    def finish(self) -> None:
        """After the run: replay the raw record, charge the recorded GPU work to its
        lines, put the sync debug mode back."""
        record = self.record
        try:
            if self.raw is not None:
                started = time.perf_counter()
                self.replay()
                record.trace_cost.replay_s += time.perf_counter() - started
            self._finish_kernels()
        finally:
            if self.restore_mode is not None:
                with contextlib.suppress(Exception):
                    cuda.set_sync_debug_mode(self.restore_mode)
                self.restore_mode = None

    def _finish_kernels(self) -> None:
        kernels, self.kernels = self.kernels, None
        if kernels is None:
            return
        record = self.record
        try:
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
                    raw = self.raw
                    if raw is None:
                        tid = get_ident()
                        self.warned[tid] = self.warned.get(tid, 0) + 1
                    else:  # charged to its line by the replay, in its place
                        raw.append((time.perf_counter_ns(), get_ident(), 0, None, 0, 0))
                    if self.mode_before == 1:  # the user asked for these warnings
                        shown(message, category, filename, lineno, file, line)
                    return
                shown(message, category, filename, lineno, file, line)

            warnings.showwarning = showwarning
            yield
