"""Memory limits, out-of-memory reports and snapshots through real pytest runs, on the
fake allocator (see fake_cuda.py): the options, the marker, their messages, and the
peak's blocks replayed from the allocator's events."""

from __future__ import annotations

import json
import pickle
from typing import TYPE_CHECKING

import pytest

from gpumagic.stacks import Frame
from pytest_cuda.leaks.limit import OverLimit, blocks_at_peak, parse_limit

if TYPE_CHECKING:
    from collections.abc import Callable

MiB = 2**20

LIMITED = """
import pytest

KEEP = []


@pytest.mark.cuda_limit_memory("4MiB")
def test_over(fake_cuda):
    KEEP.append(fake_cuda.tensor(8 << 20))  # over: kept


@pytest.mark.cuda_limit_memory("16MiB")
def test_under(fake_cuda):
    x = fake_cuda.tensor(8 << 20)
    del x


@pytest.mark.cuda_limit_memory(size=3 << 20)
def test_temporary_peak(fake_cuda):
    steady = fake_cuda.tensor(1 << 20)
    temporary = fake_cuda.tensor(4 << 20)  # the temporary
    del temporary
    assert steady.size == 1 << 20


def test_no_limit(fake_cuda):
    KEEP.append(fake_cuda.tensor(64 << 20))
"""


def test_the_options_and_the_marker_are_documented(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(
        [
            "*--cuda-limit-memory=SIZE",
            "*fail every test whose peak CUDA memory on any of its",
            "*--cuda-oom={fail,skip}",
            "*--cuda-memory-snapshot=DIR*",
            "*cuda_limit_memory (string):*",
        ]
    )
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.cuda_limit_memory(size): fail the test when*"])


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--cuda-limit-memory=lots"], "*argument --cuda-limit-memory: not a memory size: 'lots'*"),
        (["--cuda-limit-memory=0"], "*argument --cuda-limit-memory: takes a size above 0 bytes*"),
        (["--cuda-oom=retry"], "*argument --cuda-oom: invalid choice: 'retry'*"),
    ],
)
def test_bad_values_are_usage_errors(
    pytester: pytest.Pytester, args: list[str], error: str
) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([error])


def test_a_bad_ini_limit_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ncuda_limit_memory = a lot\n")
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*cuda_limit_memory (ini): not a memory size: 'a lot'*"])


