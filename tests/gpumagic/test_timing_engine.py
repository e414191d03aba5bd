"""The measurement engine through plain calls: on the host (this machine), and its GPU
branches against a stand-in for the GPU seam whose "events" read the host clock.

The stand-in (``fake_runtime.FakeSeam``) is put in the seam (``gpumagic.cuda``) as every
fake is; the real GPU runs of the same branches are in ``test_timing_gpu.py``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import pytest
from fake_runtime import FakeClock, FakeSeam, counting

from fake_cuda import install
from gpumagic import cuda, cuda_errors, timing, timing_plan
from gpumagic.cuda import runtime
from gpumagic.timing import TimingOptions, time_cuda
from gpumagic.timing_result import CudaTimeResult
from gpumagic.units import parse_amount

if TYPE_CHECKING:
    from collections.abc import Callable


# -- options and parsing ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loops": 0}, "loops must be at least 1, got 0"),
        ({"repeat": -1}, "repeat must be at least 1"),
        ({"warmup": -2}, "warmup must be at least 0"),
        ({"precision": 0}, "precision must be at least 1"),
        ({"budget": 0.0}, "budget must be a positive number of seconds"),
        ({"budget": float("inf")}, "budget must be a positive"),
        ({"flops": -1.0}, "flops must be a positive number"),
        ({"device": -1}, "device index must be 0 or more"),
    ],
)
def test_options_refuse_bad_values(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TimingOptions(**kwargs)


def test_cuda_only_options_are_named_as_typed() -> None:
    options = TimingOptions(cold=True, sync_check=True, device=1)
    assert options.cuda_only() == ["--cold", "--sync-check", "--device 1"]


@pytest.mark.parametrize(
    ("text", "value"),
    [("1.2e12", 1.2e12), ("2*4096**3", 2 * 4096**3), ("(1+1)*3", 6), ("10/4", 2.5)],
)
def test_parse_amount(text: str, value: float) -> None:
    assert parse_amount(text) == value


def test_parse_amount_sizes_and_errors() -> None:
    assert parse_amount("512MiB", sizes=True) == 512 * 2**20
    assert parse_amount("4096", sizes=True) == 4096
    for bad in ("abc", "__import__('os')", "2**1000", "0", "-5", "1/0", "512MiB"):
        with pytest.raises(ValueError, match="not a"):
            parse_amount(bad)


# -- on the host (no GPU here, or --device cpu) -----------------------------------------
def test_host_timing_reports_like_timeit(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(timing, "time", clock)
    options = TimingOptions(budget=0.3, host_only=True)
    result = time_cuda(clock.body(200e-6), options, takes_count=False, label="s")
    assert result.clock == "host"
    assert result.gpu_time is None
    assert 150e-6 < result.median < 1e-3
    assert result.loops >= 2
    assert result.repeat >= 3
    assert result.first_call is not None
    assert result.label == "s"
    assert result.all_runs == result.host_runs
    assert any("Timed on the host like %timeit (--device cpu)" in n for n in result.notes)


@pytest.mark.parametrize("clock", ["host", "gpu"])
def test_warnings_name_causes_of_the_clock_used(clock: str) -> None:
    """A slow first call, a fast first run and a large spread, on each clock."""
    runs = [1e-3, 1.3e-3, 1.1e-3, 1.6e-3, 1.2e-3, 1.5e-3, 1.4e-3]
    result = CudaTimeResult(
        loops=1, repeat=7, all_runs=runs, host_runs=runs, clock=clock, first_call=0.5
    )
    text = " ".join(timing_plan.warnings_for(result))
    assert "the first call took 500 ms" in text
    assert "the first run was" in text
    assert "the spread is large" in text
    gpu_words = ("cuBLAS", "power or thermal", "autotuning", "on the GPU")
    if clock == "host":
        assert not any(word in text for word in gpu_words), text
        assert "other work on this machine" in text
    else:
        assert all(word in text for word in gpu_words), text


def test_the_budget_note_adds_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of 300 ms in a 1 s budget: the note says where the rest of it went, and that
    the one warm-up batch of 300 ms ran over the quarter of the budget it has (issue 39)."""
    clock = FakeClock()
    monkeypatch.setattr(timing, "time", clock)
    options = TimingOptions(host_only=True, count=False)
    result = time_cuda(clock.body(0.3), options, takes_count=False)
    (note,) = [n for n in result.notes if n.startswith("Only")]
    assert note == (
        f"Only {result.repeat} runs fit in the budget of 1 s (--budget): warm-up and sizing "
        "took 300 ms (their share is 250 ms), then a run took 300 ms."
    )


