"""The seam's runtime faked for the logic tests (the real GPU runs: ``*_gpu.py``).

:class:`FakeSeam` is a GPU as the ``%cudatime`` engine meets it: the host does a body's
work (:func:`busy_wait`), so its events read the host clock (or a :class:`FakeClock`,
through :meth:`FakeSeam.on_clock`); its board and SM clocks are a
:class:`fake_cuda.FakeMachine`. :class:`FakeDevice` is ``%lprun``'s asynchronous GPU:
``launch(seconds)`` queues work, ``synchronize`` and ``item`` wait for it in real time, its
events carry the work launched before them, and its memory is a
:class:`fake_cuda.FakeAllocator`. :class:`FakeClock` is a host clock for the engine
(``monkeypatch.setattr(timing, "time", clock)``) that moves only when told to.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from fake_cuda import FakeAllocator, FakeMachine, board, install
from gpumagic import cuda

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    import pytest

    Call = Callable[[], object]


@dataclass(eq=False)
class FakeClock:
    """A host clock that advances only when told to: exact times on a loaded host."""

    now: float = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def body(self, seconds: float) -> Callable[[], None]:
        """A body that takes exactly ``seconds`` on this clock."""
        return lambda: self.advance(seconds)


def busy_wait(seconds: float) -> None:
    """Keep the host busy for ``seconds`` of its real clock."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@dataclass(frozen=True)
class FakeEvent:
    at: float  # the host time at which the GPU passes the event
    gpu: float = 0.0  # FakeDevice: seconds of work launched before it


@dataclass
class FakeSeam:
    """The functions of ``gpumagic.cuda`` the timing engine uses, with host-clock events."""

    initialized: bool = True
    pending: float = 0.0
    capture_error: str | None = None
    busy_us: float = 100.0
    syncs_per_call: int = 0
    log: list[str] = field(default_factory=list)
    clock: Callable[[], float] = time.perf_counter  # what events and waits go by
    wait: Callable[[float], None] = time.sleep
    spend: Callable[[float], None] = field(default_factory=lambda: busy_wait)  # a body's work
    calls: int = 0
    fixed_span: float = 0.0
    slow_after: int = 0  # with fixed_span: 20 % slower once the body ran this often
    ticks: float = 0.0
    split_runs: bool = True  # CUPTI's record splits into the profiled runs
    flushed: bool = False
    machine: FakeMachine = field(
        default_factory=lambda: FakeMachine([board(0, "Fake GPU")], torch="2.x")
    )

    def on_clock(self, clock: FakeClock) -> FakeSeam:
        """Events, waits and :func:`counting` bodies on ``clock``: exact times on a loaded host
        (the engine's own host clock too needs ``monkeypatch.setattr(timing, "time", clock)``)."""
        self.clock = clock.perf_counter
        self.wait = clock.advance
        self.spend = clock.advance
        return self

    def install(self, monkeypatch: pytest.MonkeyPatch, **more: Any) -> Any:
        """This seam's machine, methods and answers, and ``more`` (a subclass's, which win)."""
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        self.machine.install(monkeypatch)
        log = self.log.append
        answers = {
            "is_initialized": lambda: self.initialized,
            "devices_with_context": lambda: (0,),
            "current_device": lambda: 0,
            "use_device": lambda index: log(f"device {index}") or contextlib.nullcontext(),
            "spin": lambda device, microseconds: log("spin"),
            "event_completed": lambda event: True,
            "elapsed_ms": lambda start, end, wait=True: (end.at - start.at) * 1e3,
            "current_streams": lambda devices: ["stream"],
            "restore_streams": lambda streams: log("restore streams"),
            "device_peaks": lambda device: cuda.DevicePeaks("Fake GPU", 3.35e12),
        }
        install(monkeypatch, self, **answers | more)
        return self

    def synchronize(self, devices: Iterable[int] | None = None) -> None:
        # Work left on another stream: the device sync waits for it, after the current
        # stream's end event has passed.
        if self.pending:
            self.wait(self.pending)
            self.pending = 0.0
        self.log.append("sync")

    def side_work(self, seconds: float) -> None:
        self.pending = seconds

    def record_event(self, device: int | None = None) -> FakeEvent:
        if self.fixed_span:  # a steady GPU: every interval is the same
            slow = self.slow_after and self.calls > self.slow_after
            self.ticks += self.fixed_span * (1.2 if slow else 1.0)
            return FakeEvent(self.ticks)
        self.log.append("record")
        return FakeEvent(self.clock())

    def l2_flush_buffer(self, device: int) -> Any:
        return SimpleNamespace(numel=lambda: 32 << 20, element_size=lambda: 4)

    def flush_l2(self, buffer: Any) -> None:
        self.log.append("flush")
        self.flushed = True  # the next call finds its data out of L2 (see counting)

    def capture_graph(self, run: Callable[[int], object], unroll: int, device: int) -> Any:
        if self.capture_error:
            raise cuda.GraphCaptureError(self.capture_error)
        run(unroll)
        self.log.append(f"captured {unroll}")
        return lambda: run(unroll)

    def profile_kernels(
        self, warm: Call, run: Call, devices: Any, flushes: int = 0, steps: int = 1
    ) -> cuda.KernelProfile:
        warm()
        for _ in range(steps):
            run()
        busy = self.busy_us * steps
        runs = (self.busy_us,) * steps if steps > 1 and self.split_runs else ()
        return cuda.KernelProfile(busy, None, (("kernel", steps, busy),), flushes, runs)

    def catch_syncs(self, run: Call, code_files: Iterable[str], *, is_user: Any) -> list[Any]:
        calls_before = self.calls
        run()
        n = (self.calls - calls_before) * self.syncs_per_call
        return [cuda.SyncEvent("Tensor.item", next(iter(code_files), "<f>"), 3)] * n


