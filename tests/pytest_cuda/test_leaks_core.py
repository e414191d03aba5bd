"""The leak arithmetic (:mod:`pytest_cuda.leaks.settle`, :mod:`pytest_cuda.leaks.result`)
and ``no_cuda_leak`` (:mod:`pytest_cuda.leaks.block`), against a small fake allocator."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import sysconfig
import types
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from fake_cuda import FakeAllocator
from gpumagic import cuda, stacks
from gpumagic.stacks import (
    Block,
    Frame,
    FrameFilter,
    StackGroup,
    blocks_allocated_since,
    blocks_from_segments,
    group_by_stack,
)
from pytest_cuda.leaks import result as leaks
from pytest_cuda.leaks.block import CudaLeakError, CudaLeakWarning, no_cuda_leak
from pytest_cuda.leaks.result import LeakResult, Release, parse_leak_settings
from pytest_cuda.leaks.settle import CudaMemory, SettleStep, growth, settle

if TYPE_CHECKING:
    from collections.abc import Sequence

MIB = 1024**2


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
    """A fake allocator in the seam; the real functions are put back afterwards."""
    return FakeAllocator().install(monkeypatch)


class Scripted:
    """A source whose readings follow a script, one per read; steps are logged."""

    def __init__(self, readings: list[dict[int, int]], steps: Sequence[str] = ()) -> None:
        self.readings = readings
        self.ran: list[tuple[str, tuple[int, ...]]] = []
        self.step_names = steps

    def read(self) -> dict[int, int]:
        return self.readings.pop(0)

    def settle_steps(self) -> Sequence[SettleStep]:
        def make(name: str) -> SettleStep:
            def run(devices: tuple[int, ...]) -> bool:
                self.ran.append((name, devices))
                return not name.startswith("noop")

            return SettleStep(name, run)

        return [make(name) for name in self.step_names]


# ---------------------------------------------------------------------------
# Arithmetic.


def test_growth_is_after_minus_before_minus_held_per_device() -> None:
    assert growth({0: 100, 1: 50}, {0: 612, 1: 50, 2: 512}, {0: 12}) == {0: 500, 1: 0, 2: 512}


def test_a_reading_at_the_baseline_is_clean_without_settling() -> None:
    source = Scripted([{0: 1024}], steps=["gc"])
    result = settle({0: 1024}, source, 0)
    assert result.clean
    assert result.released == ()
    assert source.ran == []


def test_settling_stops_at_the_first_step_that_brings_every_device_back() -> None:
    source = Scripted(
        [{0: 40 * MIB, 1: 512}, {0: 40 * MIB, 1: 0}, {0: 0, 1: 0}],
        steps=["gc", "workspaces", "never"],
    )
    result = settle({0: 0, 1: 0}, source, 0)
    assert result.clean
    assert source.ran == [("gc", (0, 1)), ("workspaces", (0,))]
    assert result.released == (
        Release("gc", {0: 0, 1: 512}),
        Release("workspaces", {0: 40 * MIB, 1: 0}),
    )
    assert result.kept_by_libraries() == [
        ("gc", {0: 0, 1: 512}),
        ("workspaces", {0: 40 * MIB, 1: 0}),
    ]


def test_a_step_that_does_nothing_costs_no_reading() -> None:
    source = Scripted([{0: 512}, {0: 0}], steps=["noop fft", "gc"])
    result = settle({0: 0}, source, 0)
    assert result.clean
    assert [r.step for r in result.released] == ["gc"]


def test_what_remains_after_every_step_is_the_leak() -> None:
    source = Scripted([{0: 8 * MIB + 512}, {0: 8 * MIB}, {0: 8 * MIB}], steps=["gc", "look"])
    result = settle({0: 0}, source, 0)
    assert result.leaked == {0: 8 * MIB}
    assert not result.clean


def test_tolerance_is_per_device_and_inclusive() -> None:
    result = settle({0: 0, 1: 0}, Scripted([{0: 4096, 1: 4097}]), 4096)
    assert result.leaked == {1: 4097}
    assert result.growth == {0: 4096, 1: 4097}


def test_memory_known_to_be_held_by_others_is_not_a_leak() -> None:
    result = settle({0: 0}, Scripted([{0: MIB}]), 0, held={0: MIB})
    assert result.clean


def test_a_device_first_used_during_the_check_counts_from_zero() -> None:
    result = settle({}, Scripted([{0: 512, 1: 0}]), 0)
    assert result.leaked == {0: 512}


@pytest.mark.parametrize(
    ("tolerance", "expected"),
    [(0, 0), (4096, 4096), ("4KiB", 4096), ("1 MiB", MIB), (1.5, 1)],
)
def test_tolerance_takes_bytes_or_sizes(tolerance: int | str, expected: int) -> None:
    assert parse_leak_settings(tolerance, "warn") == (expected, "warn")


@pytest.mark.parametrize(
    ("tolerance", "mode", "message"),
    [
        (-1, "fail", "tolerance must be a size in bytes >= 0"),
        ("lots", "fail", "tolerance must be a size in bytes >= 0"),
        (True, "fail", "got True"),
        (None, "fail", "got None"),
        (0, "strict", "mode must be one of 'fail', 'warn', 'off', got 'strict'"),
    ],
)
def test_malformed_settings_say_what_is_wrong(
    tolerance: object, mode: object, message: str
) -> None:
    with pytest.raises(ValueError, match=r"^cuda_leak_check: ") as info:
        parse_leak_settings(tolerance, mode)
    assert message in str(info.value)


# ---------------------------------------------------------------------------
# Stacks.

USER = "/home/me/project/tests/test_model.py"
HELPER = "/home/me/project/src/model/helpers.py"
TORCH = "/venv/lib/python3.12/site-packages/torch/nn/modules/module.py"


def frames(*entries: tuple[str, int, str]) -> list[dict[str, object]]:
    return [{"filename": f, "line": n, "name": name} for f, n, name in entries]


def segment(device: int, *blocks: dict[str, object]) -> dict[str, object]:
    return {"device": device, "blocks": list(blocks)}


def test_snapshot_blocks_are_the_allocated_ones_with_their_stacks() -> None:
    segments = [
        segment(
            1,
            {
                "address": 4096,
                "size": 512,
                "requested_size": 4,
                "state": "active_allocated",
                "frames": frames((USER, 9, "test_it")),
            },
            {"address": 4608, "size": 1024, "state": "inactive"},
            {"address": 5632, "size": 512, "state": "active_pending_free", "frames": []},
        )
    ]
    assert blocks_from_segments(segments) == [Block(1, 4096, 512, 4, (Frame(USER, 9, "test_it"),))]


def alive(address: int, *where: tuple[str, int, str]) -> dict[str, object]:
    return {
        "address": address,
        "size": 512,
        "requested_size": 512,
        "state": "active_allocated",
        "frames": frames(*where),
    }


def event(action: str, address: int, time_us: int) -> dict[str, object]:
    return {"action": action, "addr": address, "size": 512, "time_us": time_us}


def test_the_event_ring_says_which_live_blocks_are_new() -> None:
    snapshot = {
        "segments": [
            segment(
                0,
                alive(100, (USER, 1, "setup")),
                alive(200, (USER, 7, "test_it")),
                alive(300, (HELPER, 3, "make"), (USER, 8, "test_it")),
            )
        ],
        "device_traces": [
            [
                event("alloc", 100, 900),
                event("alloc", 200, 950),
                event("free_completed", 200, 990),
                event("alloc", 200, 1100),  # the address was reused during the check
            ]
        ],
    }
    found = blocks_allocated_since(snapshot, 1000)
    assert [b.address for b in found] == [200]
    # 300 has no event although the ring covers the check: it is older than the ring.
    assert [b.address for b in blocks_allocated_since(snapshot, 1000, (USER, "test_it"))] == [200]


def test_without_a_complete_ring_the_stack_decides() -> None:
    snapshot = {
        "segments": [
            segment(
                0,
                alive(100, (USER, 1, "setup")),
                alive(300, (HELPER, 3, "make"), (USER, 8, "test_it")),
            )
        ],
        "device_traces": [[event("alloc", 500, 2000)]],  # wrapped after the start
    }
    assert [b.address for b in blocks_allocated_since(snapshot, 1000, (USER, "test_it"))] == [300]
    assert blocks_allocated_since(snapshot, 1000) == []
    no_ring = {"segments": snapshot["segments"], "device_traces": [[]]}
    assert [b.address for b in blocks_allocated_since(no_ring, 1000, (USER, "test_it"))] == [300]


def test_stacks_group_by_user_frames_largest_first() -> None:
    is_user = FrameFilter(["/venv/lib/python3.12/site-packages/torch"]).is_user
    via_torch = (Frame(TORCH, 1166, "forward"), Frame(HELPER, 5, "make"), Frame(USER, 20, "test_a"))
    direct = (Frame(HELPER, 5, "make"), Frame(USER, 20, "test_a"))
    blocks = [
        Block(0, 1, 512, 4, via_torch),
        Block(0, 2, 512, 100, direct),
        Block(0, 3, 8 * MIB, 8 * MIB, (Frame(USER, 31, "test_b"),)),
        Block(
            1,
            4,
            1024,
            1000,
            (
                Frame(TORCH, 1, "_lazy"),
                Frame(TORCH, 2, "inner"),
                Frame(TORCH, 3, "a"),
                Frame(TORCH, 4, "b"),
            ),
        ),
    ]
    groups = group_by_stack(blocks, is_user)
    assert groups == (
        StackGroup((Frame(USER, 31, "test_b"),), 8 * MIB, 8 * MIB, 1, (0,)),
        StackGroup(direct, 1024, 104, 2, (0,)),
        StackGroup(
            (Frame(TORCH, 1, "_lazy"), Frame(TORCH, 2, "inner"), Frame(TORCH, 3, "a")),
            1024,
            1000,
            1,
            (1,),
        ),
    )
    assert groups[1].describe() == "1.0 KiB in 2 blocks on cuda:0 (104 B requested)"
    assert groups[0].describe() == "8.0 MiB in 1 block on cuda:0"


def test_frame_filter_tells_user_code_from_libraries() -> None:
    paths = sysconfig.get_paths()
    stdlib = paths["stdlib"]
    is_user = FrameFilter(["/opt/torch"], [stdlib]).is_user
    assert is_user(USER)
    assert is_user("<string>")
    assert not is_user("/opt/torch/cuda/__init__.py")
    assert not is_user(os.path.join(stdlib, "contextlib.py"))
    assert is_user(os.path.join(stdlib, "site-packages", "mylib", "ops.py"))
    assert not is_user("<frozen importlib._bootstrap>")
    assert not is_user("/pytorch/c10/cuda/CUDACachingAllocator.cpp")
    assert not is_user("??")
    assert FrameFilter.default().is_user(__file__)
    assert not FrameFilter.default().is_user(pytest.__file__)
    assert not FrameFilter.default().is_user(leaks.__file__)


def test_one_rule_says_what_code_is_a_library_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames (by file) and the leak walk's roots (by module name) are judged by the
    same rule: an installed package is the user's to look at in a stack, and its
    globals are a library's cache, kept by design."""
    import _pytest.fixtures

    stdlib = sysconfig.get_paths()["stdlib"]
    code = FrameFilter(["/opt/torch"], [stdlib])
    installed = "/venv/lib/python3.12/site-packages/modelzoo/layers.py"
    for name, path in (("mymodel", USER), ("modelzoo", installed), ("no_file_here", None)):
        made = types.ModuleType(name)
        if path is not None:
            made.__file__ = path
        monkeypatch.setitem(sys.modules, name, made)
    # (file or None, module name): kind; then is_user(file), is_library_module(name).
    answers = {
        "a user's module": (USER, "mymodel", stacks.USER, True, False),
        "a site-packages package": (installed, "modelzoo.layers", stacks.INSTALLED, True, True),
        "the standard library": (
            os.path.join(stdlib, "contextlib.py"),
            "contextlib",
            stacks.LIBRARY,
            False,
            True,
        ),
        "torch": ("/opt/torch/nn/modules/module.py", "torch.nn", stacks.LIBRARY, False, True),
        "a module with no __file__": (None, "no_file_here", stacks.USER, None, False),
        "a built-in module (no __file__)": (None, "sys", stacks.LIBRARY, None, True),
    }
    for what, (path, name, kind, user, library) in answers.items():
        assert code.kind_of_module(name) == kind, what
        assert code.is_library_module(name) is library, what
        if path is not None:
            assert code.kind_of_file(path) == kind, what
            assert code.is_user(path) is user, what
    # _pytest: by its name, and by its file where it is imported.
    assert code.kind_of_module("_pytest.fixtures") == stacks.LIBRARY
    assert FrameFilter.default().kind_of_file(_pytest.fixtures.__file__) == stacks.LIBRARY
    assert not FrameFilter.default().is_user(_pytest.fixtures.__file__)