def test_the_host_floor_is_a_run_of_no_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reaching the body costs 1 µs a run, whatever its loops: that is the floor (it was
    two clock reads, which cost nothing here, and -n 1 drew no warning; issue 29)."""
    clock = FakeClock()
    monkeypatch.setattr(timing, "time", clock)

    def body(n: int) -> None:
        clock.advance(1e-6 + n * 1e-8)

    result = time_cuda(body, TimingOptions(loops=1, repeat=50, host_only=True))
    assert result.floor == pytest.approx(1e-6)
    assert result.median == pytest.approx(1.01e-6)
    assert any("of the timing floor (1 µs per loop here)" in w for w in result.warnings)


def test_the_budget_holds_on_a_busy_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every other run is 20 times slower (the machine got busy after the warm-up):
    runs far from their length were resized, each time starting over, long past the
    budget (1.8 s of 1 s; issue 29). A resize now needs room for the fewest runs."""
    clock = FakeClock()
    monkeypatch.setattr(timing, "time", clock)
    calls = 0

    def body(n: int) -> None:
        nonlocal calls
        calls += 1
        busy = calls > 12 and calls % 2 and n > 0
        clock.advance(n * 10e-6 * (20 if busy else 1))

    result = time_cuda(body, TimingOptions(host_only=True, count=False))
    assert result.first_call is not None
    assert clock.now - result.first_call <= 1.0
    assert result.repeat >= 3


