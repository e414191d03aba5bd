"""What ``%cudatime`` says about the GPU's clock, CUPTI, gaps and cold L2 (issue 28),
on numbers alone, through the engine against a stand-in seam with a fake NVML, through
the magic's options, and the seam's NVML reader against the fake machine.

The real GPU runs of the same branches are in ``test_timing_clocks_gpu.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest
from fake_runtime import FakeClock, FakeSeam, counting

from fake_cuda import FakeMachine, board, install
from gpumagic import cuda
from gpumagic import timing_checks as checks
from gpumagic.cuda import clocks, discovery
from gpumagic.timing import TimingOptions, time_cuda
from gpumagic.timing_result import CudaTimeResult, KernelStat
from gpumagic.units import quantile

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

POWER_CAP, IDLE, THERMAL, USER = 0x4, 0x1, 0x40, 0x2
MATMUL_LINE = (
    "the GPU ran at 1395\u20131455 MHz (power cap; 27\u201330 % under the default 1980 MHz): "
    "this time holds at that clock"
)


# -- the rules, on numbers ------------------------------------------------------------------
def test_reason_names_most_telling_first_idle_left_out() -> None:
    assert checks.reason_names(0) == []
    assert checks.reason_names(IDLE) == []
    assert checks.reason_names(IDLE | POWER_CAP) == ["power cap"]
    assert checks.reason_names(USER | THERMAL | POWER_CAP) == [
        "power cap",
        "hardware thermal slowdown",
        "clocks set by the user",
    ]
    assert checks.is_throttling(POWER_CAP | IDLE)
    assert not checks.is_throttling(IDLE | USER)
    assert not checks.is_throttling(None)


def test_the_throttle_line_names_the_reason_and_the_distance() -> None:
    runs = [1395, 1440, 1455, 1425]
    assert checks.throttle_line(runs, 1980, ["power cap"], 4) == MATMUL_LINE
    assert checks.throttled(runs, 1980, 4)
    assert checks.clock_range(runs) == (1395, 1432, 1455)
    assert checks.at_default_share(runs, 1980) == 0


def test_a_spin_at_its_default_clock_gets_no_line() -> None:
    runs = [1980] * 7
    assert checks.throttle_line(runs, 1980, [], 0) is None
    assert not checks.throttled(runs, 1980, 0)
    assert checks.at_default_share(runs, 1980) == 1.0
    # One 15 MHz step under the default still counts as at it.
    assert checks.at_default_share([1965, 1980], 1980) == 1.0


def test_a_slow_clock_without_a_reason_says_nvml_gave_none() -> None:
    line = checks.throttle_line([1700] * 5, 1980, [], 0)
    assert line == (
        "the GPU ran at 1700 MHz (NVML gave no reason; 14 % under the default 1980 MHz): "
        "this time holds at that clock"
    )


def test_some_runs_limited_and_an_unknown_default() -> None:
    line = checks.throttle_line([1980, 1980, 1500], None, ["power cap"], 1)
    assert line == (
        "the GPU ran at 1500\u20131980 MHz (power cap after 1 of 3 runs): "
        "this time holds at that clock"
    )


def test_unknown_clocks_say_nothing() -> None:
    assert checks.clock_range([]) is None
    assert checks.clock_range([None, None]) is None
    assert checks.throttle_line([None], 1980, ["power cap"], 1) is None
    assert not checks.throttled([], 1980, 0)
    assert checks.at_default_share([], 1980) is None
    assert checks.at_default_share([1980], None) is None


def test_runs_far_off_the_median_clock_are_set_apart() -> None:
    keep, apart = checks.split_off_clock([1440, 1980, 1425, None, 1455, 1200])
    assert apart == [1, 5]
    assert keep == [0, 2, 3, 4]
    assert checks.split_off_clock([None, None]) == ([0, 1], [])


def test_gap_row_splits_events_over_kernels() -> None:
    row = checks.gap_row(210e-6, 200e-6, 204e-6, 171, 3)
    assert row == (
        "gaps",
        "10 µs per loop",
        "CUDA events 210 µs \u2212 CUPTI kernels 200 µs per loop, same 171 loops (4.8 % of "
        "the events): 4 µs between kernels, 6 µs launching and around them",
    )
    assert checks.gap_row(200e-6, 200e-6, None, 10, 3) is None
    assert checks.gap_row(None, 200e-6, None, 10, 3) is None
    assert checks.gap_row(10e-6, 0.0, None, 10, 3) is None  # no kernels: the verdict says so


def cold_readings(cold: list[float], warm: list[float], **more: Any) -> SimpleNamespace:
    """What the L2 check row reads: cold runs (per loop) and warm single calls."""
    readings = {
        "median": quantile(cold, 0.5),
        "timings": cold,
        "cold_warm_time": quantile(warm, 0.5) if warm else None,
        "cold_warm_timings": warm,
        "flush_bytes": 100 << 20,
        "l2_bytes": 50 << 20,
        "precision": 3,
    }
    return SimpleNamespace(**{**readings, **more})


def test_cold_row_and_the_warning_when_cold_and_warm_agree() -> None:
    # Too few calls for an interval: the ratio alone.
    row = checks.cold_row(cold_readings([30e-6], [10e-6]))
    assert row == (
        "L2 check",
        "cold 3.00\u00d7 warm",
        "warm single calls 10 µs · 100.0 MiB overwritten before each call, 2.0\u00d7 the "
        "50.0 MiB L2",
    )
    assert checks.cold_warning(30e-6, 10e-6) is None
    warning = checks.cold_warning(1.01e-3, 1e-3)
    assert warning is not None
    assert warning.startswith("--cold: cold and warm single calls agree (1.01\u00d7)")
    assert checks.cold_warning(1e-3, None) is None


def test_cold_row_gives_the_ratios_interval_and_no_verdict_within_the_noise() -> None:
    """The ratio the L2 check prints has its interval, as compare's do (issue 39): a
    3x gap among tight runs is one; a 1 % gap among runs that spread 5 % is noise."""
    cold = [30e-6 * (1 + 0.01 * i) for i in range(9)]
    warm = [10e-6 * (1 + 0.01 * i) for i in range(9)]
    row = checks.cold_row(cold_readings(cold, warm))
    assert row is not None
    assert row[1].startswith("cold 3.00\u00d7 warm (")
    assert row[1].endswith(", 99 %)")
    interval = checks.cold_interval(cold, warm)
    assert interval is not None
    assert interval.low > 1
    assert checks.cold_warning(quantile(cold, 0.5), quantile(warm, 0.5), interval) is None

    noisy_warm = [1e-3 * (1 + 0.05 * ((i * 7) % 9 - 4) / 4) for i in range(9)]
    noisy_cold = [t * 1.01 for t in reversed(noisy_warm)]
    row = checks.cold_row(cold_readings(noisy_cold, noisy_warm))
    assert row is not None
    assert row[1].startswith("no difference within the noise (")
    interval = checks.cold_interval(noisy_cold, noisy_warm)
    assert interval is not None
    assert interval.holds_one
    warning = checks.cold_warning(quantile(noisy_cold, 0.5), quantile(noisy_warm, 0.5), interval)
    assert warning is not None
    assert warning.startswith("--cold: cold and warm single calls do not differ within the noise")


# -- the result carries them ----------------------------------------------------------------
def gpu_result(**kwargs: Any) -> CudaTimeResult:
    runs = kwargs.pop("runs", [200e-6] * 4)
    return CudaTimeResult(
        loops=1, repeat=len(runs), all_runs=runs, host_runs=runs, clock="gpu", **kwargs
    )


def test_the_result_carries_clocks_and_they_reach_the_dict() -> None:
    r = gpu_result(
        run_clocks_mhz=[1395, 1440, 1455, None],
        default_clock_mhz=1980,
        throttle_reasons=["power cap"],
        throttled_runs=3,
    )
    assert r.clocks_mhz == (1395, 1440, 1455)
    assert r.at_default_clock == 0
    assert r.throttled
    data = r.to_dict()
    assert data["clocks_mhz"] == (1395, 1440, 1455)
    assert data["throttle_reasons"] == ["power cap"]
    assert data["throttled"] is True
    assert data["run_clocks_mhz"] == [1395, 1440, 1455, None]
    unknown = gpu_result()
    assert unknown.clocks_mhz is None
    assert unknown.at_default_clock is None
    assert not unknown.throttled


def test_the_cold_row_in_text_and_html() -> None:
    r = gpu_result(
        mode="cold",
        runs=[30e-6] * 15,
        cold_warm_time=10e-6,
        flush_bytes=100 << 20,
        l2_bytes=50 << 20,
    )
    assert r.cold_warm_ratio == pytest.approx(3.0)
    assert "L2 check     cold 3.00\u00d7 warm" in r.text()
    assert "L2 check" in r._repr_html_()
    assert "L2 check" not in gpu_result().text()


def test_a_value_wider_than_its_column_puts_its_detail_below() -> None:
    """The L2 check's "no difference within the noise (0.988-1.12x, 99 %)" is wider than the
    value column: its detail went to column 66 in a how-to page's output (issue 39)."""
    warm = [1e-3 * (1 + 0.05 * ((i * 7) % 9 - 4) / 4) for i in range(15)]
    r = gpu_result(
        mode="cold",
        runs=[t * 1.01 for t in reversed(warm)],
        cold_warm_time=1e-3,
        cold_warm_timings=warm,
        flush_bytes=100 << 20,
        l2_bytes=50 << 20,
    )
    lines = r.text().splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith("  L2 check")]
    assert "no difference within the noise" in lines[at]
    assert lines[at + 1].startswith(" " * 36 + "warm single calls")
    assert all(len(line) <= 80 for line in lines[1:])