def test_frames_are_shown_relative_to_the_root() -> None:
    frame = Frame("/home/me/project/tests/test_model.py", 12, "test_x")
    assert frame.describe("/home/me/project") == "tests/test_model.py:12 in test_x"
    assert frame.describe("/elsewhere") == "/home/me/project/tests/test_model.py:12 in test_x"
    assert frame.describe() == "/home/me/project/tests/test_model.py:12 in test_x"


# ---------------------------------------------------------------------------
# Text.


def test_the_one_line_summary_names_amounts_tolerance_and_the_top_line() -> None:
    stacks = (StackGroup((Frame("/p/test_m.py", 14, "test_leak"),), 8 * MIB, 8 * MIB, 1, (0,)),)
    result = LeakResult({0: 8 * MIB, 1: 512}, {0: 8 * MIB, 1: 512}, 0, stacks=stacks)
    assert result.summary("test_leak", "/p") == (
        "CUDA memory leak: test_leak left 8.0 MiB on cuda:0, 512 B on cuda:1 allocated "
        "(tolerance 0 B), allocated at test_m.py:14 in test_leak"
    )
    no_stacks = LeakResult({0: 512}, {0: 512}, 100)
    assert no_stacks.summary("the block") == (
        "CUDA memory leak: the block left 512 B on cuda:0 allocated (tolerance 100 B)"
    )


