"""The %lprun core through plain calls, with a pretend asynchronous GPU.

The fake device (``fake_runtime.py``) is swapped in through the GPU seam, so these
tests check the attribution logic on any Python: 3.11 here (the trace-function hook),
3.12 on the GPU machine (the sys.monitoring hook).
"""

from __future__ import annotations

import linecache
import sys
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any

import pytest
from fake_runtime import FakeDevice
from line_profiler import LineProfiler

from fake_cuda import install
from gpumagic.lineprof import GpuLineProfiler
from gpumagic.lineprof_hook import peak_above, statement_lines
from gpumagic.lineprof_install import ProfilerBusy
from gpumagic.lineprof_result import render_text

if TYPE_CHECKING:
    from collections.abc import Callable

WORK = 0.05  # seconds of pretend GPU work launched by line A


@pytest.fixture
def dev(monkeypatch: pytest.MonkeyPatch) -> FakeDevice:
    return FakeDevice().install(monkeypatch)


def rows(prof: GpuLineProfiler, func: Callable[..., Any]) -> dict[int, tuple[int, float]]:
    """``{offset from def: (hits, seconds)}`` for ``func``."""
    stats = prof.get_stats()
    first = func.__code__.co_firstlineno
    for (_, start, _), timings in stats.timings.items():
        if start == first:
            return {line - first: (hits, t * stats.unit) for line, hits, t in timings}
    raise AssertionError(f"{func.__name__} not in the stats")


def step(dev: FakeDevice, work: float = WORK) -> float:
    dev.launch(work)  # line A: returns at once
    return dev.item()  # line B: waits for A's work


def profile(func: Callable[..., Any], *args: Any, **options: bool) -> GpuLineProfiler:
    prof = GpuLineProfiler(**options)
    prof.add_target(func)
    with prof.session():
        func(*args)
    return prof


# -- attribution ----------------------------------------------------------------------


def test_synchronized_profile_charges_the_launching_line(dev: FakeDevice) -> None:
    # Five times the usual work: line B's own time is a preemption away from a few ms on
    # a loaded machine, and the share below is of the work, not of the scheduler.
    work = WORK * 5
    prof = profile(step, dev, work)
    lines = rows(prof, step)
    a, b = lines[1][1], lines[2][1]
    assert a >= work * 0.98
    assert a / (a + b) >= 0.9
    result = prof.result()
    assert result.cuda_used
    assert result.syncs >= 3
    assert result.devices == (0,)


def test_without_sync_the_waiting_line_gets_the_work(dev: FakeDevice) -> None:
    prof = profile(step, dev, sync=False)
    lines = rows(prof, step)
    assert lines[2][1] >= WORK * 0.98
    assert lines[1][1] < WORK * 0.1
    assert dev.syncs == 0


def test_plain_line_profiler_bills_the_waiting_line(dev: FakeDevice) -> None:
    """The problem being solved, shown with the same fake device."""
    prof = LineProfiler(step)
    with prof:
        step(dev)
    stats = prof.get_stats()
    ((_, timings),) = stats.timings.items()
    times = {line - step.__code__.co_firstlineno: t * stats.unit for line, _, t in timings}
    assert times[2] >= WORK * 0.98 > times[1] * 10


def test_nested_calls_charge_the_callers_line_inclusively(dev: FakeDevice) -> None:
    def outer(dev: FakeDevice) -> float:
        step(dev)
        return dev.item()

    prof = GpuLineProfiler()
    prof.add_target(outer)
    prof.add_target(step)
    with prof.session():
        outer(dev)
    assert rows(prof, outer)[1][1] >= WORK * 0.98
    assert rows(prof, step)[1][1] >= WORK * 0.98
    assert rows(prof, outer)[2][1] < WORK * 0.2


def gpu_lines(result: Any, func: Callable[..., Any]) -> dict[int, Any]:
    """``{offset from def: LineGpu}`` of ``func`` in a --gpu result."""
    first = func.__code__.co_firstlineno
    assert result.kernels is not None, result.kernels_failure
    for (_, start, _), per_line in result.kernels.lines.items():
        if start == first:
            return {line - first: figures for line, figures in per_line.items()}
    return {}