def test_the_gaps_row_shows_with_kernel_figures() -> None:
    r = gpu_result(
        kernel_time=200e-6,
        kernel_span=204e-6,
        cupti_events_time=210e-6,
        kernel_loops=171,
        kernels=[KernelStat("gemm", 1, 200e-6)],
    )
    assert r.gap_time == pytest.approx(10e-6)
    text = r.text()
    assert "gaps         10 µs per loop" in text
    assert "4 µs between kernels" in text


# -- through the engine, with a fake NVML ---------------------------------------------------
def test_a_throttled_gpu_says_so_in_one_line(seam: FakeSeam) -> None:
    seam.machine.clocks = [(1395, POWER_CAP | IDLE), (1455, POWER_CAP), (1440, POWER_CAP)]
    result = time_cuda(counting(seam, 200e-6), TimingOptions(loops=5, repeat=6, warmup=0))
    assert result.clocks_mhz == (1395, 1440, 1455)
    assert result.default_clock_mhz == 1980
    assert result.throttle_reasons == ["power cap"]
    assert result.throttled_runs == 6
    assert result.at_default_clock == 0
    assert MATMUL_LINE in result.warnings
    assert "! the GPU ran at 1395\u20131455 MHz (power cap;" in result.text()
    assert "the GPU ran at 1395\u20131455 MHz (power cap;" in result._repr_html_()
    assert len(result.run_clocks_mhz) == result.repeat