def test_details_say_how_it_was_measured_and_list_the_stacks() -> None:
    many = tuple(
        StackGroup((Frame(f"/p/test_{i}.py", i, "f"),), 512 * (20 - i), 512, 1, (0,))
        for i in range(10)
    )
    result = LeakResult(
        {0: 8 * MIB},
        {0: 8 * MIB},
        0,
        released=(Release("garbage collection", {0: 0}), Release("cuBLAS", {0: 0})),
        stacks=(StackGroup((), 512, 4, 1, (0,)), *many),
    )
    text = result.details("test_x", "/p")
    assert text.splitlines()[:5] == [
        "test_x left 8.0 MiB (8,388,608 B) allocated on cuda:0; tolerance 0 B.",
        "Measured in this process's caching allocator after: garbage collection, cuBLAS.",
        "Blocks still alive, by allocating stack (largest first):",
        "  512 B in 1 block on cuda:0 (4 B requested)",
        "    (no stack: allocated while recording was off)",
    ]
    assert "    test_0.py:0 in f" in text
    assert text.splitlines()[-1] == "  ... and 3 more stacks holding 18.0 KiB"


def test_details_without_stacks_carry_the_hint() -> None:
    result = LeakResult({0: 512}, {0: 512}, 0, stack_note="run with --cuda-leak-trace")
    assert result.details("t").splitlines() == [
        "t left 512 B (512 B) allocated on cuda:0; tolerance 0 B.",
        "Measured in this process's caching allocator after: no settling needed.",
        "run with --cuda-leak-trace",
    ]