def test_gpu_column_and_hidden_syncs(dev: FakeDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    # No CUDA event anywhere: CUPTI's record is the GPU time (issue 41).
    install(monkeypatch, record_event=lambda *args, **kwargs: pytest.fail("a CUDA event"))
    for sync in (True, False):
        syncs_before = dev.syncs
        prof = profile(step, dev, sync=sync, gpu=True)
        result = prof.result()
        ((_, extras),) = result.extras.items()
        first = step.__code__.co_firstlineno
        syncs = {line - first: extra.syncs for line, extra in extras.items()}
        on_gpu = gpu_lines(result, step)
        assert on_gpu[1].total_ns == on_gpu[1].self_ns == round(WORK * 1e9)  # CUPTI's time
        assert 2 not in on_gpu  # the waiting line launched nothing
        assert (syncs.get(1, 0), syncs[2]) == (0, 1)  # a line without syncs has no entry
        assert result.gpu_columns
        assert result.kernels.work == 1
        assert result.kernels.charged_ns == result.kernels.total_ns
        assert result.end_syncs == 1
        if not sync:  # none inserted at a line boundary: only the one after the run
            assert (result.syncs, dev.syncs - syncs_before) == (0, 1)
    assert dev.debug_modes_set == [1, 0, 1, 0]  # switched on, then put back, per session
    assert dev.traces == 2
    assert dev.recorder is None  # the profiler was stopped


def test_gpu_time_self_and_inclusive(dev: FakeDevice) -> None:
    def inner(dev: FakeDevice) -> None:
        dev.launch(0.002)
        dev.launch(0.003)

    def outer(dev: FakeDevice) -> None:
        dev.launch(0.001)
        inner(dev)
        inner(dev)
        dev.item()

    prof = GpuLineProfiler(sync=False, gpu=True)
    prof.add_target(outer)
    prof.add_target(inner)
    with prof.session():
        outer(dev)
    result = prof.result()
    mine, theirs = gpu_lines(result, outer), gpu_lines(result, inner)
    assert (mine[1].self_ns, mine[1].total_ns) == (1_000_000, 1_000_000)
    assert (mine[2].self_ns, mine[2].total_ns) == (0, 5_000_000)
    assert (theirs[1].total_ns, theirs[2].total_ns) == (4_000_000, 6_000_000)
    assert theirs[1].launches == 2
    # The caller's inclusive time is its own plus its callees' inclusive time.
    callees = theirs[1].total_ns + theirs[2].total_ns
    assert mine[2].total_ns + mine[3].total_ns == mine[2].self_ns + mine[3].self_ns + callees
    assert result.kernels.total_ns == 11_000_000 == result.kernels.charged_ns
    text = render_text(result, output_unit=1e-3)
    assert "Self" in text
    assert "Bwd" not in text


def test_backward_work_is_charged_to_the_forward_lines(dev: FakeDevice) -> None:
    def train(dev: FakeDevice) -> None:
        dev.launch(0.004, grad=True)
        dev.launch(0.001, grad=True)
        dev.launch(0.002)
        dev.backward()

    prof = profile(train, dev, sync=False, gpu=True)
    result = prof.result()
    lines = gpu_lines(result, train)
    assert (lines[1].total_ns, lines[1].backward_total_ns) == (8_000_000, 4_000_000)
    assert (lines[2].total_ns, lines[2].backward_self_ns) == (2_000_000, 1_000_000)
    assert lines[3].backward_total_ns == 0
    assert 4 not in lines  # backward() itself keeps nothing: every node was built here
    assert result.kernels.backward_ns == result.kernels.backward_to_forward_ns == 5_000_000
    assert "Bwd" in render_text(result)


def test_torch_ops_are_recorded_only_while_backward_runs(dev: FakeDevice) -> None:
    started: list[Any] = []
    start = dev.start_kernel_trace

    def keep(*, cuda: bool = True) -> Any:
        started.append(start(cuda=cuda))
        return started[-1]

    def train(dev: FakeDevice) -> None:
        dev.launch(0.004, grad=True)
        dev.backward()
        dev.launch(0.001, grad=True)
        dev.backward()

    with pytest.MonkeyPatch.context() as patch:
        install(patch, start_kernel_trace=keep)
        result = profile(train, dev, sync=False, gpu=True).result()
    (recorder,) = started
    # Off once the start's marks are made; on for each backward() and off after; on for
    # the end's marks.
    assert recorder.switches == [False, True, False, True, False, True]
    assert recorder.backward_calls == 2
    assert recorder.watching is None  # autograd's engine is its own again
    forward_ops = [op for op in recorder.ops if op.name == "aten::fake"]
    assert forward_ops == []  # the forward's kernels came by their runtime calls only
    lines = gpu_lines(result, train)
    assert (lines[1].total_ns, lines[1].backward_total_ns) == (8_000_000, 4_000_000)
    assert (lines[3].total_ns, lines[3].backward_total_ns) == (2_000_000, 1_000_000)
    assert 2 not in lines
    # gpumagic's own warm-up launch (one per session) is in no figure.
    assert dev.spins == 1
    assert result.kernels.work == 4
    assert result.kernels.charged_ns == result.kernels.total_ns == 10_000_000


def test_graph_replay_is_one_launch_of_the_replay_line(dev: FakeDevice) -> None:
    def replay(dev: FakeDevice) -> None:
        dev.launch(0.001)
        dev.graph_replay(0.003, kernels=3)

    result = profile(replay, dev, sync=False, gpu=True).result()
    lines = gpu_lines(result, replay)
    assert (lines[2].total_ns, lines[2].launches) == (3_000_000, 1)
    assert (result.kernels.graph_replays, result.kernels.graph_ns) == (1, 3_000_000)
    assert "1 CUDA-graph replay (3 ms): each charged to the line that replayed it" in render_text(
        result
    )


def test_a_kernel_launched_with_no_op_around_it_goes_by_its_runtime_call(
    dev: FakeDevice,
) -> None:
    def spin(dev: FakeDevice) -> None:
        dev.launch(0.001)
        dev.raw_launch(0.002)  # torch.cuda._sleep: no aten op, only cudaLaunchKernel

    result = profile(spin, dev, sync=False, gpu=True).result()
    lines = gpu_lines(result, spin)
    assert (lines[1].self_ns, lines[2].self_ns, lines[2].launches) == (1_000_000, 2_000_000, 1)
    assert result.kernels.charged_ns == result.kernels.total_ns == 3_000_000


def test_gpu_work_outside_the_profiled_lines_is_counted_apart(dev: FakeDevice) -> None:
    def launches(dev: FakeDevice) -> None:
        dev.launch(0.001)

    prof = GpuLineProfiler(sync=False, gpu=True)
    prof.add_target(launches)
    with prof.session():
        launches(dev)
        dev.launch(0.002)  # not in a profiled function
    result = prof.result()
    assert result.kernels.outside_ns == 2_000_000
    assert gpu_lines(result, launches)[1].total_ns == 1_000_000
    assert "2 ms of GPU work launched outside the profiled lines" in render_text(result)


def test_a_running_profiler_is_left_alone(dev: FakeDevice) -> None:
    other = dev.start_kernel_trace()  # the user's own torch.profiler
    result = profile(step, dev, gpu=True).result()
    assert result.kernels is None
    assert "a torch.profiler was already recording" in render_text(result)
    assert dev.recorder is other
    other.stop()


def test_sync_warnings_of_the_user_are_kept_when_they_asked_for_them(dev: FakeDevice) -> None:
    dev.debug_mode = 1
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        prof = profile(step, dev, gpu=True)
    assert any("synchronizing CUDA operation" in str(w.message) for w in seen)
    assert dev.debug_modes_set == []  # already on: left alone
    ((_, extras),) = prof.result().extras.items()
    assert extras[step.__code__.co_firstlineno + 2].syncs == 1


def test_other_warnings_still_reach_the_user(dev: FakeDevice) -> None:
    def noisy(dev: FakeDevice) -> None:
        warnings.warn("keep me", UserWarning, stacklevel=1)
        dev.item()

    with pytest.warns(UserWarning, match="keep me"):
        profile(noisy, dev, gpu=True)


def test_memory_delta_and_peak(dev: FakeDevice) -> None:
    def mem(dev: FakeDevice) -> None:
        block = dev.gpu.alloc(100)
        dev.gpu.free(dev.gpu.alloc(300))
        dev.gpu.free(block)

    dev.gpu.free(dev.gpu.alloc(10_000))  # the process-wide peak is far above what mem() reaches
    prof = profile(mem, dev, memory=True)
    ((_, extras),) = prof.result().extras.items()
    first = mem.__code__.co_firstlineno
    alloc, temp, free = extras[first + 1], extras[first + 2], extras[first + 3]
    assert (alloc.mem_delta, alloc.mem_peak, alloc.mem_peak_bound) == (100, 100, False)
    assert (temp.mem_delta, temp.mem_peak, temp.mem_peak_bound) == (0, 300, True)
    assert (free.mem_delta, free.mem_peak, free.mem_peak_bound) == (-100, 0, False)
    assert (
        dev.gpu.counters[0]["peak_allocated"] == 10_000
    )  # the allocator's peak counter was not reset


def test_memory_peak_is_exact_when_the_line_sets_a_new_peak(dev: FakeDevice) -> None:
    def temp(dev: FakeDevice) -> None:
        dev.gpu.free(dev.gpu.alloc(500))

    prof = profile(temp, dev, memory=True)
    ((_, extras),) = prof.result().extras.items()
    line = extras[temp.__code__.co_firstlineno + 1]
    assert (line.mem_delta, line.mem_peak, line.mem_peak_bound) == (0, 500, False)


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [
        ((0, 0, 0, 0), (100, 100, 100, 0), (100, True)),  # new peak
        ((50, 900, 50, 0), (150, 900, 150, 0), (100, True)),  # only allocated
        ((50, 900, 50, 0), (0, 900, 50, 50), (0, True)),  # only freed
        ((50, 900, 50, 0), (50, 900, 350, 300), (300, False)),  # both: a bound
        ((50, 900, 50, 0), (50, 900, 2050, 2000), (850, False)),  # bound capped by the peak
        ((50, 900, 50, 0), (60, 70, 60, 0), (20, True)),  # peak reset within the line
    ],
)
def test_peak_above_start(
    start: tuple[int, int, int, int], end: tuple[int, int, int, int], expected: tuple[int, bool]
) -> None:
    assert peak_above(start, end) == expected