def test_a_gpu_at_its_default_clock_gets_no_line(seam: FakeSeam) -> None:
    seam.machine.clocks = [(1980, IDLE)]
    result = time_cuda(counting(seam, 100e-6), TimingOptions(loops=5, repeat=5, warmup=0))
    assert result.clocks_mhz == (1980, 1980, 1980)
    assert result.at_default_clock == 1.0
    assert result.throttle_reasons == []
    assert not result.throttled
    assert not any("MHz" in line for line in result.warnings + result.notes)
    assert "MHz" not in result.text()


def test_without_nvml_the_clocks_are_unknown_and_nothing_is_said(seam: FakeSeam) -> None:
    seam.machine.clocks = []  # sm_clock answers None: no NVML here
    result = time_cuda(counting(seam, 100e-6), TimingOptions(loops=5, repeat=5, warmup=0))
    assert result.run_clocks_mhz == []
    assert result.clocks_mhz is None
    assert result.default_clock_mhz is None
    assert not result.throttled
    assert "MHz" not in result.text()
    # No clock is claimed. The generic warnings read from the run times alone (a large
    # spread, a first run faster than the later ones), which a loaded host can trigger
    # here, may name clock changes among their possible causes: that is no reading.
    generic = ("the spread is large", "the first run was")
    said = [t for t in result.warnings + result.notes if not t.startswith(generic)]
    assert "clock" not in " ".join(said)


