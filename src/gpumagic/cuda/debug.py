"""Debugging CUDA work: torch's sync-debug modes, catching hidden host syncs, the
CUPTI kernel profile, asynchronous CUDA errors and the per-op synchronize mode."""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpumagic.cuda.discovery import is_initialized, require, torch_module
from gpumagic.cuda.runtime import FLUSH_LABEL, devices_with_context, synchronize

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

__all__ = [
    "RUN_LABEL",
    "SYNC_WARNING_MESSAGE",
    "AsyncCudaError",
    "ImplicitSyncError",
    "KernelProfile",
    "SyncEvent",
    "async_error",
    "catch_syncs",
    "forbid_implicit_sync",
    "get_sync_debug_mode",
    "profile_kernels",
    "set_sync_debug_mode",
    "sync_after_each_op",
]


#: The text torch warns with, in ``set_sync_debug_mode("warn")``, when an operation
#: makes the host wait for the GPU (``.item()``, ``.cpu()``, ``nonzero()``...), and
#: raises with under ``"error"``.
SYNC_WARNING_MESSAGE = "called a synchronizing CUDA operation"


def get_sync_debug_mode() -> int:
    """torch's sync debug mode (0 off, 1 warn, 2 error); 0 before CUDA is initialised."""
    if not is_initialized():
        return 0
    return int(torch_module()._C._cuda_get_sync_debug_mode())


def set_sync_debug_mode(mode: int) -> None:
    """Set torch's sync debug mode; only call it once CUDA is initialised. torch's
    "prototype feature" warning on switching it is not shown."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        torch_module()._C._cuda_set_sync_debug_mode(mode)


@dataclass(frozen=True)
class KernelProfile:
    """CUPTI's record of a profiled stretch of iterations (times in µs)."""

    busy_us: float
    span_us: float | None
    kernels: tuple[tuple[str, int, float], ...]
    flushes_removed: int
    #: With ``steps`` > 1: the busy time of each run, in order; empty when the record
    #: could not be split into runs (every run must have some, and they must add up).
    runs_us: tuple[float, ...] = ()


#: ``record_function`` label of each profiled run when there are several (numbered).
RUN_LABEL = "gpumagic.run"


def profile_kernels(
    warm: Callable[[], object],
    run: Callable[[], object],
    devices: Iterable[int],
    flushes: int = 0,
    steps: int = 1,
) -> KernelProfile:
    """Kernel, copy and memset time of ``run()`` from CUPTI (torch.profiler).

    ``warm()`` runs during the profiler's warm-up step, whose records are dropped (a fresh
    profiler session can lose the first activities). With ``flushes`` > 0, kernels launched
    inside :func:`flush_l2` are taken out of the figures. With ``steps`` > 1, ``run()`` is
    called that many times (each must wait for its own GPU work before it returns), each
    under a label of its own, and :attr:`KernelProfile.runs_us` splits the busy time by run.
    """
    import warnings

    torch = torch_module()
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    devices = list(devices)
    activities = [ProfilerActivity.CUDA]
    if flushes or steps > 1:
        activities.append(ProfilerActivity.CPU)

    def record() -> Any:
        with profile(
            activities=activities, schedule=schedule(wait=0, warmup=1, active=1, repeat=1)
        ) as prof:
            warm()
            synchronize(devices)
            prof.step()
            if steps > 1:
                for i in range(steps):
                    with record_function(f"{RUN_LABEL}{i}"):
                        run()
            else:
                run()
            synchronize(devices)
            prof.step()
        return prof

    with warnings.catch_warnings():
        # One cycle only: torch's note that later cycles drop this one's events does not
        # concern us.
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        prof = record()
    return _kernel_profile(prof.events(), torch.autograd.DeviceType, flushes, steps)


def _run_of(start: float, starts: list[float]) -> int:
    """The run whose label began last at or before ``start`` (-1: before them all)."""
    found = -1
    for i, s in enumerate(starts):
        if s <= start:
            found = i
    return found