def test_no_sync_while_a_cuda_graph_is_captured(dev: FakeDevice) -> None:
    def capture(dev: FakeDevice) -> None:
        dev.capturing = True
        dev.launch(0.001)
        dev.launch(0.001)
        dev.capturing = False

    prof = profile(capture, dev, gpu=True)
    result = prof.result()
    assert result.capture_skips >= 3
    # + the idle-synchronize calibrations and the one after the run (--gpu's record)
    assert result.calibration_syncs >= 16
    assert dev.syncs == result.syncs + result.calibration_syncs + result.end_syncs
    assert result.failure is None


def test_a_failing_synchronize_stops_the_cuda_work_not_the_code(dev: FakeDevice) -> None:
    dev.sync_error = RuntimeError("pretend GPU failed")
    prof = profile(step, dev, gpu=True, memory=True)
    dev.sync_error = None  # pytest_cuda's post-test check synchronizes through the seam too
    result = prof.result()
    assert result.failure == "RuntimeError: pretend GPU failed"
    assert dev.debug_modes_set in ([], [1, 0])
    assert rows(prof, step)[2][0] == 1  # the code ran to its end


def test_a_synchronize_failing_in_the_raw_record_stops_it_not_the_code(
    dev: FakeDevice,
) -> None:
    def flaky(dev: FakeDevice) -> int:
        dev.launch(0.001)
        dev.sync_error = RuntimeError("pretend GPU failed")
        dev.launch(0.001)
        return 1

    prof = profile(flaky, dev, gpu=True)  # --gpu, synchronized: the raw record
    dev.sync_error = None
    result = prof.result()
    assert result.failure == "RuntimeError: pretend GPU failed"
    # the first line's (it armed the hook: CUDA was in use) and the launch's; none after
    assert result.syncs == 2
    assert [hits for hits, _ in rows(prof, flaky).values()] == [1, 1, 1, 1]
    assert dev.debug_modes_set == [1, 0]