def counting(seam: FakeSeam, seconds: float, cold: float | None = None) -> Callable[[int], None]:
    """A body of ``seconds`` a call (``cold`` after an L2 flush), counted in ``seam.calls``."""

    def run(n: int) -> None:
        for _ in range(n):
            seam.calls += 1
            seam.spend(cold if seam.flushed and cold is not None else seconds)
            seam.flushed = False

    return run


@dataclass
class FakeDevice(FakeSeam):
    """An asynchronous GPU for ``%lprun``: the work launched is its clock."""

    free_at: float = 0.0
    launched: float = 0.0  # seconds of work launched so far: the pretend GPU's clock
    capturing: bool = False
    debug_mode: int = 0
    gpu: FakeAllocator = field(default_factory=lambda: FakeAllocator(initialized=True))
    syncs: int = 0
    sync_error: Exception | None = None
    debug_modes_set: list[int] = field(default_factory=list)
    recorder: FakeRecorder | None = None  # the pretend torch.profiler, while it runs
    traces: int = 0  # how often it was started
    nodes: list[tuple[int, int, float]] = field(default_factory=list)  # graph nodes built
    seqs: dict[int, int] = field(default_factory=dict)  # each thread's next sequence number
    spins: int = 0  # empty kernels launched by gpumagic (its warm-up)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> Any:
        self.machine = self.gpu.install(monkeypatch).machine  # its memory; our runtime
        return super().install(
            monkeypatch,
            event_completed=lambda event: time.perf_counter() >= event.at,
            elapsed_ms=lambda start, end, wait=True: (end.gpu - start.gpu) * 1e3,
            visible_device_total=lambda: 1,
            stream_is_capturing=lambda: self.capturing,
            get_sync_debug_mode=lambda: self.debug_mode,
            start_kernel_trace=self.start_kernel_trace,
            profiler_running=lambda: self.recorder is not None,
            sequence_counter=lambda: self.sequence_nr,
            spin=self.spin,
        )

    def sequence_nr(self) -> int:
        """The calling thread's next autograd sequence number (thread-local, as torch's)."""
        return self.seqs.get(threading.get_ident(), 0)

    def start_kernel_trace(self, *, cuda: bool = True) -> FakeRecorder:
        assert self.recorder is None, "one profiler at a time"
        self.traces += 1
        self.recorder = FakeRecorder(self)
        return self.recorder

    def spin(self, device: int, microseconds: float) -> None:
        """``torch.cuda._sleep``: a kernel with no torch op around it."""
        assert device == 0
        self.spins += 1
        self.raw_launch(microseconds * 1e-6)

    def launch(self, seconds: float, *, grad: bool = False) -> None:
        """Queue ``seconds`` of GPU work; returns at once. With a profiler running, CUPTI
        records it as one kernel launched by a runtime call, inside a torch op while the
        profiler collects torch ops; ``grad``: the op builds a graph node (taking the
        thread's next sequence number) whose backward (:meth:`backward`) runs a kernel
        as long."""
        self.free_at = max(self.free_at, time.perf_counter()) + seconds
        self.launched += seconds
        thread = threading.get_ident()
        seq = self.sequence_nr()
        if grad:
            self.seqs[thread] = seq + 1
            self.nodes.append((seq, thread, seconds))
        recorder = self.recorder
        if recorder is not None:
            op = recorder.op("aten::fake", seq=seq if grad else -1) if recorder.collecting else None
            recorder.kernel(seconds, op)

    def backward(self) -> None:
        """Run the backward of every graph node built so far, as autograd's engine does:
        entered through the engine object (which ``--gpu`` watches), on a thread of its
        own, one ``evaluate_function`` per node, newest first."""
        nodes, self.nodes = self.nodes[::-1], []

        def engine() -> None:
            recorder = self.recorder
            for seq, thread, seconds in nodes:
                self.free_at = max(self.free_at, time.perf_counter()) + seconds
                self.launched += seconds
                if recorder is None:
                    continue
                if not recorder.collecting:  # no torch op: only the runtime call
                    recorder.kernel(seconds, None)
                    continue
                name = "autograd::engine::evaluate_function: FakeBackward0"
                fwd_thread = recorder.thread_id(thread)
                node = recorder.op(name, seq=seq, fwd_thread=fwd_thread, length=2000)
                recorder.kernel(seconds, recorder.op("aten::mm", within=node))

        def run_backward() -> None:
            worker = threading.Thread(target=engine)
            worker.start()
            worker.join()

        recorder = self.recorder
        if recorder is not None and recorder.watching is not None:
            recorder.run_backward(SimpleNamespace(run_backward=run_backward), (), {})
        else:
            run_backward()

    def graph_replay(self, seconds: float, kernels: int = 3) -> None:
        """Replay a CUDA graph of ``kernels`` kernels: one runtime call, no torch op."""
        self.free_at = max(self.free_at, time.perf_counter()) + seconds
        self.launched += seconds
        if self.recorder is not None:
            correlation = self.recorder.runtime_call("cudaGraphLaunch")
            for _ in range(kernels):
                self.recorder.kernel(seconds / kernels, None, correlation)

    def raw_launch(self, seconds: float) -> None:
        """Launch a kernel with no torch op around it (``torch.cuda._sleep``, a Triton or
        extension kernel): only its runtime call links it to a thread, and Kineto names
        that thread by pthread's id cut to 32 bits, signed (a thread it never mapped)."""
        self.free_at = max(self.free_at, time.perf_counter()) + seconds
        self.launched += seconds
        if self.recorder is not None:
            low = threading.get_ident() & 0xFFFFFFFF
            pthread = low - (low >> 31 << 32)
            correlation = self.recorder.runtime_call("cudaLaunchKernel", thread=pthread)
            self.recorder.kernel(seconds, None, correlation)

    def item(self) -> float:
        """A hidden synchronization, like ``tensor.item()``."""
        if self.debug_mode == 1:
            warnings.warn(cuda.SYNC_WARNING_MESSAGE, UserWarning, stacklevel=2)
        self._wait()
        return 0.0

    def _wait(self) -> None:
        remaining = self.free_at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def synchronize(self, devices: Iterable[int] | None = None) -> None:
        if self.sync_error is not None:
            raise self.sync_error
        assert devices == (0,)
        self.syncs += 1
        self._wait()

    def record_event(self, device: int | None = None) -> FakeEvent:
        return FakeEvent(max(self.free_at, time.perf_counter()), self.launched)

    def set_sync_debug_mode(self, mode: int) -> None:
        self.debug_modes_set.append(mode)
        self.debug_mode = mode


