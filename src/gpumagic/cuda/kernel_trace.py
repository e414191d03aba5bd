"""CUPTI's record of the GPU work a stretch of code ran: torch.profiler (Kineto), read
back as plain records for ``%lprun --gpu``.

:func:`start_kernel_trace` starts torch.profiler with the CPU activity and the CUDA
activity, then switches the CPU op collection off at once: what stays on is CUPTI's
record of every kernel, copy and memset (with its device duration) and of the runtime
or driver call that launched it (``cudaLaunchKernel``..., with the caller's OS thread
and host time): each kernel's line is found from its launch. Recording every torch op
(the CPU activity) is what makes torch.profiler slow, so torch ops are recorded only
while autograd's backward runs (:meth:`KernelRecorder.watch_backward`): a backward
node's op carries the sequence number and thread of the forward op that built it, which
is what charges backward kernels to forward lines (:func:`sequence_counter` reads the
forward side of that link). :meth:`KernelRecorder.mark` puts a named mark in the record
(while torch ops are collected) and says when, on ``time.perf_counter_ns``, it was made:
the caller's clock is matched to the profiler's with them. :meth:`KernelRecorder.stop`
returns a :class:`KernelTrace` of plain dataclasses; nothing of torch outlives the call.
No CUDA event, no synchronize: the profiler's own ``stop`` waits for the current device
once, at the end.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from gpumagic.cuda.discovery import torch_module

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

__all__ = [
    "DeviceWork",
    "HostOp",
    "KernelRecorder",
    "KernelTrace",
    "RuntimeCall",
    "profiler_running",
    "sequence_counter",
    "start_kernel_trace",
    "trace_from_events",
]


@dataclass(frozen=True, slots=True)
class HostOp:
    """A torch op (or a ``record_function`` label) as the profiler saw it on a host thread."""

    id: int  # the profiler's correlation id of the op; device work links to it
    name: str
    thread: int  # torch's id of the thread (not the OS one)
    start_ns: int
    end_ns: int
    seq: int = -1  # autograd sequence number (-1: none)
    fwd_thread: int = 0  # a backward node: the thread its forward ran on (0: not one)

    @property
    def backward_node(self) -> bool:
        """Whether this is autograd running a backward node (it carries its forward's
        sequence number and thread)."""
        return self.fwd_thread > 0 and self.seq >= 0


@dataclass(frozen=True, slots=True)
class DeviceWork:
    """One kernel, copy or memset, as CUPTI timed it on the device."""

    kind: str  # "kernel", "memcpy" or "memset"
    name: str
    duration_ns: int
    op: int  # the HostOp that was running when it was launched (0: none)
    correlation: int  # CUPTI's correlation id: the RuntimeCall that launched it
    device: int = 0
    stream: int = 0


@dataclass(frozen=True, slots=True)
class RuntimeCall:
    """A CUDA runtime or driver call (``cudaLaunchKernel``, ``cudaGraphLaunch``...)."""

    correlation: int
    name: str
    thread: int  # the caller's OS thread id (or pthread's, cut to 32 bits) from Kineto
    start_ns: int


@dataclass(frozen=True)
class KernelTrace:
    """What the profiler recorded, as plain records (times on the profiler's clock)."""

    ops: tuple[HostOp, ...] = ()
    work: tuple[DeviceWork, ...] = ()
    calls: tuple[RuntimeCall, ...] = ()


_WORK_KINDS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
_CALL_KINDS = ("cuda_runtime", "cuda_driver")
_OP_KINDS = ("cpu_op", "user_annotation")


def _kind(event: Any, device_type: Any) -> str:
    """``cpu_op``, ``kernel``, ``cuda_runtime``...: Kineto's activity type, or what the
    event says where torch does not expose it by name (torch 2.11 has no
    ``activity_type()``; some builds give Kineto's enum value)."""
    found = getattr(event, "activity_type", None)
    if found is not None:
        kind = found()
        if isinstance(kind, str):
            return kind.lower()  # some builds say "Kernel"
    on_device = event.device_type() == device_type.CUDA
    annotation = getattr(event, "is_user_annotation", None)
    if annotation is not None and annotation():
        # A record_function range; on the device, the span of the kernels launched in
        # it (Optimizer.step#SGD.step): not device work of its own.
        return "gpu_user_annotation" if on_device else "user_annotation"
    name = event.name()
    if on_device:
        if name.startswith("Memcpy"):
            return "gpu_memcpy"
        return "gpu_memset" if name.startswith("Memset") else "kernel"
    return "cuda_runtime" if name.startswith(("cuda", "cu")) and "::" not in name else "cpu_op"


def trace_from_events(events: Iterable[Any], device_type: Any) -> KernelTrace:
    """Kineto's events (``prof.profiler.kineto_results.events()``) as plain records."""
    ops: list[HostOp] = []
    work: list[DeviceWork] = []
    calls: list[RuntimeCall] = []
    for event in events:
        kind = _kind(event, device_type)
        if kind in _WORK_KINDS:
            work.append(
                DeviceWork(
                    kind=_WORK_KINDS[kind],
                    name=event.name(),
                    duration_ns=int(event.duration_ns()),
                    op=int(event.linked_correlation_id()),
                    correlation=int(event.correlation_id()),
                    device=int(event.device_index()),
                    stream=int(event.device_resource_id()),
                )
            )
        elif kind in _CALL_KINDS:
            calls.append(
                RuntimeCall(
                    correlation=int(event.correlation_id()),
                    name=event.name(),
                    # Not start_thread_id(): torch gives a runtime call its op's thread,
                    # and one with no op around it (torch.cuda._sleep, a Triton or
                    # extension launch) the thread that stopped the profiler. Kineto's
                    # resource id is the caller's own thread.
                    thread=int(event.device_resource_id()),
                    start_ns=int(event.start_ns()),
                )
            )
        elif kind in _OP_KINDS and event.device_type() == device_type.CPU:
            ops.append(
                HostOp(
                    id=int(event.correlation_id()),
                    name=event.name(),
                    thread=int(event.start_thread_id()),
                    start_ns=int(event.start_ns()),
                    end_ns=int(event.end_ns()),
                    seq=int(event.sequence_nr()),
                    fwd_thread=int(event.fwd_thread_id()),
                )
            )
    return KernelTrace(tuple(ops), tuple(work), tuple(calls))


def profiler_running() -> bool:
    """Whether a torch profiler is already recording (torch allows one per thread)."""
    return bool(torch_module()._C._autograd._profiler_enabled())


def sequence_counter() -> Callable[[], int]:
    """The function that gives the calling thread's next autograd sequence number (the
    number the next graph node built on that thread gets): bind it once, call it often."""
    return cast("Callable[[], int]", torch_module()._C._autograd._get_sequence_nr)


def _cpp_log_level() -> Any:
    """torch's C++ log level (``TORCH_CPP_LOG_LEVEL``'s flag in libc10), to be raised
    around a toggle of the CPU activity; None where the library does not export it."""
    names = {"win32": "c10.dll", "darwin": "libc10.dylib"}
    path = os.path.join(
        os.path.dirname(str(torch_module().__file__)), "lib", names.get(sys.platform, "libc10.so")
    )
    try:
        return ctypes.c_int.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_log_level")
    except (OSError, ValueError):
        return None


_ERROR_LEVEL = 2  # c10's GLOG_ERROR: warnings are not printed from it on


class KernelRecorder:
    """A running torch.profiler recording the CUDA activity, and torch ops only while
    they are switched on (see the module doc). Made and used on one thread."""

    def __init__(self, *, cuda: bool = True) -> None:
        torch = torch_module()
        # torch.autograd's profiler, not torch.profiler.profile: the latter imports
        # torch._inductor on its first start (seconds), for nothing we use.
        from torch.autograd.profiler import profile
        from torch.profiler import ProfilerActivity

        self._torch = torch
        self.thread = threading.get_ident()
        self.collecting = True  # torch ops are recorded (the profiler starts with them)
        self.backward_calls = 0
        self._depth = 0
        self._engine: Any = None
        self._on_backward: Callable[[], object] | None = None
        self._toggle = torch._C._autograd._toggle_collection_dynamic
        self._cpu = {ProfilerActivity.CPU}
        self._log_level = _cpp_log_level()
        self._profile: Any = cast("Any", profile)(  # its __enter__ is untyped
            use_cpu=True,
            use_device="cuda" if cuda else None,
            use_kineto=True,
            record_shapes=False,
            with_stack=False,
            profile_memory=False,
        )
        self._enter = torch.ops.profiler._record_function_enter_new
        self._exit = torch.ops.profiler._record_function_exit._RecordFunction
        self._profile.__enter__()

    def mark(self, label: str) -> tuple[int, int]:
        """Record a mark named ``label`` on this thread (it is in the record only while
        torch ops are collected); the ``perf_counter_ns`` read just before and just after
        it began."""
        clock = time.perf_counter_ns
        before = clock()
        handle = self._enter(label, None)
        after = clock()
        self._exit(handle)
        return before, after

    def collect_ops(self, on: bool) -> None:
        """Switch the recording of torch ops (the CPU activity) on or off; the CUDA
        activity goes on. torch logs a warning to stderr at every switch (about trace
        files, which we do not write): its C++ log level is raised around it."""
        if on == self.collecting:
            return
        flag = self._log_level
        level = flag.value if flag is not None else _ERROR_LEVEL
        if level < _ERROR_LEVEL:
            flag.value = _ERROR_LEVEL
        try:
            self._toggle(on, self._cpu)
            self.collecting = on
        finally:
            if level < _ERROR_LEVEL:
                flag.value = level

    def watch_backward(self, on_backward: Callable[[], object]) -> None:
        """Until :meth:`stop`, collect torch ops while autograd's backward runs on this
        thread (``Tensor.backward``, ``torch.autograd.backward`` and ``.grad`` all enter
        the engine through ``Variable._execution_engine.run_backward``: a stand-in takes
        its place, everything else passes through to the engine); ``on_backward`` is
        called just after the switch on, before the engine runs."""
        if self._engine is not None:
            return
        variable = self._torch.autograd.variable.Variable
        self._engine = variable._execution_engine
        self._on_backward = on_backward
        variable._execution_engine = _WatchedEngine(self._engine, self)

    def unwatch_backward(self) -> None:
        """Put autograd's own engine object back (the very object that was there)."""
        engine, self._engine = self._engine, None
        if engine is not None:
            self._torch.autograd.variable.Variable._execution_engine = engine

    def run_backward(self, engine: Any, args: Any, kwargs: Any) -> Any:
        """Run ``engine.run_backward`` with torch ops collected (the outermost call on
        this thread only: a nested one, or one on another thread, runs as it is)."""
        if self._depth or threading.get_ident() != self.thread:
            return engine.run_backward(*args, **kwargs)
        self._depth += 1
        try:
            self.collect_ops(True)
            self.backward_calls += 1
            if self._on_backward is not None:
                self._on_backward()
            return engine.run_backward(*args, **kwargs)
        finally:
            self._depth -= 1
            self.collect_ops(False)

    def stop(self) -> KernelTrace:
        """Put autograd's engine back, stop the profiler and read its record."""
        try:
            self.unwatch_backward()
        finally:
            self._profile.__exit__(None, None, None)
        results = self._profile.kineto_results
        return trace_from_events(results.events(), self._torch.autograd.DeviceType)


class _WatchedEngine:
    """Autograd's engine object while a :class:`KernelRecorder` watches backward."""

    __slots__ = ("_engine", "_recorder")

    def __init__(self, engine: Any, recorder: KernelRecorder) -> None:
        self._engine = engine
        self._recorder = recorder

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        return self._recorder.run_backward(self._engine, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def start_kernel_trace(*, cuda: bool = True) -> KernelRecorder:
    """Start recording (``cuda``) the GPU work and, while switched on, torch ops."""
    return KernelRecorder(cuda=cuda)
