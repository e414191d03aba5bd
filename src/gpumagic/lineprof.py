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
line that launched the work waits for it; not with ``sync=False``), records when each
line ran while torch.profiler records the GPU work, each kernel charged to its line
after the run (``gpu``, :mod:`gpumagic.lineprof_kernels`), counts the synchronizing
calls torch reports per line (``gpu``), and reads the allocator's counters
(``memory``). It measures its own cost and subtracts it from
every line whose time enclosed it, and it counts each multi-line statement once. All
CUDA calls go through :mod:`gpumagic.cuda`. Nothing here imports IPython.
"""

from __future__ import annotations

import builtins
import contextlib
import dis
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from line_profiler import LineProfiler, LineStats
from line_profiler._line_profiler import label as _code_label

from gpumagic import cuda
from gpumagic.lineprof_hook import BoundaryHook
from gpumagic.lineprof_install import (
    MonitoringInstaller,
    TraceInstaller,
    restore_trace,
    uses_legacy_trace,
)
from gpumagic.lineprof_record import CodeInfo, Label, LineExtras, Record

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import CodeType

    from gpumagic.lineprof_attribution import GpuAttribution
    from gpumagic.lineprof_kernels import TraceCost

__all__ = [
    "GpuLineProfiler",
    "LineProfileResult",
    "patched_builtins_profile",
]

# -- torch.compile and nn.Module ----------------------------------------------------


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
        if isinstance(name, str) and cuda.is_compiled(namespace.get(name)):
            line = instruction.positions.lineno if instruction.positions else None
            if line is not None:
                found.append((line, name))
    return found


# -- the profiler -------------------------------------------------------------------


@dataclass
class LineProfileResult:
    """One profile: line_profiler's stats (host time per line, GPU-correct when
    synchronized) plus what gpumagic measured per line, and what to tell the user."""

    #: line_profiler's stats: hits and host time per line (GPU-correct when synchronized),
    #: gpumagic's own cost removed.
    stats: LineStats
    #: What gpumagic measured per line (GPU time, syncs, memory), by function and line.
    extras: dict[Label, dict[int, LineExtras]]
    #: Whether the devices were synchronized at every line boundary.
    sync: bool
    #: Whether GPU time and synchronizing calls were measured per line (``--gpu``).
    gpu: bool
    #: Whether the allocator was read per line (``--memory``).
    memory: bool
    #: Whether the profiled code used CUDA.
    cuda_used: bool
    #: The devices it used.
    devices: tuple[int, ...]
    #: How many synchronizations the line boundaries made.
    syncs: int
    #: Line boundaries inside a CUDA graph capture, where nothing could be synchronized or
    #: recorded.
    capture_skips: int
    #: What an idle synchronize costs, in ns (measured; not charged to the lines).
    sync_floor_ns: int
    #: Synchronizations on the idle GPU that measured the hook's own cost (not at line
    #: boundaries, not in the profile).
    calibration_syncs: int
    #: The CUDA error after which gpumagic stopped its own CUDA work, if any.
    failure: str | None
    #: How lines were seen: ``"sys.monitoring"``, ``"sys.settrace"`` or ``"none"``.
    hook: str
    #: Wall time of the profiled statement, in seconds.
    wall_s: float
    #: For a statement over several lines: each line's first line, by function.
    statements: dict[Label, dict[int, int]]
    #: What the table should say about the targets and the run, one sentence each.
    notes: list[str] = field(default_factory=list)
    #: A message to show above the table (why nothing was profiled, for instance).
    message: str | None = None
    #: ``--gpu``: every kernel, copy and memset charged to its line (``None``: none
    #: recorded).
    kernels: GpuAttribution | None = None
    #: ``--gpu``: why the kernels could not be recorded or matched to lines, if so.
    kernels_failure: str | None = None
    #: ``--gpu``: what recording the kernels and the line timeline cost.
    trace_cost: TraceCost | None = None
    #: Synchronizations made after the run (one with ``--no-sync``, so the record is whole).
    end_syncs: int = 0

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
    time of a line includes the GPU work it launched); ``gpu`` charges each kernel, copy
    and memset CUPTI recorded to the line that launched it (no event or wait per line)
    and counts synchronizing calls; ``memory`` reads the allocator per line. Use
    :meth:`add_target` for the callables, :meth:`session` around the code to profile;
    :meth:`get_stats` returns line_profiler ``LineStats`` with gpumagic's own cost
    removed and multi-line statements counted once.
    """

    def __init__(
        self, *functions: Any, sync: bool = True, gpu: bool = False, memory: bool = False
    ) -> None:
        #: Whether the devices in use are synchronized after every profiled line.
        self.sync = sync
        #: Whether each line gets CUDA events and a count of its synchronizing calls.
        self.gpu = gpu
        #: Whether the allocator is read at every line boundary.
        self.memory = memory
        #: What the table should say about the targets (a torch.compile'd callable that
        #: cannot be line-profiled, an ``nn.Module`` profiled through its ``forward``).
        self.notes: list[str] = []
        self._record = Record()
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
        if cuda.is_compiled(obj):
            self.notes.append(
                f"{shown} is torch.compile'd: it runs as generated code, so it has no line "
                "timings of its own and shows as one opaque line in the functions that "
                "call it. Profile the uncompiled function to see its lines."
            )
            return 0
        if cuda.is_module(obj) and not callable(getattr(obj, "__code__", None)):
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
                record.codes[code] = CodeInfo(code)
        hook = BoundaryHook(record, sync=self.sync, gpu=self.gpu, memory=self.memory)
        legacy = uses_legacy_trace()
        installer: MonitoringInstaller | TraceInstaller = (
            TraceInstaller(hook, codes) if legacy else MonitoringInstaller(hook, codes)
        )
        trace_before = sys.gettrace()
        started = time.perf_counter()
        # Without CUDA in use there is nothing to synchronize: line_profiler's tracer
        # alone runs, with its own numbers, until torch starts CUDA (if it does).
        wanted = bool(codes) and (self.sync or self.gpu or self.memory)
        now = wanted and bool(cuda.devices_with_context())
        with contextlib.ExitStack() as stack:
            if self.gpu:
                stack.enter_context(hook.counting_sync_warnings())
            stack.callback(hook.finish)
            record.hook = "none"
            if legacy:
                stack.callback(restore_trace, trace_before)
            if now and isinstance(installer, TraceInstaller):
                installer.calibrate()
            self.enable_by_count()
            stack.callback(self.disable_by_count)
            late = _LateStart(installer, record)
            stack.callback(late.close)
            if now:
                late.start()
            elif wanted and not cuda.is_initialized():
                # Called back at once if CUDA is initialised: only while it is not yet.
                cuda.on_cuda_init(late.start_within_cuda_init)
            try:
                yield
            finally:
                record.wall_s += time.perf_counter() - started

    def runctx(
        self, cmd: str | CodeType, globals: dict[str, Any], locals: dict[str, Any]
    ) -> GpuLineProfiler:
        """Run ``cmd`` (source, or code compiled from it) under :meth:`session`
        (line_profiler's ``runctx``)."""
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
        multi-line statement counted once, on its first line; line_profiler's own stats
        when the hook never ran (no CUDA in use)."""
        raw = self.raw_stats()
        if self._record.hook == "none":
            return raw  # no CUDA was used: line_profiler's tracer alone ran
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

    def _infos_by_label(self) -> dict[Label, list[CodeInfo]]:
        found: dict[Label, list[CodeInfo]] = {}
        for info in self._record.codes.values():
            found.setdefault(info.label, []).append(info)
        return found

    def result(self, message: str | None = None) -> LineProfileResult:
        """Everything measured so far, ready for :mod:`gpumagic.lineprof_result`."""
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
            calibration_syncs=record.calibration_syncs,
            failure=record.failure,
            hook=record.hook,
            wall_s=record.wall_s,
            statements=statements,
            notes=notes,
            message=message,
            kernels=record.gpu,
            kernels_failure=record.gpu_failure,
            trace_cost=record.trace_cost,
            end_syncs=record.end_syncs,
        )


class _LateStart:
    """Installs the boundary hook now, or when torch starts CUDA during the session (as
    torch's lazy initialisation calls it back: it must not raise); uninstalls it at the
    end. A late start after the session has ended does nothing."""

    def __init__(self, installer: MonitoringInstaller | TraceInstaller, record: Record) -> None:
        self.installer = installer
        self.record = record
        self.installed = False
        self.closed = False

    def start(self) -> None:
        if self.installed or self.closed:
            return
        installer = self.installer
        if isinstance(installer, TraceInstaller):
            if sys.gettrace() is None:
                return  # line_profiler is no longer tracing this thread
            installer.install()
            installer.adopt_running_frames()
        else:
            installer.install()
        self.installed = True
        self.record.hook = installer.kind

    def start_within_cuda_init(self) -> None:
        """:meth:`start`, called back by torch's lazy CUDA initialisation, where an
        exception would fail the user's first CUDA call: a failure is reported instead."""
        try:
            self.start()
        except Exception as exc:
            self.record.failure = self.record.failure or f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        self.closed = True
        if self.installed:
            self.installer.uninstall()
            self.installed = False


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