def test_no_clock_is_read_on_the_host(seam: FakeSeam) -> None:
    seam.initialized = False  # the body launched no GPU work
    seam.machine.clocks = [(1980, 0)]
    result = time_cuda(counting(seam, 50e-6), TimingOptions(loops=5, repeat=3, warmup=0))
    assert result.clock == "host"
    assert seam.machine.clock_reads == 0
    assert result.run_clocks_mhz == []


def off_clock_runs(seam: FakeSeam) -> None:
    # Sizing takes no reading: the runs read 1440, 1980 (a run before the cap bit), 1440...
    seam.machine.clocks = [(1440, POWER_CAP), (1980, 0)] + [(1440, POWER_CAP)] * 10


def test_runs_off_the_median_clock_are_named_and_kept(seam: FakeSeam) -> None:
    off_clock_runs(seam)
    result = time_cuda(counting(seam, 100e-6), TimingOptions(loops=2, repeat=8, warmup=0))
    assert result.repeat == 8
    assert [mhz for _, mhz in result.clock_outliers] == [1980]
    assert not result.clock_outliers_dropped
    (note,) = [n for n in result.notes if "off the median clock" in n]
    assert note.startswith("1 of 8 runs ran more than 10 % off the median clock of 1440 MHz (")
    assert note.endswith(
        "at 1980 MHz): kept in the numbers; --clock-outliers drop leaves them out."
    )


def test_clock_outliers_drop_leaves_them_out(seam: FakeSeam) -> None:
    off_clock_runs(seam)
    options = TimingOptions(loops=2, repeat=8, warmup=0, clock_outliers="drop")
    result = time_cuda(counting(seam, 100e-6), options)
    assert result.repeat == 7
    assert len(result.all_runs) == len(result.host_runs) == len(result.run_clocks_mhz) == 7
    assert 1980 not in result.run_clocks_mhz
    assert result.clock_outliers_dropped
    assert result.throttled_runs == 7
    assert any(n.endswith("left out of the numbers (--clock-outliers drop).") for n in result.notes)


def test_clock_outliers_drop_keeps_at_least_three_runs(seam: FakeSeam) -> None:
    seam.machine.clocks = [(1980, 0), (1440, POWER_CAP)]
    options = TimingOptions(loops=2, repeat=3, warmup=0, clock_outliers="drop")
    result = time_cuda(counting(seam, 100e-6), options)
    assert result.repeat == 3
    assert "--clock-outliers drop: 2 runs would be left, fewer than 3: all 3 kept" in (
        result.warnings
    )
    assert not result.clock_outliers_dropped


def test_two_clocks_of_equal_weight_set_nothing_apart() -> None:
    assert checks.split_off_clock([1980, 1980, 1440, 1440]) == ([0, 1, 2, 3], [])
    line = checks.throttle_line([1980, 1980, 1440, 1440], 1980, ["power cap"], 2)
    assert line is not None
    assert "(power cap after 2 of 4 runs; up to 27 % under the default 1980 MHz)" in line


def test_clock_outliers_drop_without_nvml_says_so(seam: FakeSeam) -> None:
    options = TimingOptions(loops=2, repeat=3, warmup=0, clock_outliers="drop")
    result = time_cuda(counting(seam, 100e-6), options)
    assert any(
        w.startswith("--clock-outliers drop: the SM clock is unknown here")
        for w in (result.warnings)
    )


# -- --timer cupti ----------------------------------------------------------------------------
def test_timer_cupti_makes_cupti_the_headline_with_events_beside(
    seam: FakeSeam, fake_clock: FakeClock
) -> None:
    # On the fake clock: on the host's, a loaded machine stretched the event runs' sizing
    # until their per-loop time fell under CUPTI's (10 to 12 times in 40 under load).
    seam.fixed_span = 2e-3  # every run on events: 2 ms
    seam.busy_us = 150.0  # CUPTI: 150 µs of kernels per profiled run
    seam.machine.clocks = [(1980, 0)]
    result = time_cuda(counting(seam, 1e-6), TimingOptions(budget=0.2, timer="cupti"))
    assert result.timer == "cupti"
    assert result.repeat == 7  # one per profiled run
    per_loop = 150e-6 / result.loops
    assert result.median == pytest.approx(per_loop)
    assert result.kernel_time == pytest.approx(per_loop)
    assert result.event_timings
    assert result.events_time is not None
    assert result.events_time > result.median
    assert len(result.run_clocks_mhz) == 7
    assert result.floor is None
    text = result.text()
    assert "CUPTI kernel time of profiled runs" in text
    assert "events " in text
    assert "CUDA events, median of" in text
    assert "gaps" in text


