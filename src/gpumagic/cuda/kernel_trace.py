"""CUPTI's record of the GPU work a stretch of code ran, with the torch ops that launched
it: torch.profiler (Kineto), read back as plain records for ``%lprun --gpu``.

:func:`start_kernel_trace` starts torch.profiler with the CPU activity (every torch op
with its thread, host times, autograd sequence number and, for a backward node, the
thread of its forward) and the CUDA activity (kernels, copies and memsets with their
durations, each linked to the op that launched it, and the runtime calls that launched
them). :meth:`KernelRecorder.mark` puts a named mark in that record and says when, on
``time.perf_counter_ns``, it was made: the caller's clock is matched to the profiler's
with them. :meth:`KernelRecorder.stop` returns a :class:`KernelTrace` of plain
dataclasses; nothing of torch outlives the call. No CUDA event, no synchronize: the
profiler's own ``stop`` waits for the current device once, at the end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from gpumagic.cuda.discovery import torch_module

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = [
    "DeviceWork",
    "HostOp",
    "KernelRecorder",
    "KernelTrace",
    "RuntimeCall",
    "profiler_running",
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
    name says where torch does not expose it."""
    found = getattr(event, "activity_type", None)
    if found is not None:
        return str(found()).lower()  # some builds say "Kernel"
    name = event.name()
    if event.device_type() == device_type.CUDA:
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


class KernelRecorder:
    """A running torch.profiler with the CPU and CUDA activities (see the module doc)."""

    def __init__(self, *, cuda: bool = True) -> None:
        torch = torch_module()
        # torch.autograd's profiler, not torch.profiler.profile: the latter imports
        # torch._inductor on its first start (seconds), for nothing we use.
        from torch.autograd.profiler import profile

        self._torch = torch
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
        """Record a mark named ``label`` on this thread; the ``perf_counter_ns`` read just
        before and just after it began."""
        clock = time.perf_counter_ns
        before = clock()
        handle = self._enter(label, None)
        after = clock()
        self._exit(handle)
        return before, after

    def stop(self) -> KernelTrace:
        """Stop the profiler and read its record."""
        self._profile.__exit__(None, None, None)
        results = self._profile.kineto_results
        return trace_from_events(results.events(), self._torch.autograd.DeviceType)


def start_kernel_trace(*, cuda: bool = True) -> KernelRecorder:
    """Start recording torch ops and (``cuda``) the GPU work they launch."""
    return KernelRecorder(cuda=cuda)
