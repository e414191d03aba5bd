"""The seam's recorder for ``%lprun --gpu`` on the real (CPU) torch.profiler: torch ops
switched off and on, autograd's engine watched and put back, sequence numbers read.
The CUDA side is checked on a GPU (``test_lprun_kernels_gpu.py``)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from gpumagic import cuda

torch = pytest.importorskip("torch")


def engine() -> Any:
    return torch.autograd.variable.Variable._execution_engine


@pytest.fixture
def recorder() -> Any:
    """A running recorder (CPU activity only), stopped after the test if it is not."""
    found = cuda.kernel_trace.KernelRecorder(cuda=False)
    yield found
    if torch._C._autograd._profiler_enabled():
        found.stop()


class Fails(torch.autograd.Function):
    """An op whose backward raises."""

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        raise RuntimeError("backward failed on purpose")


def test_torch_ops_are_recorded_only_while_switched_on_and_in_backward(
    recorder: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    original = engine()
    seq = cuda.sequence_counter()
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    recorder.mark("start")
    recorder.collect_ops(False)
    entered: list[bool] = []
    recorder.watch_backward(lambda: entered.append(recorder.collecting))
    assert engine() is not original
    assert engine().is_checkpoint_valid() == original.is_checkpoint_valid()  # passed on
    recorder.mark("hidden")  # not collected: not in the record
    built = {}
    built["mm"] = seq()
    y = x @ w
    built["relu"] = seq()
    z = y.relu().sum()
    z.backward()
    assert not recorder.collecting
    (x @ w).sum().backward()
    torch.autograd.grad((x * w[:4]).sum(), w)
    recorder.unwatch_backward()
    assert engine() is original
    recorder.collect_ops(True)
    recorder.mark("end")
    trace = recorder.stop()
    assert entered == [True, True, True]
    assert recorder.backward_calls == 3
    names = [op.name for op in trace.ops]
    assert "start" in names
    assert "end" in names
    assert "hidden" not in names
    nodes = [op for op in trace.ops if op.backward_node and not op.name.startswith("autograd::")]
    # Every op recorded between the start and the end ran inside a backward.
    assert [n.name for n in nodes] == [
        "SumBackward0",
        "ReluBackward0",
        "MmBackward0",
        "SumBackward0",
        "MmBackward0",
        "SumBackward0",
        "MulBackward0",
        "SliceBackward0",
    ]
    # A node carries the sequence number the thread had when the line built it, and the
    # forward's thread: torch's id of this thread (the marks').
    assert nodes[1].seq == built["relu"]
    assert nodes[2].seq == built["mm"]
    marks = {op.thread for op in trace.ops if op.name in ("start", "end")}
    assert {n.fwd_thread for n in nodes} == marks
    forward = {"aten::mul", "aten::slice", "aten::relu"}
    assert not forward & {op.name for op in trace.ops if op.seq >= 0 and not op.backward_node}
    # torch warns on stderr at every switch; the recorder quiets it.
    assert "Toggling" not in capfd.readouterr().err


def test_the_engine_is_put_back_and_ops_switched_off_when_backward_raises(
    recorder: Any,
) -> None:
    original = engine()
    recorder.collect_ops(False)
    recorder.watch_backward(lambda: None)
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="on purpose"):
        Fails.apply(x).sum().backward()
    assert not recorder.collecting
    assert engine() is not original
    recorder.stop()  # without unwatch_backward: stop puts it back
    assert engine() is original


def test_a_backward_on_another_thread_or_nested_runs_as_it_is(recorder: Any) -> None:
    recorder.collect_ops(False)
    states: list[bool] = []
    recorder.watch_backward(lambda: states.append(recorder.collecting))
    x = torch.ones(3, requires_grad=True)

    def elsewhere() -> None:
        (x * 2).sum().backward()

    worker = threading.Thread(target=elsewhere)
    worker.start()
    worker.join()
    assert (states, recorder.collecting, recorder.backward_calls) == ([], False, 0)
    assert x.grad is not None

    def nested(grad: Any) -> Any:
        # A backward inside a backward (a hook, checkpointing): one switch, outermost.
        inner = torch.ones(2, requires_grad=True)
        with torch.enable_grad():
            (inner * 3).sum().backward()
        states.append(recorder.collecting)
        return grad

    y = x * 5
    y.register_hook(nested)
    y.sum().backward()
    assert states == [True, True]
    assert (recorder.collecting, recorder.backward_calls) == (False, 1)
    recorder.stop()


def test_switching_twice_the_same_way_changes_nothing(recorder: Any) -> None:
    recorder.collect_ops(True)  # already on: torch is not asked again
    recorder.collect_ops(False)
    recorder.collect_ops(False)
    recorder.mark("off")
    recorder.collect_ops(True)
    recorder.mark("on")
    names = [op.name for op in recorder.stop().ops]
    assert (names.count("off"), names.count("on")) == (0, 1)