def test_a_run_far_past_the_budget_is_the_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The machine got 200 times slower after the warm-up (torch's threads on a loaded
    CPU): the runs sized to 40 ms took 8 s each, and the fewest runs made it 24 s of a
    1 s budget (a CPU trial of the getting-started samples; issue 29, item 4); resized
    runs after it still ran past the budget (issue 39). A run that ends past the budget
    is the last: the budget is overrun by that one run only, and the note says so."""
    clock = FakeClock()
    monkeypatch.setattr(timing, "time", clock)
    slow = False

    def body(n: int) -> None:
        nonlocal slow
        slow = slow or n >= 4000  # from the first run on (the warm-up's batches are shorter)
        clock.advance(n * 10e-6 * (200 if slow else 1))

    result = time_cuda(body, TimingOptions(host_only=True, count=False))
    assert result.first_call is not None
    (run,) = result.all_runs
    assert clock.now - result.first_call <= 1.0 + run, clock.now
    assert result.median == pytest.approx(2e-3)  # the slow machine's time, per loop
    assert "Only 1 run fit in the budget of 1 s (--budget)" in " ".join(result.notes)


def test_host_timing_with_fixed_loops_and_repeat() -> None:
    calls = []
    result = time_cuda(
        lambda: calls.append(1),
        TimingOptions(loops=50, repeat=4, warmup=3, host_only=True, count=False),
        takes_count=False,
    )
    assert (result.loops, result.repeat) == (50, 4)
    # first call + 3 warm-up calls + 1 sizing call + 4 runs of 50 (and no counting call)
    assert len(calls) == 1 + 3 + 1 + 4 * 50


def test_the_counting_call_is_one_more_after_the_runs() -> None:
    torch = pytest.importorskip("torch")
    calls = []
    a = torch.randn(4, 4)
    result = time_cuda(
        lambda: calls.append(a @ a),
        TimingOptions(loops=50, repeat=4, warmup=3, host_only=True),
        takes_count=False,
    )
    assert len(calls) == 1 + 3 + 1 + 4 * 50 + 1
    assert (result.flops, result.bytes) == (2 * 4**3, 2 * 4 * 4 * 4)


def test_cuda_options_say_they_need_cuda_on_the_host() -> None:
    options = TimingOptions(host_only=True, graph=True, kernels=True, loops=10, repeat=3)
    result = time_cuda(lambda: None, options, takes_count=False)
    assert result.clock == "host"
    # One warning for all of them; the note says why, once.
    assert "--graph and --kernels need CUDA: not used" in result.warnings
    assert "Timed on the host like %timeit (--device cpu)." in result.notes


def test_body_errors_propagate_unchanged() -> None:
    def body() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        time_cuda(body, TimingOptions(host_only=True), takes_count=False)


def test_ctrl_c_returns_the_runs_so_far() -> None:
    state = {"calls": 0}

    def body(n: int) -> None:
        state["calls"] += 1
        if state["calls"] > 8:
            raise KeyboardInterrupt
        time.sleep(1e-4 * n)

    result = time_cuda(body, TimingOptions(loops=1, warmup=0, host_only=True))
    assert result.interrupted
    assert result.repeat >= 1
    assert any("interrupted (Ctrl-C)" in w for w in result.warnings)


def test_ctrl_c_before_anything_was_measured_propagates() -> None:
    def body(n: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        time_cuda(body, TimingOptions(host_only=True))


# -- the GPU branches, against a stand-in seam -------------------------------------------
@pytest.fixture
def clock(fake_clock: FakeClock) -> FakeClock:
    """The engine's host clock and the stand-in's events, waits and bodies on one
    :class:`FakeClock` (conftest's ``fake_clock``)."""
    return fake_clock


def test_gpu_runs_use_events_spin_and_synchronize(seam: FakeSeam, clock: FakeClock) -> None:
    result = time_cuda(counting(seam, 300e-6), TimingOptions(budget=0.3), label="x")
    assert result.clock == "gpu"
    assert result.mode == "eager"
    assert result.median == pytest.approx(300e-6)
    assert result.device_name == "Fake GPU"
    assert result.torch_version == "2.x"
    assert result.devices == [0]
    assert not result.side_streams
    # Each run: sync, spin, start event ... end event, sync.
    assert "sync spin record" in " ".join(seam.log)
    assert seam.log[-2:] == ["sync", "restore streams"]
    assert result.verdict == ""


def test_work_left_on_other_streams_is_counted(seam: FakeSeam, clock: FakeClock) -> None:
    body = clock.body(1e-3)

    def run(n: int) -> None:
        for _ in range(n):
            body()
            seam.side_work(4e-3)  # finishes 4 ms after the current stream

    result = time_cuda(run, TimingOptions(loops=1, repeat=5, warmup=0))
    assert result.side_streams
    assert result.median == pytest.approx(5e-3)  # the 1 ms body and the 4 ms left over
    assert "other streams" in result.text()


def test_a_slow_device_sync_is_not_taken_for_side_streams(
    seam: FakeSeam, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The device sync after the end event sometimes takes tens of microseconds longer
    # than when idle (seen after cuBLAS GEMMs and joined streams): not side work. On a
    # fake clock, so that a loaded host cannot add its own delays.
    clock = FakeClock()
    monkeypatch.setattr(timing, "time", clock)
    seam.clock = clock.perf_counter
    seam.wait = clock.advance
    body = clock.body(1e-3)

    def left_on_a_side_stream(seconds: float) -> Callable[[int], None]:
        def run(n: int) -> None:
            for _ in range(n):
                body()
                seam.side_work(seconds)

        return run

    options = TimingOptions(loops=1, repeat=5, warmup=0)
    result = time_cuda(left_on_a_side_stream(40e-6), options)
    assert not result.side_streams
    assert "other streams" not in result.text()
    four_ms = time_cuda(left_on_a_side_stream(4e-3), options)
    assert four_ms.side_streams  # the same clock sees real side work
    assert four_ms.median == pytest.approx(5e-3)


def test_a_body_without_cuda_work_is_timed_on_the_host(seam: FakeSeam) -> None:
    seam.initialized = False
    result = time_cuda(counting(seam, 1e-4), TimingOptions(budget=0.2, graph=True))
    assert result.clock == "host"
    assert result.verdict == "no GPU work was launched"
    assert any("never initialised CUDA" in n for n in result.notes)
    assert "--graph needs CUDA: not used" in result.warnings


def test_graph_mode_replays_an_unrolled_capture(seam: FakeSeam) -> None:
    result = time_cuda(counting(seam, 50e-6), TimingOptions(budget=0.3, graph=True))
    assert result.mode == "graph"
    captured = [line for line in seam.log if line.startswith("captured")]
    unroll = int(captured[0].split()[1])
    assert 1 < unroll <= timing_plan.GRAPH_MAX_UNROLL
    assert result.loops % unroll == 0
    assert any(n.startswith(f"--graph: {unroll} loops captured") for n in result.notes)


def test_graph_capture_failure_falls_back_and_says_why(seam: FakeSeam) -> None:
    seam.capture_error = "the body synchronizes with the host"
    result = time_cuda(counting(seam, 50e-6), TimingOptions(budget=0.2, graph=True))
    assert result.mode == "eager"
    assert result.clock == "gpu"
    assert any(
        w == "--graph: capture failed, timed eagerly instead: the body synchronizes with the host"
        for w in result.warnings
    )


def test_graph_rounds_fixed_loops_to_the_unroll(seam: FakeSeam) -> None:
    result = time_cuda(counting(seam, 20e-6), TimingOptions(loops=7, repeat=3, graph=True))
    unroll = int(next(x for x in seam.log if x.startswith("captured")).split()[1])
    assert result.loops % unroll == 0
    assert result.loops >= 7
    assert any(n.startswith("-n rounded up") for n in result.notes)


def test_cold_mode_flushes_before_each_single_call(seam: FakeSeam, clock: FakeClock) -> None:
    result = time_cuda(counting(seam, 200e-6), TimingOptions(budget=0.2, cold=True, kernels=True))
    assert result.mode == "cold"
    assert result.loops == 1
    assert result.median == pytest.approx(200e-6)
    # GPU sample: flush then the start event; host sample: flush, sync, then the call.
    text = " ".join(seam.log)
    assert "flush record" in text
    assert "flush sync" in text
    assert result.kernel_time is not None
    assert any(n.startswith("--cold: 128 MiB overwritten") for n in result.notes)


def test_kernels_pass_gives_busy_fraction_and_verdict(seam: FakeSeam, clock: FakeClock) -> None:
    seam.busy_us = 10.0  # 10 µs of kernels in a 200 µs loop: launch-bound
    result = time_cuda(counting(seam, 200e-6), TimingOptions(budget=0.2, kernels=True))
    assert result.kernel_time is not None
    assert result.kernel_loops >= 1
    assert result.kernel_time == pytest.approx(10e-6 / result.kernel_loops)
    assert result.busy_fraction == pytest.approx(result.kernel_time / 200e-6)  # of each loop
    assert result.verdict.startswith("launch/CPU-bound: GPU busy")
    assert result.cupti_ratio is None


def test_validate_reports_events_over_cupti(
    seam: FakeSeam, monkeypatch: pytest.MonkeyPatch
) -> None:
    seam.fixed_span = 2e-3  # every event interval, so every run, takes 2 ms

    def profile(
        warm: Any, run: Any, devices: Any, flushes: int = 0, steps: int = 1
    ) -> cuda.KernelProfile:
        warm()
        run()
        busy = 0.99 * seam.fixed_span * 1e6  # CUPTI sees 99 % of the run's span as kernels
        return cuda.KernelProfile(busy, busy, (("k", 1, busy),), 0)

    install(monkeypatch, profile_kernels=profile)
    result = time_cuda(counting(seam, 1e-6), TimingOptions(budget=0.2, validate=True))
    assert result.cupti_ratio == pytest.approx(1 / 0.99)
    assert result.cupti_events_time == pytest.approx(2e-3 / result.kernel_loops)
    assert "CUPTI check" in result.text()


def test_no_kernels_means_no_gpu_work(seam: FakeSeam) -> None:
    seam.busy_us = 0.0
    result = time_cuda(counting(seam, 50e-6), TimingOptions(budget=0.1, kernels=True))
    assert result.verdict == "no GPU work was launched (CPU tensors?)"


def test_sync_check_counts_per_loop_and_names_the_line(seam: FakeSeam) -> None:
    seam.syncs_per_call = 2
    result = time_cuda(
        counting(seam, 50e-6),
        TimingOptions(budget=0.1, sync_check=True),
        code_files=("<cell>",),
    )
    assert result.syncs_per_loop == 2
    assert result.sync_sites[0].op == "Tensor.item"
    assert result.sync_sites[0].where == "line 3"
    assert result.sync_sites[0].per_loop == 2


def test_device_option_makes_the_device_current(seam: FakeSeam) -> None:
    time_cuda(counting(seam, 10e-6), TimingOptions(budget=0.05, device=0))
    assert "device 0" in seam.log
    with pytest.raises(
        ValueError, match=r"--device 3: there is no cuda:3 here \(visible: cuda:0\)"
    ):
        timing.check_device(TimingOptions(device=3))


def test_body_errors_keep_their_type_and_restore_streams(seam: FakeSeam) -> None:
    state = {"n": 0}

    def run(n: int) -> None:
        state["n"] += 1
        if state["n"] == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access") as info:
        time_cuda(run, TimingOptions(budget=0.1))
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "CUDA_LAUNCH_BLOCKING=1" in notes
    assert "sticky" in notes
    assert seam.log[-1] == "restore streams"


def test_launch_bound_hint_without_kernels(seam: FakeSeam) -> None:
    # The stand-in's GPU never runs ahead of the host: the host launches all the time.
    result = time_cuda(counting(seam, 100e-6), TimingOptions(budget=0.2))
    assert any("likely launch/CPU-bound" in n for n in result.notes)


def test_noise_stop_ends_a_steady_measurement_early(seam: FakeSeam, clock: FakeClock) -> None:
    seam.fixed_span = 1e-3
    result = time_cuda(counting(seam, 100e-6), TimingOptions(budget=30.0))
    assert result.repeat == timing_plan.MIN_RUNS
    assert result.iqr == 0
    # The fewest runs, not the 30 s budget (on the fake clock: the bodies' own time).
    assert result.loops * result.repeat < seam.calls < 30.0 / 100e-6 / 10
    assert clock.now < 30.0 / 10


def test_a_gpu_that_slows_down_under_load_is_pointed_out(seam: FakeSeam) -> None:
    seam.fixed_span = 1e-3
    seam.slow_after = 12  # first call, sizing call, then the first run of 10 is fast
    result = time_cuda(counting(seam, 1e-6), TimingOptions(loops=10, repeat=8, warmup=0))
    assert result.timings[0] < result.timings[-1]
    assert any(
        w.startswith("the first run was 17 % faster than the later") for w in result.warnings
    )
    steady = time_cuda(counting(seam, 1e-6), TimingOptions(loops=10, repeat=8, warmup=0))
    assert not any("first run" in w for w in steady.warnings)


def test_floor_warning_for_a_tiny_body(seam: FakeSeam) -> None:
    result = time_cuda(lambda n: None, TimingOptions(loops=1, repeat=5, warmup=0))
    assert any("timing floor" in w for w in result.warnings)


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("CUDA error: device-side assert triggered", "sticky"),
        ("CUDA error: invalid argument", "CUDA_LAUNCH_BLOCKING"),
        ("CUDA out of memory. Tried to allocate 2 GiB", "ran out of GPU memory"),
        ("shapes cannot be multiplied", None),
    ],
)
def test_cuda_error_hints(text: str, hint: str | None) -> None:
    found = cuda_errors.error_hint(RuntimeError(text))
    if hint is None:
        assert found is None
    else:
        assert found is not None
        assert hint in found


def test_capture_reason_explains_host_syncs() -> None:
    first = RuntimeError("CUDA error: operation not permitted when stream is capturing")
    try:
        try:
            raise first
        except RuntimeError:
            raise RuntimeError("operation failed due to a previous error during capture")  # noqa: B904
    except RuntimeError as exc:
        reason = runtime._capture_reason(exc)
    assert "synchronizes with the host" in reason
    assert ".item()" in reason
    assert "not permitted when stream is capturing" in reason