# ---------------------------------------------------------------------------
# The real source, on the fake allocator.


def test_nothing_is_read_before_cuda_is_initialised(fake: FakeAllocator) -> None:
    assert CudaMemory().read() == {}
    fake.init()
    assert CudaMemory().read() == {0: 0}


def test_what_libraries_keep_is_released_before_judging(fake: FakeAllocator) -> None:
    fake.init()
    before = CudaMemory().read()
    fake.matmul()
    fake.fft()
    fake.free_on_another_stream(fake.tensor(1000))
    cycle: list[object] = [fake.tensor(100)]
    cycle.append(cycle)
    del cycle
    result = settle(before, CudaMemory(), 0)
    assert result.clean, result
    assert dict(result.kept_by_libraries()) == {
        "young garbage (gc generation 1)": {0: 512},
        "cuBLAS/cuBLASLt workspaces": {0: 32 * MIB},
        "cuFFT plan caches": {0: 2 * MIB},
        "blocks freed on other streams (synchronize, empty_cache)": {0: 1024},
    }
    assert "reset_compile_caches" not in fake.calls


def test_compiled_code_is_thrown_away_only_when_asked(fake: FakeAllocator) -> None:
    fake.init()
    before = CudaMemory().read()
    fake.compile()  # the stand-in's compiled graph holds 4 KiB
    assert settle(before, CudaMemory(), 0).leaked == {0: 4096}
    assert "reset_compile_caches" not in fake.calls
    result = settle(before, CudaMemory(reset_caches=True), 0)
    assert result.clean, result
    assert dict(result.kept_by_libraries()) == {
        "torch.compile caches (torch._dynamo.reset, --cuda-leak-reset-caches)": {0: 4096},
    }


