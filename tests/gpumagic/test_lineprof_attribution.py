"""``%lprun --gpu``'s core on synthetic traces, and on a real CPU profile of a training
step (torch ops recorded only inside backward, as on a GPU) where each leaf op stands in
for a kernel (the GPU path swaps in CUPTI's kernels and launches through the same links:
``test_lprun_kernels_gpu.py``)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest
from fake_runtime import FakeDevice

from fake_cuda import install
from gpumagic import cuda
from gpumagic.cuda.kernel_trace import DeviceWork, HostOp, KernelTrace, RuntimeCall
from gpumagic.lineprof import GpuLineProfiler
from gpumagic.lineprof_attribution import LineGpu, attribute
from gpumagic.lineprof_kernels import MARK_PREFIX
from gpumagic.lineprof_timeline import ClockFit, LineStacks

if TYPE_CHECKING:
    from gpumagic.lineprof_timeline import Where

F: Any = ("f.py", 1, "f")  # a profiled function's label
G: Any = ("f.py", 10, "g")


def at(label: Any, line: int) -> Where:
    return (label, line)


def stacks(*events: Any, thread: int = 7) -> LineStacks:
    """A timeline of one thread; an event without a sequence number gets 0."""
    return LineStacks({thread: [(*e, 0) if len(e) == 3 else e for e in events]})


def charge(trace: KernelTrace, timeline: LineStacks, **more: Any) -> Any:
    options: dict[str, Any] = {"threads": {1: 7}, "os_threads": {}, "session_thread": 7}
    return attribute(trace, timeline, ClockFit(offset=0.0), **options | more)


def op(ident: int, start: int, end: int, **more: Any) -> HostOp:
    return HostOp(
        id=ident,
        name=more.pop("name", "aten::mm"),
        thread=more.pop("thread", 1),
        start_ns=start,
        end_ns=end,
        **more,
    )


def kernel(ns: int, op_id: int, correlation: int = 0) -> DeviceWork:
    return DeviceWork("kernel", "k", ns, op_id, correlation or 1000 + op_id)


# -- the line timeline -------------------------------------------------------------------


def test_stacks_follow_calls_returns_and_lines() -> None:
    timeline = stacks(
        (100, 1, at(F, 2)),  # f starts line 2
        (200, 2, at(G, 11)),  # f calls g
        (300, 2, at(G, 12)),
        (400, 2, None),  # g returns
        (500, 1, at(F, 3)),
        (600, 1, None),
    )
    assert timeline.at(7, 50) == ()
    assert timeline.at(7, 150) == (at(F, 2),)
    assert timeline.at(7, 250) == (at(F, 2), at(G, 11))
    assert timeline.at(7, 399) == (at(F, 2), at(G, 12))
    assert timeline.at(7, 450) == (at(F, 2),)
    assert timeline.at(7, 550) == (at(F, 3),)
    assert timeline.at(7, 700) == ()
    assert timeline.at(8, 250) == ()  # another thread ran nothing


def test_stacks_survive_generators_and_missed_exits() -> None:
    timeline = stacks(
        (100, 1, at(F, 2)),
        (200, 2, at(G, 11)),  # a generator runs...
        (300, 2, None),  # ...and yields
        (400, 3, at(G, 11)),  # another frame (or the generator, resumed elsewhere)
        (500, 1, at(F, 3)),  # f's next line: the frame above left without an event
        (600, 9, None),  # the exit of a frame never seen open
    )
    assert timeline.at(7, 350) == (at(F, 2),)
    assert timeline.at(7, 450) == (at(F, 2), at(G, 11))
    assert timeline.at(7, 550) == (at(F, 3),)
    assert timeline.at(7, 650) == (at(F, 3),)


def test_clock_fit_narrows_to_what_the_marks_agree_on() -> None:
    # The profiler's clock is the host's + 1000; each mark was taken inside its bracket.
    marks = [(0, 10, 1003), (20, 26, 1025), (40, 60, 1041)]
    fit = ClockFit.from_marks(marks)
    assert fit.offset == pytest.approx(1000, abs=1)
    assert fit.error_ns <= 1
    assert fit.to_host(5000) == pytest.approx(4000, abs=1)


def test_clock_fit_follows_drift_between_the_start_and_the_end() -> None:
    start = [(0, 4, 1002), (10, 12, 1011)]
    end = [(10_000_000, 10_000_004, 10_001_052), (10_000_010, 10_000_012, 10_001_061)]
    fit = ClockFit.from_marks(start + end)
    assert fit.to_host(1011) == pytest.approx(11, abs=2)
    assert fit.to_host(10_001_061) == pytest.approx(10_000_011, abs=2)
    assert fit.slope == pytest.approx(5e-6, rel=0.2)


def test_clock_fit_leaves_out_a_mark_that_took_long() -> None:
    # The first mark paid a lazy start-up (1 ms between its host readings): with it the
    # start's offset would be known to a millisecond and the drift would be nonsense.
    start = [
        (0, 1_000_000, 1_000_700),
        *((x, x + 4, x + 1002) for x in range(1_000_010, 1_000_100, 10)),
    ]
    end = [(x, x + 4, x + 1002) for x in range(9_000_000, 9_000_100, 10)]
    fit = ClockFit.from_marks(start + end)
    assert fit.error_ns <= 4
    assert fit.slope == pytest.approx(0, abs=1e-6)
    assert fit.to_host(5_001_000) == pytest.approx(4_999_998, abs=4)


def test_clock_fit_takes_the_tightest_mark_when_brackets_disagree() -> None:
    fit = ClockFit.from_marks([(0, 2, 1001), (100, 400, 1390)])  # the second was descheduled
    assert fit.offset == pytest.approx(1000, abs=1)
    with pytest.raises(ValueError, match="no marks"):
        ClockFit.from_marks([])


# -- charging ---------------------------------------------------------------------------


def test_self_goes_to_the_innermost_line_inclusive_to_each_line_once() -> None:
    timeline = stacks(
        (100, 1, at(F, 2)),
        (200, 2, at(F, 2)),  # recursion: the same line twice on the stack
        (300, 2, None),
        (400, 1, None),
    )
    trace = KernelTrace(ops=(op(1, 250, 260), op(2, 350, 360)), work=(kernel(5, 1), kernel(7, 2)))
    found = charge(trace, timeline)
    line = found.lines[F][2]
    assert (line.self_ns, line.total_ns, line.launches) == (12, 12, 2)
    assert found.charged_ns == found.total_ns == 12


def test_stacks_by_sequence_number_are_those_of_the_line_that_built_the_node() -> None:
    # Each boundary records the thread's next sequence number: f's line 2 built nodes
    # 5 and 6, its call of g built 7 (in g's line 11), line 3 built none, line 4 node 8.
    timeline = stacks(
        (100, 1, at(F, 2), 5),
        (200, 2, at(G, 11), 7),
        (300, 2, None, 8),
        (400, 1, at(F, 3), 8),
        (500, 1, at(F, 4), 8),
        (600, 1, None, 9),
    )
    assert timeline.built(7, 4) == ()  # built before the first line
    assert timeline.built(7, 5) == timeline.built(7, 6) == (at(F, 2),)
    assert timeline.built(7, 7) == (at(F, 2), at(G, 11))
    assert timeline.built(7, 8) == (at(F, 4),)  # line 3 built nothing: the last one did
    assert timeline.built(8, 5) == ()  # another thread


def backward_trace(*nodes: tuple[int, int, int], fwd_thread: int = 1) -> KernelTrace:
    """Backward nodes ``(seq, kernel ns, start)`` run on the engine's thread (torch
    thread 2), each launching one kernel from an op inside it; then the gradient of a
    leaf accumulated (no forward node)."""
    ops: list[HostOp] = []
    work: list[DeviceWork] = []
    for index, (seq, ns, start) in enumerate(nodes):
        node, inner = 10 * index + 1, 10 * index + 2
        name = "autograd::engine::evaluate_function: MmBackward0"
        ops.append(op(node, start, start + 9, seq=seq, fwd_thread=fwd_thread, thread=2, name=name))
        ops.append(op(inner, start + 1, start + 8, thread=2))
        work.append(kernel(ns, inner))
    name = "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"
    ops.append(op(900, 390, 399, thread=2, name=name))
    ops.append(op(901, 391, 398, thread=2, name="aten::add_"))
    work.append(kernel(4, 901))
    return KernelTrace(ops=tuple(ops), work=tuple(work))


def test_backward_goes_to_the_forward_line_whose_sequence_range_holds_the_node() -> None:
    timeline = stacks(
        (100, 1, at(F, 2), 5),  # line 2 built node 5
        (200, 1, at(F, 3), 6),  # line 3 built nodes 6 and 7
        (300, 1, at(F, 4), 8),  # line 4: backward(), on the engine's thread
        (400, 1, None, 8),
    )
    trace = backward_trace((7, 9, 310), (6, 3, 330), (5, 2, 350))
    found = charge(trace, timeline)
    assert (found.lines[F][3].backward_self_ns, found.lines[F][3].total_ns) == (12, 12)
    assert found.lines[F][2].backward_total_ns == 2
    # Accumulating a gradient built no forward node: it stays on the backward() line.
    assert (found.lines[F][4].total_ns, found.lines[F][4].backward_total_ns) == (4, 0)
    assert (found.backward_ns, found.backward_to_forward_ns) == (18, 14)


def test_a_backward_node_of_an_unknown_forward_thread() -> None:
    timeline = stacks((100, 1, at(F, 2), 5), (300, 1, at(F, 4), 6), (400, 1, None, 6))
    trace = backward_trace((5, 9, 310), fwd_thread=3)  # forward on a thread never marked
    found = charge(trace, timeline)
    assert found.lines[F][4].total_ns == 13  # not guessed: where backward() was called
    assert found.backward_to_forward_ns == 0
    # No mark made it into the record at all: the node was built on the session thread.
    found = charge(trace, timeline, threads={})
    assert found.lines[F][2].backward_self_ns == 9


def test_forward_kernels_go_by_their_launch_self_and_inclusive() -> None:
    # No torch op is recorded in the forward: each kernel's cudaLaunchKernel names the
    # OS thread (4242) and its host time. f's line 2 calls g (lines 11, 12).
    timeline = stacks(
        (100, 1, at(F, 2)),
        (200, 2, at(G, 11)),
        (300, 2, at(G, 12)),
        (400, 2, None),
        (500, 1, at(F, 3)),
        (600, 1, None),
    )
    launches = {61: 150, 62: 250, 63: 350, 64: 450, 65: 550, 66: 650}
    trace = KernelTrace(
        work=tuple(DeviceWork("kernel", "k", c - 60, 0, c) for c in launches),
        calls=tuple(RuntimeCall(c, "cudaLaunchKernel", 4242, t) for c, t in launches.items()),
    )
    found = charge(trace, timeline, os_threads={4242: 7})
    f2, g11, g12, f3 = found.lines[F][2], found.lines[G][11], found.lines[G][12], found.lines[F][3]
    assert (f2.self_ns, f2.total_ns, f2.launches) == (1 + 4, 1 + 2 + 3 + 4, 2)
    assert (g11.self_ns, g12.self_ns, f3.self_ns) == (2, 3, 5)
    assert f2.total_ns == f2.self_ns + g11.total_ns + g12.total_ns  # inclusive adds up
    assert (found.outside_ns, found.charged_ns, found.total_ns) == (6, 15, 21)


def test_launches_without_an_op_go_by_their_runtime_call() -> None:
    timeline = stacks((100, 1, at(F, 2)), (200, 1, None))
    trace = KernelTrace(
        work=(
            DeviceWork("kernel", "a", 3, 0, 50),
            DeviceWork("kernel", "b", 4, 0, 50),  # one graph replay, two kernels
            DeviceWork("memcpy", "c", 5, 0, 51),  # launched on a thread we never saw
            DeviceWork("kernel", "d", 6, 0, 52),  # no runtime call in the record
        ),
        calls=(
            RuntimeCall(50, "cudaGraphLaunch", 4242, 150),
            RuntimeCall(51, "cudaMemcpy", 99, 150),
        ),
    )
    found = charge(trace, timeline, os_threads={4242: 7})
    line = found.lines[F][2]
    assert (line.total_ns, line.launches) == (7, 1)
    assert (found.graph_replays, found.graph_ns) == (1, 7)
    assert (found.other_threads_ns, found.unlinked_ns) == (5, 6)


def test_a_kernel_with_only_its_runtime_call_goes_to_the_launching_line() -> None:
    # The spin line: torch.cuda._sleep launches with no aten op around it, so its kernel
    # links to no op; its cudaLaunchKernel names the OS thread, not torch's id (1).
    timeline = stacks((100, 1, at(F, 2)), (200, 1, at(F, 3)), (300, 1, None))
    trace = KernelTrace(
        ops=(op(1, 120, 130),),
        work=(kernel(5, 1, correlation=60), DeviceWork("kernel", "spin", 9, 0, 61)),
        calls=(
            RuntimeCall(60, "cudaLaunchKernel", 4242, 121),
            RuntimeCall(61, "cudaLaunchKernel", 4242, 250),
        ),
    )
    found = charge(trace, timeline, os_threads={4242: 7})
    assert (found.lines[F][2].self_ns, found.lines[F][3].self_ns) == (5, 9)
    assert found.lines[F][3].launches == 1
    assert found.charged_ns == found.total_ns == 14
    # Without the OS thread's alias the kernel is counted apart, not lost nor misplaced.
    found = charge(trace, timeline)
    assert (found.lines[F][2].self_ns, 3 in found.lines[F]) == (5, False)
    assert found.other_threads_ns == 9


def test_work_outside_the_lines_and_on_other_threads_is_counted_apart() -> None:
    timeline = stacks((100, 1, at(F, 2)), (200, 1, None))
    trace = KernelTrace(
        ops=(op(1, 50, 60), op(2, 250, 260), op(3, 150, 160, thread=3)),
        work=(kernel(1, 1), kernel(2, 2), kernel(4, 3), kernel(8, 99)),
    )
    found = charge(trace, timeline)
    assert (found.outside_ns, found.other_threads_ns, found.unlinked_ns) == (3, 4, 8)
    assert found.charged_ns == 0


def test_sessions_add_up() -> None:
    timeline = stacks((100, 1, at(F, 2)), (200, 1, None))
    trace = KernelTrace(ops=(op(1, 150, 160),), work=(kernel(5, 1),))
    total = charge(trace, timeline)
    total.add(charge(trace, timeline))
    assert (total.lines[F][2].total_ns, total.total_ns, total.work) == (10, 10, 2)


def test_kineto_events_become_plain_records() -> None:
    device_type = SimpleNamespace(CPU="cpu", CUDA="cuda")

    def event(name: str, kind: str | int | None, device: str = "cpu", **more: Any) -> Any:
        fields = {
            "name": name,
            "device_type": device,
            "duration_ns": 5,
            "linked_correlation_id": 1,
            "correlation_id": 2,
            "device_index": 0,
            "device_resource_id": 7,
            "start_thread_id": 3,
            "start_ns": 100,
            "end_ns": 105,
            "sequence_nr": 4,
            "fwd_thread_id": 0,
        } | more
        methods = {key: (lambda value=value: value) for key, value in fields.items()}
        if kind is not None:
            methods["activity_type"] = lambda kind=kind: kind
        return SimpleNamespace(**methods)

    trace = cuda.kernel_trace.trace_from_events(
        [
            event("aten::mm", "cpu_op"),
            event("ampere_sgemm", "kernel", "cuda"),
            event("Memcpy HtoD", "gpu_memcpy", "cuda"),
            event("cudaLaunchKernel", "cuda_runtime"),
            event("[memory]", "cpu_instant_event"),
            event("Memset (Device)", None, "cuda"),  # an older torch: no activity type
            event("cudaMemsetAsync", None),
            event("aten::add", None),
            # torch 2.11: a record_function range, and its span on the device over the
            # kernels launched in it: neither is device work of its own.
            event("Optimizer.step#SGD.step", None, "cuda", is_user_annotation=True),
            event("Optimizer.step#SGD.step", None, is_user_annotation=True),
            event("sm90_gemm", None, "cuda", is_user_annotation=False),
            event("elementwise_kernel", 5, "cuda"),  # a build that gives Kineto's number
        ],
        device_type,
    )
    assert [o.name for o in trace.ops] == [
        "aten::mm",
        "aten::add",
        "Optimizer.step#SGD.step",
    ]
    assert [(w.kind, w.op, w.stream) for w in trace.work] == [
        ("kernel", 1, 7),
        ("memcpy", 1, 7),
        ("memset", 1, 7),
        ("kernel", 1, 7),
        ("kernel", 1, 7),
    ]
    assert [c.name for c in trace.calls] == ["cudaLaunchKernel", "cudaMemsetAsync"]
    # A runtime call's thread is Kineto's resource id (the caller's), not the op's one.
    assert [c.thread for c in trace.calls] == [7, 7]


# -- a real training step on the CPU, its ops' time standing in for kernels ---------------


def train_step(net: Any, x: Any, y: Any) -> Any:
    torch = net.torch
    h = net.fc1(x)
    h = torch.relu(h)
    out = net.fc2(h)
    loss = (out - y).pow(2).mean()
    loss.backward()
    net.step()  # SGD, then the gradients set to None
    return loss


#: Ops that only make a new view or an empty tensor: they launch no kernel on a GPU.
NO_KERNEL = {
    "aten::detach",
    "detach",
    "aten::t",
    "aten::transpose",
    "aten::as_strided",
    "aten::view",
    "aten::expand",
    "aten::resolve_conj",
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::result_type",
    "aten::to",
    "aten::alias",
}


KERNEL_NS = 1000  # each stand-in kernel's time: the figures count kernels
#: torch functions the stand-in's mode sees that launch no kernel of their own
NO_LAUNCH = {"__get__", "__set__", "backward", "_set_grad_enabled"}


class StandInRecorder:
    """The real recorder (CPU activity only: torch ops collected at the start, at the end
    and while backward runs); its stop turns every leaf torch op into the "kernel" it
    would have launched, of 1 µs each: linked to the op where the profiler recorded
    one, else (the forward, with torch ops not collected) to a runtime call on the
    launching thread at the call's start, as CUPTI records one (a torch function mode
    stands in for CUPTI there: one launch per torch call)."""

    def __init__(self) -> None:
        from torch.overrides import TorchFunctionMode  # a dispatch mode imports dynamo

        self.real = cuda.kernel_trace.KernelRecorder(cuda=False)
        self.launches: list[tuple[str, int, int]] = []  # name, OS thread, start
        self.marks: list[tuple[str, int, int]] = []
        recorder = self

        class Launches(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                start = time.perf_counter_ns()
                out = func(*args, **(kwargs or {}))
                name = getattr(func, "__name__", "")
                if not recorder.real.collecting and out is not None and name not in NO_LAUNCH:
                    recorder.launches.append((name, threading.get_native_id(), start))
                return out

        self.mode = Launches()
        self.mode.__enter__()

    @property
    def collecting(self) -> bool:
        return self.real.collecting

    def collect_ops(self, on: bool) -> None:
        self.real.collect_ops(on)

    def watch_backward(self, on_backward: Any) -> None:
        self.real.watch_backward(on_backward)

    def unwatch_backward(self) -> None:
        self.real.unwatch_backward()

    def mark(self, label: str) -> tuple[int, int]:
        before, after = self.real.mark(label)
        self.marks.append((label, before, after))
        return before, after

    def stop(self) -> KernelTrace:
        self.mode.__exit__(None, None, None)
        trace = self.real.stop()
        ops = [o for o in trace.ops if not o.name.startswith(MARK_PREFIX)]
        parents = {
            outer.id
            for outer in ops
            for inner in ops
            if inner is not outer
            and inner.thread == outer.thread
            and outer.start_ns <= inner.start_ns
            and inner.end_ns <= outer.end_ns
        }
        work = [
            DeviceWork("kernel", o.name, KERNEL_NS, o.id, 0)
            for o in ops
            if o.id not in parents and o.name not in NO_KERNEL | {"PythonDispatchMode"}
        ]
        # The profiler's clock against perf_counter_ns, from the marks it recorded.
        at = {o.name: o.start_ns for o in trace.ops}
        clock = ClockFit.from_marks([(b, a, at[label]) for label, b, a in self.marks])
        calls = []
        for index, (name, thread, start) in enumerate(self.launches):
            correlation = 100_000 + index
            profiler_ns = round(start + clock.offset + clock.slope * (start - clock.host_ns))
            calls.append(RuntimeCall(correlation, "cudaLaunchKernel", thread, profiler_ns))
            work.append(DeviceWork("kernel", name, KERNEL_NS, 0, correlation))
        return KernelTrace(trace.ops, tuple(work), tuple(calls))


def test_backward_time_of_a_real_training_step_goes_to_its_forward_lines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    counter = cuda.sequence_counter
    FakeDevice().install(monkeypatch)  # a CUDA context as far as %lprun can tell
    install(
        monkeypatch,
        start_kernel_trace=lambda cuda=True: StandInRecorder(),
        profiler_running=lambda: False,
        sequence_counter=counter,  # torch's own: the graph nodes are real
    )
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(64, 256), torch.nn.Linear(256, 8)
    params = [*fc1.parameters(), *fc2.parameters()]

    def step() -> None:  # torch.optim would import torch._dynamo: seconds, on this CPU
        with torch.no_grad():
            torch._foreach_add_(params, [p.grad for p in params], alpha=-0.01)
        for p in params:
            p.grad = None

    net = SimpleNamespace(torch=torch, fc1=fc1, fc2=fc2, step=step)
    x, y = torch.randn(128, 64), torch.randn(128, 8)
    train_step(net, x, y)  # warm
    prof = GpuLineProfiler(sync=False, gpu=True)
    prof.add_target(train_step)
    with prof.session():
        train_step(net, x, y)
    result = prof.result()
    found = result.kernels
    assert found is not None, result.kernels_failure
    first = train_step.__code__.co_firstlineno
    lines = {
        line - first: figures for line, figures in found.lines[next(iter(found.lines))].items()
    }
    for forward in (2, 3, 4, 5):  # fc1, relu, fc2, the loss: each built nodes
        assert lines[forward].backward_total_ns > 0, forward
        # ...and launched its own forward work, found by its launch (no torch op).
        assert lines[forward].total_ns > lines[forward].backward_total_ns, forward
    assert found.backward_to_forward_ns >= 0.9 * found.backward_ns > 0
    # backward() keeps what built no forward node (the seed gradient).
    kept = lines.get(6, LineGpu())
    assert kept.total_ns - kept.backward_total_ns < 0.1 * found.backward_ns
    assert lines[7].total_ns > 0  # the optimizer's step: its own work
    assert lines[7].backward_total_ns == 0
    assert found.charged_ns + found.outside_ns + found.other_threads_ns == found.total_ns
    assert found.other_threads_ns == 0
    assert threading.active_count() >= 1