#: The pretend profiler's clock: perf_counter_ns plus this (any offset must be fitted).
PROFILER_CLOCK_OFFSET = 1_700_000_000_000_000_000


@dataclass
class FakeRecorder:
    """``cuda.start_kernel_trace()`` for :class:`FakeDevice`: a record of the kernels and
    the runtime calls that launched them, and of torch ops while they are collected (from
    the start until ``collect_ops(False)``, and while a watched backward runs), on a
    clock of its own, with torch's own thread ids. Entering the backward is the real
    recorder's code (:meth:`cuda.KernelRecorder.run_backward`)."""

    device: FakeDevice
    ops: list[cuda.HostOp] = field(default_factory=list)
    work: list[cuda.DeviceWork] = field(default_factory=list)
    calls: list[cuda.RuntimeCall] = field(default_factory=list)
    thread_ids: dict[int, int] = field(default_factory=dict)
    next_id: int = 1
    collecting: bool = True
    switches: list[bool] = field(default_factory=list)  # collect_ops' calls, in order
    watching: Callable[[], object] | None = None
    thread: int = field(default_factory=threading.get_ident)
    backward_calls: int = 0
    _depth: int = 0

    run_backward = cuda.KernelRecorder.run_backward

    @property
    def _on_backward(self) -> Callable[[], object] | None:
        return self.watching

    def thread_id(self, thread: int) -> int:
        """torch's id of the thread ``thread`` (``threading.get_ident()``)."""
        return self.thread_ids.setdefault(thread, len(self.thread_ids) + 1)

    def _thread(self) -> int:
        return self.thread_id(threading.get_ident())

    def collect_ops(self, on: bool) -> None:
        self.switches.append(on)
        self.collecting = on

    def watch_backward(self, on_backward: Callable[[], object]) -> None:
        self.watching = on_backward

    def unwatch_backward(self) -> None:
        self.watching = None

    def _now(self) -> int:
        return time.perf_counter_ns() + PROFILER_CLOCK_OFFSET

    def op(
        self,
        name: str,
        *,
        seq: int = -1,
        fwd_thread: int = 0,
        length: int = 1000,
        within: cuda.HostOp | None = None,
    ) -> cuda.HostOp:
        start = within.start_ns + 1 if within is not None else self._now()
        found = cuda.HostOp(
            id=self.next_id,
            name=name,
            thread=self._thread(),
            start_ns=start,
            end_ns=start + (length if within is None else 500),
            seq=seq,
            fwd_thread=fwd_thread,
        )
        self.next_id += 1
        self.ops.append(found)
        return found

    def kernel(self, seconds: float, op: cuda.HostOp | None, correlation: int = 0) -> None:
        self.work.append(
            cuda.DeviceWork(
                kind="kernel",
                name="fake_kernel",
                duration_ns=round(seconds * 1e9),
                op=op.id if op is not None else 0,
                correlation=correlation or self.runtime_call("cudaLaunchKernel"),
            )
        )

    def runtime_call(self, name: str, thread: int | None = None) -> int:
        correlation = 10_000 + len(self.calls)
        caller = threading.get_native_id() if thread is None else thread
        self.calls.append(cuda.RuntimeCall(correlation, name, caller, self._now()))
        return correlation

    def mark(self, label: str) -> tuple[int, int]:
        before = time.perf_counter_ns()
        if self.collecting:  # a record_function range: a torch op like any other
            self.op(label, length=100)
        return before, time.perf_counter_ns()

    def stop(self) -> cuda.KernelTrace:
        self.unwatch_backward()
        self.device.recorder = None
        return cuda.KernelTrace(tuple(self.ops), tuple(self.work), tuple(self.calls))