def test_cuda_starting_within_the_run_is_picked_up(
    dev: FakeDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[int] = []
    queued: list[Callable[[], object]] = []
    install(
        monkeypatch,
        devices_with_context=lambda: tuple(started),
        is_initialized=lambda: bool(started),
        on_cuda_init=lambda call: queued.append(call) or True,
    )

    def start_cuda() -> None:
        """What torch's lazy initialisation does: a context, then the queued calls."""
        started.append(0)
        for call in queued:
            call()

    def first_use(dev: FakeDevice) -> float:
        start_cuda()
        dev.launch(WORK)
        return dev.item()

    prof = profile(first_use, dev)
    lines = rows(prof, first_use)
    assert lines[2][1] >= WORK * 0.98
    assert prof.result().cuda_used
    assert prof.result().hook in ("sys.settrace", "sys.monitoring")


def test_without_cuda_nothing_is_synchronized(monkeypatch: pytest.MonkeyPatch) -> None:
    # No context in this process, as far as the profiler can tell (on the GPU machine,
    # earlier tests may have created one).
    synchronized: list[tuple[int, ...]] = []
    install(monkeypatch, devices_with_context=lambda: (), synchronize=synchronized.append)
    prof = profile(lambda: sum(range(100)))
    result = prof.result()
    assert not result.cuda_used
    assert result.syncs == 0
    assert synchronized == []


def test_without_cuda_line_profilers_tracer_runs_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No hook, so no cost beyond line_profiler's: its own numbers, unchanged."""
    queued: list[Callable[[], object]] = []
    install(
        monkeypatch,
        devices_with_context=lambda: (),
        is_initialized=lambda: False,
        on_cuda_init=lambda call: queued.append(call) or True,
    )

    def busy(n: int) -> int:
        a = 0
        for i in range(n):
            a += i
        return a

    prof = profile(busy, 1000)
    assert prof.result().hook == "none"
    assert prof.get_stats().timings == prof.raw_stats().timings
    assert len(queued) == 1  # ready to start if torch starts CUDA during the session
    queued[0]()  # after the session: nothing happens
    assert prof.result().hook == "none"


# -- what line_profiler would get wrong or what it keeps -------------------------------


def test_multiline_statement_counted_once(dev: FakeDevice) -> None:
    def multi(n: int) -> int:
        total = max(
            n,
            1,
        )
        return total  # noqa: RET504 (two statements are the point)

    prof = profile(multi, 3)
    lines = rows(prof, multi)
    assert lines[1][0] == 1
    assert 2 not in lines
    assert 3 not in lines
    raw = prof.raw_stats()
    ((_, timings),) = raw.timings.items()
    assert len(timings) > 2  # line_profiler itself sees several physical lines


def test_statement_lines_map_continuations_and_headers() -> None:
    def shapes(xs: list[int]) -> int:
        total = sum(
            xs,
        )
        for x in range(
            3,
        ):
            total += x
        return total

    mapping, firsts = statement_lines(shapes.__code__)
    first = shapes.__code__.co_firstlineno
    offsets = {line - first: start - first for line, start in mapping.items()}
    assert offsets == {1: 1, 2: 1, 3: 1, 4: 4, 5: 4, 6: 4}
    assert {f - first for f in firsts} == {1, 4}
    assert statement_lines((lambda: 0).__code__) == ({}, frozenset())


def test_loop_headers_keep_line_profiler_hits(dev: FakeDevice) -> None:
    def loop() -> int:
        total = 0
        for i in range(
            4,
        ):
            total += i
        return total

    lines = rows(profile(loop), loop)
    assert lines[2][0] == 5  # the header: once per iteration, plus the exit
    assert lines[5][0] == 4


def test_generator_suspended_time_not_billed() -> None:
    def gen() -> Any:
        for i in range(3):  # noqa: UP028 (a line per yield is the point)
            yield i

    def consume() -> None:
        for _ in gen():
            time.sleep(0.03)

    prof = GpuLineProfiler()
    prof.add_target(gen)
    prof.add_target(consume)
    with prof.session():
        consume()
    lines = rows(prof, gen)
    # Billed, the 90 ms it waited at its yield would outweigh the consumer's sleeps: a
    # share of them, not a number of seconds a loaded host could exceed (issue 39).
    slept = rows(prof, consume)[2][1]
    assert sum(t for _, t in lines.values()) < slept / 3
    assert lines[2][0] == 3


def test_recursion_counts_every_frame() -> None:
    def fib(n: int) -> int:
        if n < 2:
            return n
        return fib(n - 1) + fib(n - 2)

    lines = rows(profile(fib, 6), fib)
    assert lines[1][0] == 25  # calls of fib(6)
    assert lines[3][0] == 12


def test_exception_closes_the_open_line(dev: FakeDevice) -> None:
    def fails(dev: FakeDevice) -> None:
        dev.launch(WORK)
        raise ValueError("boom")

    prof = GpuLineProfiler()
    prof.add_target(fails)
    with pytest.raises(ValueError, match="boom"), prof.session():
        fails(dev)
    lines = rows(prof, fails)
    assert lines[1][1] >= WORK * 0.98
    assert lines[2][0] == 1


def test_keyboard_interrupt_stops_synchronizing(dev: FakeDevice) -> None:
    def interrupted(dev: FakeDevice) -> None:
        dev.launch(WORK)
        dev.launch(1.0), signal_arrives()

    def signal_arrives() -> None:
        raise KeyboardInterrupt

    prof = GpuLineProfiler()
    prof.add_target(interrupted)
    with pytest.raises(KeyboardInterrupt), prof.session():
        interrupted(dev)
    # Did not wait for the pretend GPU: its 1 s of work is still queued (not a time bound,
    # which a loaded host can break: issue 39).
    assert time.perf_counter() < dev.free_at
    assert rows(prof, interrupted)[1][1] >= WORK * 0.98  # synchronized until then


def test_own_cost_is_subtracted(dev: FakeDevice) -> None:
    """gpumagic's hook costs about a microsecond per line; most of it is removed."""

    def busy(n: int) -> int:
        a = 0
        for i in range(n):
            a += i
        return a

    prof = profile(busy, 20_000)
    raw = sum(t for _, _, t in next(iter(prof.raw_stats().timings.values())))
    corrected = sum(t for _, _, t in next(iter(prof.get_stats().timings.values())))
    assert corrected < raw
    assert prof.result().hook in ("sys.settrace", "sys.monitoring")


def test_the_table_refreshes_only_files_on_disk(dev: FakeDevice) -> None:
    """Source that no file holds (a cell, generated code) is left as linecache has it:
    refreshing it would drop the entry, and the table would lose its lines."""
    name = "<generated: gpumagic refresh test>"
    source = "def made(dev):\n    dev.gpu.free(dev.gpu.alloc(64))\n"
    linecache.cache[name] = (len(source), 1.0, source.splitlines(True), name)
    try:
        namespace: dict[str, Any] = {}
        exec(compile(source, name, "exec"), namespace)
        prof = profile(namespace["made"], dev, memory=True)
        text = render_text(prof.result())
        assert "dev.gpu.free(dev.gpu.alloc(64))" in text
        assert linecache.getlines(name) == source.splitlines(True)
    finally:
        linecache.cache.pop(name, None)


# -- targets ----------------------------------------------------------------------------


def test_torch_compiled_callables_are_reported_not_profiled() -> None:
    def fn(x: int) -> int:
        return x

    fn._torchdynamo_orig_callable = fn  # type: ignore[attr-defined]
    prof = GpuLineProfiler()
    assert prof.add_target(fn, name="cfn") == 0
    assert "cfn is torch.compile'd" in prof.notes[0]


def test_restore_code_gives_back_the_original_code() -> None:
    def target() -> int:
        return 1

    original = target.__code__
    prof = profile(target)
    assert target.__code__ is not original  # line_profiler padded it
    prof.restore_code()
    assert target.__code__ is original


# -- restoration ------------------------------------------------------------------------


def test_trace_function_restored() -> None:
    def tracer(frame: Any, event: str, arg: Any) -> None:
        return None

    sys.settrace(tracer)
    try:
        profile(step, FakeDevice())
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)