def test_timer_cupti_events_row_names_the_clocks_when_the_passes_ran_at_two(
    seam: FakeSeam, monkeypatch: pytest.MonkeyPatch
) -> None:
    seam.fixed_span = 2e-3
    seam.busy_us = 1800.0
    seam.machine.clocks = [(1440, POWER_CAP)]  # the event runs

    def hotter(*args: Any, **kwargs: Any) -> cuda.KernelProfile:
        seam.machine.clocks = [(1290, POWER_CAP), (1305, POWER_CAP)]  # the profiled runs
        seam.machine.clock_reads = 0
        return seam.profile_kernels(*args, **kwargs)

    install(monkeypatch, profile_kernels=hotter)
    result = time_cuda(counting(seam, 1e-6), TimingOptions(budget=0.2, timer="cupti"))
    assert result.timer == "cupti"
    assert set(result.event_clocks_mhz) == {1440}
    assert len(result.event_clocks_mhz) == len(result.event_timings)
    assert result.clocks_mhz == (1290, 1305, 1305)
    (events,) = [row for row in result.rows() if row[0] == "events"]
    assert events[2].endswith(
        "CUPTI · ran at 1440 MHz, the profiled runs at 1290\u20131305 MHz: the ratio "
        "compares two clocks; the gaps row compares the same loops at one"
    )
    assert "the profiled runs at 1290" in result._repr_html_()
    assert result.to_dict()["event_clocks_mhz"] == result.event_clocks_mhz


def test_timer_cupti_events_row_is_quiet_when_both_passes_ran_at_one_clock(
    seam: FakeSeam,
) -> None:
    seam.fixed_span = 2e-3
    seam.busy_us = 1800.0
    seam.machine.clocks = [(1440, POWER_CAP), (1455, POWER_CAP)]
    result = time_cuda(counting(seam, 1e-6), TimingOptions(budget=0.2, timer="cupti"))
    assert checks.pass_clocks(result.event_clocks_mhz, result.run_clocks_mhz) is None
    assert "profiled runs at" not in result.text()
    assert checks.pass_clocks([None, None], [1290]) is None  # unknown: nothing said