def test_a_kept_tensor_survives_every_step(fake: FakeAllocator) -> None:
    fake.init()
    before = CudaMemory().read()
    kept = fake.tensor(4)
    result = settle(before, CudaMemory(), 0)
    assert result.leaked == {0: 512}
    # Every step ran, none of them sleeps or throws compiled code away.
    assert [r.step for r in result.released] == [
        "young garbage (gc generation 1)",
        "cuBLAS/cuBLASLt workspaces",
        "garbage collection",
        "blocks freed on other streams (synchronize, empty_cache)",
    ]
    del kept


# ---------------------------------------------------------------------------
# no_cuda_leak.

LEAKED: list[object] = []


@pytest.fixture(autouse=True)
def _forget_leaks() -> None:
    LEAKED.clear()


def test_a_clean_block_passes_and_keeps_its_result(fake: FakeAllocator) -> None:
    fake.init()
    with no_cuda_leak() as check:
        x = fake.tensor(MIB)
        del x
    assert check.result is not None
    assert check.result.clean


def test_a_leaking_block_fails_with_the_allocating_line(fake: FakeAllocator) -> None:
    fake.init()
    with pytest.raises(CudaLeakError) as info, no_cuda_leak():
        LEAKED.append(fake.tensor(4))  # the allocating line
    message = str(info.value)
    first = message.splitlines()[0]
    assert first.startswith("CUDA memory leak: the block at ")
    assert "left 512 B on cuda:0 allocated (tolerance 0 B)" in first
    source = Path(__file__).read_text().splitlines()
    line = next(i for i, text in enumerate(source, 1) if "# the allocating line" in text)
    assert (
        f"test_leaks_core.py:{line} in test_a_leaking_block_fails_with_the_allocating_line, "
        "held by " in first
    )
    assert "512 B in 1 block on cuda:0 (4 B requested)" in message
    assert not fake.recording  # put back off
    assert "start_memory_history(50000, events=True)" in fake.calls


def test_a_workspace_from_before_the_block_cannot_hide_a_leak(fake: FakeAllocator) -> None:
    # Seen on an H200: a cuBLAS workspace left by earlier work was released while
    # settling, and the 32 MiB it gave back masked the block's 512 B leak.
    fake.init()
    fake.matmul()
    fake.fft()
    with pytest.raises(CudaLeakError, match="left 512 B on cuda:0"), no_cuda_leak():
        LEAKED.append(fake.tensor(4))