def test_thread_of_the_session_only_on_legacy_trace() -> None:
    done = threading.Event()
    prof = GpuLineProfiler()
    prof.add_target(step)
    with prof.session():
        thread = threading.Thread(target=done.set)
        thread.start()
        thread.join()
    assert done.is_set()
    assert sys.gettrace() is None


@pytest.mark.skipif(sys.version_info < (3, 12), reason="sys.monitoring is 3.12+")
def test_monitoring_tool_ids_restored_and_skipped_when_taken(dev: FakeDevice) -> None:
    mon: Any = sys.monitoring  # type: ignore[attr-defined,unused-ignore]
    mon.use_tool_id(3, "someone else")
    try:
        prof = profile(step, dev)
        assert prof.result().hook == "sys.monitoring"
        assert [mon.get_tool(i) for i in range(6)] == [None, None, None, "someone else", None, None]
    finally:
        mon.free_tool_id(3)


@pytest.mark.skipif(sys.version_info < (3, 12), reason="sys.monitoring is 3.12+")
def test_busy_tool_ids_are_a_clear_error(dev: FakeDevice) -> None:
    """With CUDA in use the hook is installed as the session starts, and says why not."""
    mon: Any = sys.monitoring  # type: ignore[attr-defined,unused-ignore]
    for tool in (3, 4, 5):
        mon.use_tool_id(tool, f"tool {tool}")
    try:
        prof = GpuLineProfiler()
        prof.add_target(step)
        with pytest.raises(ProfilerBusy, match=r"tool ids 3 \(tool 3\), 4 \(tool 4\)"):
            prof.session().__enter__()
        assert mon.get_tool(2) is None
    finally:
        for tool in (3, 4, 5):
            mon.free_tool_id(tool)