def test_timer_cupti_falls_back_to_events_and_says_so(
    seam: FakeSeam, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> cuda.KernelProfile:
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    install(monkeypatch, profile_kernels=broken)
    result = time_cuda(counting(seam, 100e-6), TimingOptions(budget=0.1, timer="cupti"))
    assert result.timer == "events"
    assert result.kernel_time is None
    (warning,) = [w for w in result.warnings if w.startswith("--timer cupti")]
    assert "torch.profiler failed" in warning
    assert warning.endswith(": the headline is CUDA events")
    assert "CUDA events" in result.text()


def test_timer_cupti_whose_record_does_not_split_has_no_spread(seam: FakeSeam) -> None:
    seam.split_runs = False
    result = time_cuda(counting(seam, 100e-6), TimingOptions(budget=0.1, timer="cupti"))
    assert result.timer == "cupti"
    assert result.repeat == 1
    assert any("could not be split into the profiled runs" in w for w in result.warnings)


def test_kernels_show_the_gap_of_the_same_loops(seam: FakeSeam) -> None:
    seam.fixed_span = 2e-3
    seam.busy_us = 1800.0  # 90 % of the run's span
    result = time_cuda(counting(seam, 1e-6), TimingOptions(budget=0.2, kernels=True))
    assert result.gap_time is not None
    assert result.gap_time == pytest.approx(0.2e-3 / result.kernel_loops)
    assert result.cupti_ratio is None  # --validate's row only with --validate
    assert "gaps" in result.text()


# -- --cold's L2 check ----------------------------------------------------------------------
def test_cold_shows_the_l2_check(seam: FakeSeam) -> None:
    result = time_cuda(counting(seam, 200e-6, cold=600e-6), TimingOptions(budget=0.3, cold=True))
    assert result.flush_bytes == 128 << 20
    assert result.cold_warm_time is not None
    assert result.cold_warm_ratio is not None
    assert result.cold_warm_ratio > 2
    assert "L2 check" in result.text()
    assert not any("agree" in w for w in result.warnings)


def test_cold_warns_when_cold_and_warm_agree(seam: FakeSeam) -> None:
    seam.fixed_span = 1e-3  # every call takes as long, flushed or not
    result = time_cuda(counting(seam, 1e-6), TimingOptions(budget=0.2, cold=True))
    assert result.cold_warm_ratio == pytest.approx(1.0)
    assert any(
        w.startswith("--cold: cold and warm single calls do not differ within the noise (1.00")
        for w in result.warnings
    )


# -- the magic's options --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cell", "message"),
    [
        ("%cudatime --timer fast x = 1", "%cudatime: --timer takes events or cupti, not 'fast'"),
        ("%cudatime --timer=CUPTI x = 1", "--timer takes events or cupti, not 'CUPTI'"),
        ("%cudatime --clock-outliers maybe x = 1", "--clock-outliers takes keep or drop, not"),
        ("%cudatime --timer", "argument --timer: expected one argument"),
    ],
)
def test_bad_timer_and_clock_options_are_usage_errors(
    shell: InteractiveShell, cell: str, message: str
) -> None:
    from IPython.core.error import UsageError

    result = shell.run_cell(cell)
    assert isinstance(result.error_in_exec, UsageError), result.error_in_exec
    assert message in str(result.error_in_exec)


def test_timer_and_clock_options_on_the_host(shell: InteractiveShell) -> None:
    line = "%cudatime -q -v r --budget 0.05 --device cpu --timer cupti --clock-outliers drop x=1"
    assert shell.run_cell(line).success
    r = shell.user_ns["r"]
    assert "--timer cupti and --clock-outliers drop need CUDA: not used" in r.warnings
    assert r.timer == "events"


def test_help_describes_the_new_options_and_fields(shell: InteractiveShell) -> None:
    doc = shell.find_line_magic("cudatime").__doc__
    assert doc is not None
    for words in ("--timer TIMER", "--clock-outliers WHAT", "clocks_mhz", "throttle_reasons"):
        assert words in doc, words
    for words in ("at_default_clock", "this time holds at that clock", "L2 check", "gaps"):
        assert words in " ".join(doc.split()), words


# -- the seam's NVML reader -----------------------------------------------------------------
@pytest.fixture
def one_board(monkeypatch: pytest.MonkeyPatch) -> FakeMachine:
    machine = FakeMachine([board(0, "H100", total=80 << 30, uuid="GPU-aaaa")])
    machine.clocks = [(1440, POWER_CAP)]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(clocks, "_STATIC", {})
    return machine.install(monkeypatch)


def test_sm_clock_reads_nvml(one_board: FakeMachine) -> None:
    assert cuda.sm_clock(0) == cuda.SmClock(1440, POWER_CAP, 1980)
    assert cuda.sm_clock(1) is None  # no such device


def test_sm_clock_with_older_bindings_and_no_default_applications_clock(
    one_board: FakeMachine,
) -> None:
    del one_board.nvmlDeviceGetCurrentClocksEventReasons  # its name before NVML 12.2 only
    one_board.clocks, one_board.default_mhz = [(1980, 0)], None
    assert cuda.sm_clock(0) == cuda.SmClock(1980, 0, 1980)  # the maximum clock


def test_sm_clock_without_nvml_or_a_readable_clock(
    one_board: FakeMachine, monkeypatch: pytest.MonkeyPatch
) -> None:
    one_board.clocks = [(1440, None)]  # NVML refuses the reasons
    assert cuda.sm_clock(0) == cuda.SmClock(1440, None, 1980)  # the clock, no reasons
    one_board.clocks = []  # and the clock
    assert cuda.sm_clock(0) is None
    monkeypatch.setattr(discovery, "_nvml", lambda: None)
    assert cuda.sm_clock(0) is None