def _kernel_profile(events: Any, device_type: Any, flushes: int, steps: int = 1) -> KernelProfile:
    labels = {f"{RUN_LABEL}{i}": i for i in range(steps)} if steps > 1 else {}
    annotations = {FLUSH_LABEL, *labels} | {
        e.name
        for e in events
        if e.device_type == device_type.CPU and getattr(e, "is_user_annotation", False)
    }
    on_device = [
        e
        for e in events
        if e.device_type == device_type.CUDA
        and not getattr(e, "is_user_annotation", False)
        and e.name not in annotations
        and not e.name.startswith("ProfilerStep")
    ]
    # Each run's label on the host: its kernels start after it began (they are launched
    # inside it) and end before the next one begins (each run waits for its own work).
    starts = [0.0] * len(labels)
    for e in events:
        if e.device_type == device_type.CPU and e.name in labels:
            starts[labels[e.name]] = e.time_range.start
    per_run = [0.0] * len(labels)
    totals: dict[str, list[float]] = {}
    for e in on_device:
        entry = totals.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.end - e.time_range.start
        if labels:
            i = _run_of(e.time_range.start, starts)
            if i >= 0:
                per_run[i] += e.time_range.end - e.time_range.start
    removed = 0
    if flushes:
        ranges = [
            (e.time_range.start, e.time_range.end)
            for e in events
            if e.name == FLUSH_LABEL and e.device_type == device_type.CPU
        ]
        for e in events:
            if e.device_type != device_type.CPU or getattr(e, "is_user_annotation", False):
                continue
            if not any(lo <= e.time_range.start <= hi for lo, hi in ranges):
                continue
            for kernel in getattr(e, "kernels", ()):
                found = totals.get(kernel.name)
                if found is not None and found[0] > 0:
                    found[0] -= 1
                    found[1] -= kernel.duration
                    removed += 1
                    if labels:
                        i = _run_of(e.time_range.start, starts)
                        if i >= 0:
                            per_run[i] -= kernel.duration
    kernels = tuple(
        sorted(
            ((name, int(c), float(us)) for name, (c, us) in totals.items() if c > 0),
            key=lambda k: -k[2],
        )
    )
    span = None
    if on_device and not flushes:
        span = max(e.time_range.end for e in on_device) - min(e.time_range.start for e in on_device)
    busy = sum(k[2] for k in kernels)
    runs: tuple[float, ...] = ()
    if labels and all(r > 0 for r in per_run) and abs(sum(per_run) - busy) <= 1e-3 * busy:
        runs = tuple(float(r) for r in per_run)
    return KernelProfile(
        busy_us=busy, span_us=span, kernels=kernels, flushes_removed=removed, runs_us=runs
    )


@dataclass(frozen=True)
class SyncEvent:
    """One host synchronization caught by :func:`catch_syncs`."""

    op: str
    filename: str
    lineno: int


_DUNDER_OPS = {
    "__bool__": "bool(tensor)",
    "__int__": "int(tensor)",
    "__float__": "float(tensor)",
    "__index__": "using a tensor as an index",
    "__format__": "formatting a tensor",
    "__repr__": "printing a tensor",
    "__str__": "printing a tensor",
    "__array__": "tensor to numpy",
    "__iter__": "iterating over a tensor",
}


def _op_name(func: Any) -> str:
    name = str(getattr(func, "__name__", func))
    if name in _DUNDER_OPS:
        return _DUNDER_OPS[name]
    qualname = str(getattr(func, "__qualname__", name))
    if qualname.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + name
    module = str(getattr(func, "__module__", "") or "torch")
    return f"{module}.{name}" if not qualname.startswith(module) else qualname


@functools.cache
def _sync_mode_class() -> type:
    base: Any = torch_module().overrides.TorchFunctionMode

    class SyncSites(base):  # type: ignore[misc]
        """Attributes each sync warning to the torch call that raised it and its caller."""

        def __init__(
            self, caught: list[Any], code_files: frozenset[str], is_user: Callable[[str], bool]
        ) -> None:
            super().__init__()
            self.caught = caught
            self.code_files = code_files
            self.is_user = is_user
            self.events: list[SyncEvent] = []
            self.seen: set[int] = set()

        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            before = len(self.caught)
            try:
                return func(*args, **(kwargs or {}))
            finally:
                for w in self.caught[before:]:
                    if SYNC_WARNING_MESSAGE in str(w.message) and id(w) not in self.seen:
                        self.seen.add(id(w))
                        filename, lineno = self._caller()
                        self.events.append(SyncEvent(_op_name(func), filename, lineno))

        def _caller(self) -> tuple[str, int]:
            frame: Any = sys._getframe(2)
            fallback: tuple[str, int] | None = None
            while frame is not None:
                name = frame.f_code.co_filename
                if name in self.code_files:
                    return name, frame.f_lineno
                if fallback is None and self.is_user(name):
                    fallback = (name, frame.f_lineno)
                frame = frame.f_back
            return fallback or ("<unknown>", 0)

    return SyncSites


def catch_syncs(
    run: Callable[[], object], code_files: Iterable[str], *, is_user: Callable[[str], bool]
) -> list[SyncEvent]:
    """Run ``run()`` under ``torch.cuda.set_sync_debug_mode("warn")`` and return each host
    synchronization it caused, named by op and source line. The previous mode is put back.

    The line is the innermost frame in ``code_files`` (the caller's compiled code), else
    the innermost frame whose file name ``is_user`` accepts: what counts as the user's
    code is the caller's rule (:class:`gpumagic.stacks.FrameFilter`), not the seam's.
    """
    import warnings

    torch = torch_module()
    previous = get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mode = _sync_mode_class()(caught, frozenset(code_files), is_user)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with mode:
                run()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    events: list[SyncEvent] = list(mode.events)
    for w in caught:
        if SYNC_WARNING_MESSAGE in str(w.message) and id(w) not in mode.seen:
            events.append(SyncEvent("a torch internal call", w.filename, w.lineno))
    return events