def test_recording_the_user_started_is_left_on(fake: FakeAllocator) -> None:
    fake.init()
    fake.user_recording = True
    with pytest.raises(CudaLeakError), no_cuda_leak():
        LEAKED.append(fake.tensor(4))
    assert fake.user_recording
    assert "stop_memory_history" not in fake.calls


def test_stacks_are_recorded_when_the_block_initialises_cuda(fake: FakeAllocator) -> None:
    with (
        pytest.raises(CudaLeakError, match=r"allocated at .*test_leaks_core.py:\d+"),
        no_cuda_leak(),
    ):
        LEAKED.append(fake.tensor(4096))
    assert not fake.recording


def test_without_trace_the_report_says_how_to_get_stacks(fake: FakeAllocator) -> None:
    fake.init()
    with (
        pytest.raises(CudaLeakError, match="no_cuda_leak\\(trace=True\\) names the lines"),
        no_cuda_leak(trace=False),
    ):
        LEAKED.append(fake.tensor(4096))
    assert not any(call.startswith("start_memory_history") for call in fake.calls)


def test_warn_mode_warns_with_the_report(fake: FakeAllocator) -> None:
    fake.init()
    with pytest.warns(CudaLeakWarning, match="left 8.0 MiB on cuda:0"), no_cuda_leak(mode="warn"):
        LEAKED.append(fake.tensor(8 * MIB))


def test_tolerance_allows_small_growth(fake: FakeAllocator) -> None:
    fake.init()
    with no_cuda_leak(tolerance="1KiB"):
        LEAKED.append(fake.tensor(1000))
    with pytest.raises(CudaLeakError, match=r"2\.0 KiB on cuda:0"), no_cuda_leak(tolerance=1024):
        LEAKED.append(fake.tensor(2000))


def test_a_block_that_raises_is_not_checked_and_says_so(fake: FakeAllocator) -> None:
    fake.init()

    def leak_then_fail() -> None:
        with no_cuda_leak():
            LEAKED.append(fake.tensor(4096))
            1 / 0  # noqa: B018

    with pytest.raises(ZeroDivisionError) as info:
        leak_then_fail()
    assert info.value.__notes__[0].startswith("no_cuda_leak: the block at ")
    assert info.value.__notes__[0].endswith("raised, so it was not checked")
    assert not fake.recording


def test_mode_off_checks_nothing(fake: FakeAllocator) -> None:
    fake.init()
    with no_cuda_leak(mode="off") as check:
        LEAKED.append(fake.tensor(4096))
    assert check.result is None


def test_bad_arguments_are_refused_at_once() -> None:
    with pytest.raises(ValueError, match="no_cuda_leak: tolerance must be"):
        no_cuda_leak(-5)
    with pytest.raises(ValueError, match="no_cuda_leak: mode must be one of"):
        no_cuda_leak(mode="error")  # type: ignore[arg-type]


def test_without_cuda_the_block_is_not_measured() -> None:
    if cuda.is_initialized():
        pytest.skip("CUDA is initialised in this process")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with no_cuda_leak() as check:
            pass
    assert check.result is not None
    assert check.result.clean
    assert not cuda.is_initialized()


def test_the_package_exports_it_lazily_without_torch() -> None:
    import pytest_cuda

    assert pytest_cuda.no_cuda_leak is no_cuda_leak
    assert pytest_cuda.CudaLeakError is CudaLeakError
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        pytest_cuda.nothing  # noqa: B018
    code = (
        "import sys, pytest_cuda; pytest_cuda.no_cuda_leak; "
        "print(sorted(m for m in ('torch', 'pynvml', 'IPython') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_collected_garbage_is_not_a_leak(fake: FakeAllocator) -> None:
    fake.init()
    gc.collect()
    with no_cuda_leak() as check:
        cycle: list[object] = [fake.tensor(MIB)]
        cycle.append(cycle)
        del cycle
    assert check.result is not None
    assert check.result.clean
    assert check.result.kept_by_libraries()[0][0] == "young garbage (gc generation 1)"