def test_the_marker_fails_the_peaks_over_it_with_the_line(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(LIMITED)
    result = pytester.runpytest("-rf")
    result.assert_outcomes(passed=2, failed=2)
    lines = LIMITED.strip().splitlines()
    over = next(i for i, t in enumerate(lines, 1) if "# over" in t)
    temporary = next(i for i, t in enumerate(lines, 1) if "# the temporary" in t)
    result.stdout.fnmatch_lines_random(
        [
            "CUDA memory limit: test_over peaked at "
            "8.0 MiB on cuda:0, over its limit of 4.0 MiB (cuda_limit_memory marker), "
            f"allocated at test_planted.py:{over} in test_over",
            "CUDA memory limit: "
            "test_temporary_peak peaked at 13.0 MiB on cuda:0, over its limit of 3.0 MiB "
            f"(cuda_limit_memory marker), allocated at test_planted.py:{temporary} in "
            "test_temporary_peak",
        ]
    )
    # The temporary is gone at the end, yet named at the peak, with the steady block
    # and test_over's 8 MiB, still kept.
    result.stdout.fnmatch_lines(
        [
            "Peak 13.0 MiB (13,631,488 B) on cuda:0; 8.0 MiB was allocated when the test started.",
            "Blocks alive at the peak, by allocating stack (largest first):",
            "  4.0 MiB in 1 block on cuda:0",
            f"    test_planted.py:{temporary} in test_temporary_peak",
            "  1.0 MiB in 1 block on cuda:0",
            f"    test_planted.py:{temporary - 1} in test_temporary_peak",
            "  8.0 MiB allocated before the test",
        ]
    )
    result.stdout.no_fnmatch_line("*lost the test's first ones*")


def test_the_option_and_the_ini_value_limit_every_test(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(LIMITED)
    result = pytester.runpytest("--cuda-limit-memory=32MiB", "-rf")
    # The markers win where they are; the rest are held to 32 MiB (test_over's 8 MiB
    # are still kept).
    result.assert_outcomes(passed=1, failed=3)
    result.stdout.fnmatch_lines(
        [
            "CUDA memory limit: test_no_limit peaked at 72.0 MiB on cuda:0, over its limit "
            "of 32.0 MiB (--cuda-limit-memory), *",
        ]
    )
    pytester.makeini("[pytest]\ncuda_limit_memory = 1GiB\ncuda_leak_holder_search = none\n")
    result = pytester.runpytest("-rf", "-k", "no_limit")
    result.assert_outcomes(passed=1)


def test_the_peak_counts_what_was_allocated_before_the_test(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(
        """
        import pytest

        @pytest.fixture(scope="module")
        def model(fake_cuda):
            return fake_cuda.tensor(6 << 20)

        @pytest.mark.cuda_limit_memory("8MiB")
        def test_small_on_a_large_model(fake_cuda, model):
            x = fake_cuda.tensor(3 << 20)
            del x
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*peaked at 9.0 MiB on cuda:0, over its limit of 8.0 MiB*",
            "Peak 9.0 MiB (9,437,184 B) on cuda:0; 6.0 MiB was allocated when the test started.",
            "  3.0 MiB in 1 block on cuda:0",
            "  6.0 MiB allocated before the test",
        ]
    )


def test_memory_held_from_before_is_not_a_test_that_allocated_nothing(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    """A module fixture holds 6 MiB, over a 4 MiB limit: a test that allocates nothing
    there is not judged (the ring says so: no read at its start), one that allocates is."""
    planted(
        """
        import pytest

        @pytest.fixture(scope="module")
        def model(fake_cuda):
            return fake_cuda.tensor(6 << 20)

        @pytest.mark.cuda_limit_memory("4MiB")
        def test_reads_only(fake_cuda, model):
            assert model.size == 6 << 20

        @pytest.mark.cuda_limit_memory("4MiB")
        def test_allocates(fake_cuda, model):
            x = fake_cuda.tensor(1 << 20)
            del x
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_allocates*peaked at 7.0 MiB on cuda:0, over its limit of 4.0 MiB*",
            "Peak 7.0 MiB (7,340,032 B) on cuda:0; 6.0 MiB was allocated when the test started.",
        ]
    )


def test_a_failing_test_keeps_its_failure_and_gets_the_limit_as_a_section(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(
        """
        import pytest

        @pytest.mark.cuda_limit_memory("1MiB")
        def test_fails(fake_cuda):
            x = fake_cuda.tensor(2 << 20)
            assert x.size == 0
        """
    )
    result = pytester.runpytest("-rf")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*- Captured CUDA memory limit call -*",
            "CUDA memory limit: test_fails peaked at 2.0 MiB on cuda:0, *",
            "FAILED test_planted.py::test_fails - assert 2097152 == 0*",
        ]
    )


def test_a_malformed_marker_fails_the_test_naming_it(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(
        """
        import pytest

        @pytest.mark.cuda_limit_memory("lots")
        def test_bad(fake_cuda):
            pass

        @pytest.mark.cuda_limit_memory()
        def test_empty(fake_cuda):
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines_random(
        [
            "*malformed @pytest.mark.cuda_limit_memory on test_planted.py::test_bad: size: "
            "not a memory size: 'lots'*",
            "*malformed @pytest.mark.cuda_limit_memory on test_planted.py::test_empty: takes "
            "one size (cuda_limit_memory('512MiB') or size=...), got none",
        ]
    )


# ---------------------------------------------------------------------------
# Out of memory.

OOM = """
import pytest

KEEP = []


class OutOfMemoryError(RuntimeError):  # torch.OutOfMemoryError's name
    pass


def test_oom(fake_cuda):
    big = fake_cuda.tensor(6 << 20)  # big
    raise OutOfMemoryError("CUDA out of memory. Tried to allocate 200.00 GiB.")


def test_after(fake_cuda):
    # The traceback's frames were cleared: the 6 MiB are back.
    assert fake_cuda.allocated_bytes()[0] == 0


def test_other_failure():
    raise RuntimeError("not about memory")
"""


def test_an_oom_reports_what_was_alive_and_its_holder_then_gives_the_memory_back(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(OOM)
    result = pytester.runpytest("-rf", "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=2)
    line = next(i for i, t in enumerate(OOM.strip().splitlines(), 1) if "# big" in t)
    result.stdout.fnmatch_lines(
        [
            "*- CUDA out of memory -*",
            "test_oom ran out of CUDA memory: CUDA out of memory. Tried to allocate 200.00 GiB.",
            "cuda:0: 6.0 MiB allocated by tensors, 6.0 MiB reserved by torch's caching "
            "allocator, 0 B of it reserved but free *",
            "cuda:0: other processes hold 1.0 GiB (pid 4242: 1.0 GiB)",
            "Largest blocks alive, by allocating stack (largest first):",
            "  6.0 MiB in 1 block on cuda:0",
            "Who holds them (largest first):",
            f"  6.0 MiB (1 tensor) on cuda:0: big (local variable of test_oom at "
            f"test_planted.py:{line + 1})",
        ]
    )
    assert "- CUDA out of memory -" not in result.stdout.str().split("test_other_failure")[-1]


def test_cuda_oom_skip_makes_it_a_skip(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(OOM)
    result = pytester.runpytest("--cuda-oom=skip", "-rs", "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1, skipped=1)
    result.stdout.fnmatch_lines(
        [
            "SKIPPED [[]1] test_planted.py:*: test_oom ran out of CUDA memory: CUDA out of "
            "memory. Tried to allocate 200.00 GiB. (--cuda-oom=skip)",
        ]
    )


# ---------------------------------------------------------------------------
# Snapshots.


def test_snapshots_of_the_tests_that_leaked_went_over_or_ran_out(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted(
        LIMITED
        + """

class OutOfMemoryError(RuntimeError):
    pass


def test_oom(fake_cuda):
    big = fake_cuda.tensor(2 << 20)
    raise OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")


@pytest.mark.cuda_leak_check
def test_leaks(fake_cuda):
    KEEP.append(fake_cuda.tensor(1 << 20))
"""
    )
    result = pytester.runpytest("--cuda-memory-snapshot=snaps", "-p", "no:randomly")
    outcomes = result.parseoutcomes()
    assert (outcomes["passed"], outcomes["failed"], outcomes["leaked"]) == (3, 3, 1), outcomes
    folder = pytester.path / "snaps"
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted(
        f"test_planted.py_{t}.{s}"
        for t in ("test_leaks", "test_oom", "test_over", "test_temporary_peak")
        for s in ("json", "pickle")
    )
    leak = json.loads((folder / "test_planted.py_test_leaks.json").read_text())
    assert (leak["test"], leak["reason"]) == ("test_planted.py::test_leaks", "leaked")
    held = {b["holder"] for b in leak["blocks"]}
    assert "test_planted.KEEP[2] (module global)" in held, held
    with (folder / "test_planted.py_test_oom.pickle").open("rb") as file:
        snapshot = pickle.load(file)
    frames = [
        b["frames"][0]
        for s in snapshot["segments"]
        for b in s["blocks"]
        if b["state"] == "active_allocated" and b["frames"]
    ]
    assert any(
        f["filename"] == "held by" and f["name"].startswith("big (local variable of test_oom at ")
        for f in frames
    ), frames
    result.stdout.fnmatch_lines(["*Memory snapshot (memory_viz): *snaps*test_over.pickle"])


def test_a_snapshot_folder_that_cannot_be_made_is_a_usage_error(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile("def test_x(): pass", blocker="")
    result = pytester.runpytest("--cuda-memory-snapshot=blocker.py/snaps")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--cuda-memory-snapshot=blocker.py/snaps: *"])


# ---------------------------------------------------------------------------
# The core, plainly.


def test_parse_limit_takes_one_size() -> None:
    assert parse_limit(("512MiB",), {}) == 512 * MiB
    assert parse_limit((), {"size": 4096}) == 4096
    for args, kwargs in [((), {}), (("1GiB", "2GiB"), {}), ((), {"limit": "1GiB"}), ((True,), {})]:
        with pytest.raises(ValueError, match="size"):
            parse_limit(args, kwargs)


def _alloc(address: int, size: int, t: int, line: int = 0) -> dict[str, object]:
    frames = [{"filename": "test_x.py", "line": line, "name": "test_x"}] if line else []
    return {"action": "alloc", "addr": address, "size": size, "time_us": t, "frames": frames}


def _free(address: int, size: int, t: int) -> dict[str, object]:
    return {"action": "free_requested", "addr": address, "size": size, "time_us": t}


def test_blocks_at_peak_replays_to_the_highest_point() -> None:
    alive = {"address": 1, "size": 100, "requested_size": 100, "state": "active_allocated"}
    alive["frames"] = [{"filename": "conftest.py", "line": 3, "name": "model"}]
    kept = {"address": 3, "size": 10, "requested_size": 10, "state": "active_allocated"}
    kept["frames"] = [{"filename": "test_x.py", "line": 9, "name": "test_x"}]
    snapshot = {
        "segments": [{"device": 0, "blocks": [alive, kept]}],
        "device_traces": [
            [
                _alloc(1, 100, 5),  # before the test
                _alloc(7, 50, 10),  # before, freed during the test
                _free(7, 50, 20),
                _alloc(2, 400, 30, line=7),  # the temporary
                _free(2, 400, 40),
                _alloc(3, 10, 50),  # its stack: from the live block
            ]
        ],
    }
    found = blocks_at_peak(snapshot, 0, start_us=15)
    assert found.complete
    assert found.before == 100
    # What a start's allocator read would have said: 100 and 50 alive, and allocations.
    assert (found.at_start, found.allocated) == (150, True)
    assert [(b.address, b.size, b.frames) for b in found.blocks] == [
        (2, 400, (Frame("test_x.py", 7, "test_x"),))
    ]
    # The ring lost the events before the start: said so.
    snapshot["device_traces"][0] = snapshot["device_traces"][0][3:]
    late = blocks_at_peak(snapshot, 0, start_us=15, ring_size=3)
    assert not late.complete
    assert [b.address for b in late.blocks] == [2]


def test_the_ring_tells_a_test_that_allocated_nothing() -> None:
    alive = {"address": 1, "size": 100, "requested_size": 100, "state": "active_allocated"}
    snapshot = {
        "segments": [{"device": 0, "blocks": [alive]}],
        "device_traces": [[_alloc(1, 100, 5), _alloc(7, 50, 10), _free(7, 50, 20)]],
    }
    found = blocks_at_peak(snapshot, 0, start_us=15)
    assert (found.complete, found.allocated, found.at_start) == (True, False, 150)


def test_a_start_not_known_is_said() -> None:
    over = OverLimit(0, 5 * MiB, 4 * MiB, "--cuda-limit-memory", start=None)
    assert over.details().splitlines()[0] == (
        "Peak 5.0 MiB (5,242,880 B) on cuda:0; what was allocated when the test started is "
        "not known."
    )


def test_over_limit_renders_the_peak_and_what_was_before() -> None:
    over = OverLimit(0, 5 * MiB, 4 * MiB, "--cuda-limit-memory", start=MiB, stacks=(), before=MiB)
    assert over.summary("test_x") == (
        "CUDA memory limit: test_x peaked at 5.0 MiB on cuda:0, over its limit of 4.0 MiB "
        "(--cuda-limit-memory)"
    )
    assert over.details().splitlines() == [
        "Peak 5.0 MiB (5,242,880 B) on cuda:0; 1.0 MiB was allocated when the test started.",
        "Blocks alive at the peak, by allocating stack (largest first):",
        "  1.0 MiB allocated before the test",
    ]


def test_out_of_memory_is_told_by_class_and_message_along_the_chain() -> None:
    from gpumagic.cuda_errors import out_of_memory

    class OutOfMemoryError(RuntimeError):
        pass

    oom = OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
    assert out_of_memory(oom) is oom
    cublas = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`")
    assert out_of_memory(cublas) is cublas
    wrapped = ValueError("wrapped")
    wrapped.__cause__ = oom
    assert out_of_memory(wrapped) is oom
    assert out_of_memory(AssertionError("the log says: CUDA out of memory")) is None
    assert out_of_memory(RuntimeError("CUDA error: an illegal memory access")) is None


def test_the_header_says_the_limit(
    pytester: pytest.Pytester, planted: Callable[[str], None]
) -> None:
    planted("def test_x(fake_cuda):\n    pass\n")
    result = pytester.runpytest("--cuda-limit-memory=8GiB")
    result.stdout.fnmatch_lines(
        ["cuda memory limit: 8.0 GiB per device a test (--cuda-limit-memory); *"]
    )


def test_a_ranks_watch_records_and_says_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from fake_cuda import FakeAllocator
    from pytest_cuda.leaks.limit_watch import LimitWatch

    fake = FakeAllocator(2, initialized=True).install(monkeypatch)
    watch = LimitWatch.recorded(MiB, "cuda_limit_memory marker", devices=(1,))
    assert fake.recording  # its own, with the events' stacks and frees
    assert fake.history_settings["skip_actions"] == ("free_completed",)
    watch.begin()
    kept = fake.tensor(4 * MiB, device=0)  # another rank's device: not judged
    assert watch.failure("test_x on rank 1") is None
    temporary = fake.tensor(2 * MiB, device=1)
    del temporary
    failure = watch.failure("test_x on rank 1")
    assert failure is not None
    assert failure[0].startswith(
        "CUDA memory limit: test_x on rank 1 peaked at 2.0 MiB on cuda:1, over its limit of "
        "1.0 MiB (cuda_limit_memory marker), allocated at "
    )
    assert "  2.0 MiB in 1 block on cuda:1" in failure[1]
    watch.close()
    assert not fake.recording
    del kept