@dataclass(frozen=True)
class AsyncCudaError:
    """A CUDA error that surfaced when synchronizing, after the work that caused it."""

    message: str
    #: The context stayed unusable: a second synchronize failed as well (device-side
    #: assert, illegal address...), so every later CUDA call in the process fails.
    sticky: bool


def _synchronize_error() -> str | None:
    try:
        synchronize(devices_with_context())
    except RuntimeError as error:  # torch.AcceleratorError (torch >= 2.8) is one
        return str(error)
    return None


def async_error() -> AsyncCudaError | None:
    """Synchronize every device this process uses; the error that surfaces, if any.

    The post-test health check. Returns ``None`` at once (no torch import, no CUDA
    call) when torch has not initialised CUDA; else costs one device synchronize per
    device with a context. A failing synchronize is tried once more: a sticky error
    fails again, because it leaves the context unusable.
    """
    if not is_initialized():
        return None
    first = _synchronize_error()
    if first is None:
        return None
    return AsyncCudaError(first, sticky=_synchronize_error() is not None)


def _first_cuda_device(torch: Any, values: tuple[Any, ...]) -> int | None:
    """The device index of the first CUDA tensor among ``values`` (one level of lists)."""
    for value in values:
        first = (value[0] if value else None) if isinstance(value, list | tuple) else value
        if isinstance(first, torch.Tensor) and first.is_cuda:
            return int(first.device.index)
    return None


@functools.cache
def _sync_after_each_op_mode() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    torch = torch_module()

    class SyncAfterEachOp(TorchDispatchMode):  # type: ignore[no-untyped-call]
        """Synchronize the device after every op that touched a CUDA tensor."""

        def __init__(self, note: Callable[[str], str] | None) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.note = note

        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
        ) -> Any:
            __tracebackhide__ = True
            out = func(*args, **(kwargs or {}))
            device = _first_cuda_device(torch, (out, *args))
            if device is None or torch._C._cuda_isCurrentStreamCapturing():
                return out
            try:
                synchronize((device,))
            except RuntimeError as error:
                if self.note is not None:
                    error.add_note(self.note(str(func)))
                # The error belongs to the line that called the op, not to synchronize().
                raise error.with_traceback(None) from None
            return out

    return SyncAfterEachOp


def sync_after_each_op(
    note: Callable[[str], str] | None = None,
) -> contextlib.AbstractContextManager[Any]:
    """A ``TorchDispatchMode``: synchronize after every torch op on a CUDA tensor.

    An asynchronous error is then raised by the op that queued the failing kernel, at
    its line, without restarting the process; ``note(op)``, where given, is added to
    that error (the caller's words, naming the op). Ops on CPU tensors are not synchronized,
    nor ops inside a CUDA graph capture. Kernels launched outside torch's dispatcher
    (Triton launched directly, CuPy, custom extensions called without an op) are not
    seen.
    """
    mode: contextlib.AbstractContextManager[Any] = _sync_after_each_op_mode()(note)
    return mode


class ImplicitSyncError(RuntimeError):
    """An implicit host-device synchronization inside :func:`forbid_implicit_sync`."""

    def __init__(self, op: str | None, message: str) -> None:
        super().__init__(message)
        #: The torch op that synchronized (``aten._local_scalar_dense.default``), when
        #: it went through torch's dispatcher.
        self.op = op


@functools.cache
def _name_implicit_sync_mode() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    class NameImplicitSync(TorchDispatchMode):  # type: ignore[no-untyped-call]
        """Turn torch's "called a synchronizing CUDA operation" into an error naming the op."""

        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
        ) -> Any:
            __tracebackhide__ = True
            try:
                return func(*args, **(kwargs or {}))
            except RuntimeError as error:
                message = str(error)
                if SYNC_WARNING_MESSAGE not in message:
                    raise
                raise ImplicitSyncError(str(func), message.splitlines()[0]) from None

    return NameImplicitSync


@contextlib.contextmanager
def forbid_implicit_sync() -> Iterator[None]:
    """Raise :class:`ImplicitSyncError` when code in the block makes the host wait.

    ``torch.cuda.set_sync_debug_mode("error")`` plus a dispatch mode that names the op;
    the previous mode is put back afterwards. Creates a CUDA context; raises
    :class:`CudaUnavailable` without CUDA. It cannot see explicit synchronization
    (``torch.cuda.synchronize()``, ``Event/Stream.synchronize()``) nor syncs outside
    torch's kernels (CuPy, extensions), and torch documents the mode as a prototype
    that misses some ops (``torch.distributed``, ``torch.sparse``). The mode is
    process-wide: other threads are affected while the block runs.
    """
    import warnings

    require()
    torch = torch_module()
    torch.cuda.init()
    previous = get_sync_debug_mode()
    with warnings.catch_warnings():
        # torch warns once that the mode is a prototype; the docs say so instead.
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        set_sync_debug_mode(2)
    try:
        with _name_implicit_sync_mode()():
            yield
    finally:
        set_sync_debug_mode(previous)
