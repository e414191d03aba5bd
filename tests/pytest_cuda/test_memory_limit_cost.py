"""What a memory limit costs a clean test, counted in calls through the seam (issue 42:
<= 50 µs a test, measured on a GPU by benchmarks/bench_memory_limit.py): planted runs on
two fake devices, each test's :mod:`gpumagic.cuda` calls counted from its setup to its
teardown, with the limit and without. A new call on the clean path fails here, where it
can be weighed, instead of showing up later as microseconds."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Callable

SEAM_CALLS = """
import json
from pathlib import Path

import pytest

from gpumagic import cuda

COUNTS, ORIGINALS = {}, {}
CURRENT = None


def _counted(name, function):
    def counted(*args, **kwargs):
        if CURRENT is not None:
            CURRENT[name] = CURRENT.get(name, 0) + 1
        return function(*args, **kwargs)

    return counted


def pytest_sessionstart(session):
    # After the planted conftest put the fake allocator in the seam.
    for name in cuda.__all__:
        function = getattr(cuda, name)
        if callable(function) and not isinstance(function, type):
            ORIGINALS[name] = function
            setattr(cuda, name, _counted(name, function))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    global CURRENT
    CURRENT = COUNTS[item.name] = {}
    try:
        return (yield)
    finally:
        CURRENT = None


def pytest_sessionfinish(session):
    for name, function in ORIGINALS.items():
        setattr(cuda, name, function)
    Path(session.config.rootpath, "seam_calls.json").write_text(json.dumps(COUNTS))
"""

CLEAN = """
def test_first(fake_cuda):
    x = fake_cuda.tensor(1 << 20)  # CUDA initialised here, a context on cuda:0
    del x


def test_clean(fake_cuda):
    x = fake_cuda.tensor(1 << 20)
    del x
"""


@pytest.fixture
def seam_calls(
    pytester: pytest.Pytester, planted: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., dict[str, int]]:
    """``seam_calls(*args)``: the seam calls ``test_clean`` made in a run with ``args``
    (two fake devices; the test allocates on cuda:0 only)."""
    planted(CLEAN)
    pytester.makepyfile(seam_calls=SEAM_CALLS)
    pytester.syspathinsert()
    monkeypatch.setenv("LEAK_FAKE_DEVICES", "2")

    def run(*args: str) -> dict[str, int]:
        result = pytester.runpytest("-p", "seam_calls", *args)
        result.assert_outcomes(passed=2)
        counts: dict[str, int] = json.loads((pytester.path / "seam_calls.json").read_text())[
            "test_clean"
        ]
        return counts

    return run


def _added(more: dict[str, int], base: dict[str, int]) -> dict[str, int]:
    names = set(more) | set(base)
    added = {n: more.get(n, 0) - base.get(n, 0) for n in names}
    return {n: count for n, count in sorted(added.items()) if count}


def test_a_clean_test_under_a_limit_reads_its_one_device_once(
    seam_calls: Callable[..., dict[str, int]],
) -> None:
    base = seam_calls()
    limited = seam_calls("--cuda-limit-memory=1GiB")
    # cuda:1 has no context: never reset nor read. cuda:0: one reset at the start of
    # the call (no allocator read: the events are recorded, the ring says the rest if
    # the peak goes over), one read at its end; the recording checked twice (on, and
    # whether it records); status (cached) read once, at setup.
    assert _added(limited, base) == {
        "allocation_marks": 1,
        "devices_with_context": 2,
        "is_initialized": 1,
        "memory_history_enabled": 1,
        "reset_peak_memory_stats": 1,
        "start_memory_history": 1,
        "status": 1,
    }


def test_the_limit_and_the_memory_report_share_one_reset(
    seam_calls: Callable[..., dict[str, int]],
) -> None:
    report = seam_calls("--cuda-memory-report=1")
    both = seam_calls("--cuda-memory-report=1", "--cuda-limit-memory=1GiB")
    # The report's reset at the start of the call serves the limit: the limit adds its
    # one read at the end of the call (the report reads after the teardown).
    assert _added(both, report) == {
        "allocation_marks": 1,
        "devices_with_context": 1,
        "is_initialized": 1,
        "memory_history_enabled": 1,
        "start_memory_history": 1,
        "status": 1,
    }
