"""The test's heap boundary (:class:`pytest_cuda.leaks.heap.TestHeap`): drawn on top of
what the interpreter froze by itself, never on top of someone else's freeze.

This suite's conftest freezes the heap for the session; each test here puts that back.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from pytest_cuda.leaks import heap as leak_heap
from pytest_cuda.leaks.heap import TestHeap, interpreter_frozen

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.fixture
def refrozen() -> Iterator[None]:
    """The conftest's session freeze, put back after a test that unfroze it."""
    yield
    gc.freeze()


def test_the_interpreters_own_freeze_is_read_from_a_bare_interpreter() -> None:
    bare = subprocess.run(
        [sys.executable, "-I", "-S", "-c", "import gc; print(gc.get_freeze_count())"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert interpreter_frozen() == int(bare.stdout)
    if sys.version_info[:2] == (3, 12):
        assert interpreter_frozen() > 0  # CPython 3.12's immortal start-up tuples


def test_an_interpreter_that_cannot_be_run_counts_nothing_as_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    interpreter_frozen.cache_clear()
    try:
        assert interpreter_frozen() == 0
    finally:
        interpreter_frozen.cache_clear()


def test_the_boundary_is_drawn_on_top_of_the_interpreters_freeze(
    monkeypatch: pytest.MonkeyPatch, refrozen: None
) -> None:
    # What is frozen now stands for the interpreter's start-up objects.
    frozen = gc.get_freeze_count()
    assert frozen > 0
    monkeypatch.setattr(leak_heap, "interpreter_frozen", lambda: frozen)
    older = object.__new__(type("Older", (), {}))
    heap = TestHeap()
    heap.begin()
    young = [type("Young", (), {})()]
    try:
        assert heap.frozen
        assert heap.frozen_before == frozen
        assert gc.get_freeze_count() > frozen
        objects = heap.young_objects()
        assert objects is not None
        assert any(o is young[0] for o in objects)
        assert not any(o is older for o in objects)
    finally:
        heap.thaw()
    assert not heap.frozen
    assert gc.get_freeze_count() == 0  # everything back in the collector's generations


def test_someone_elses_freeze_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    frozen = gc.get_freeze_count()
    monkeypatch.setattr(leak_heap, "interpreter_frozen", lambda: frozen - 1)
    heap = TestHeap()
    heap.begin()
    assert not heap.frozen
    assert heap.young_objects() is None
    heap.thaw()
    assert gc.get_freeze_count() == frozen
