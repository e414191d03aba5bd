"""The CUDA memory limit's pytest side: ``--cuda-limit-memory``, the ini value and the
``cuda_limit_memory(size)`` marker.

Registered by :mod:`pytest_cuda.leaks.plugin` only when a limit is set or a collected
test carries the marker, so a run without one never imports this module. Each limited
test runs one :class:`~pytest_cuda.leaks.limit_watch.LimitWatch` around its call (peaks
reset when the call starts, read when it ends); a peak over the limit on any device the
test allocated on fails the call with the peak, the limit and the blocks alive at the
peak by allocating line. A test that failed anyway gets it as a report section; one
that ran out of memory is the out-of-memory report's. While a limit applies, the
allocator's events keep their stacks (:class:`~pytest_cuda.leaks.recording.StackRecording`
with ``event_stacks``), so the lines of blocks freed before the test ended are known.
A ``cuda_distributed`` test's limit is checked in each rank
(:func:`limit_of`, sent with its job).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from gpumagic import cuda
from gpumagic.cuda_errors import out_of_memory
from pytest_cuda.leaks.call_peaks import CallPeaks
from pytest_cuda.leaks.limit import MARKER, parse_limit
from pytest_cuda.leaks.limit_watch import LimitWatch, start_marks_needed
from pytest_cuda.leaks.recording import HISTORY_MAX_ENTRIES, StackRecording
from pytest_cuda.settings import settings_of

if TYPE_CHECKING:
    from collections.abc import Generator
    from pathlib import Path

__all__ = ["SECTION", "MemoryLimiter", "limit_of", "planned_limit"]

SECTION = "CUDA memory limit"

_WATCH = pytest.StashKey[LimitWatch]()


class MemoryLimiter:
    """Holds the limited tests to their limit; registered only when one may be."""

    def __init__(self, config: pytest.Config, snapshots: Path | None = None) -> None:
        settings = settings_of(config)
        self.default = settings.memory_limit
        self.default_source = settings.memory_limit_source
        self.snapshots = snapshots
        self.search_s = settings.holder_search_s
        self.root = str(config.rootpath)
        self.recording = StackRecording(event_stacks=True)
        self.other: StackRecording | None = None

    def start(self, other: StackRecording | None = None) -> None:
        """Stack recording with the events' stacks on now, or queued for CUDA's
        initialisation; ``other``: a leak check's recording, told to keep them too."""
        if other is not None:
            other.with_event_stacks()
            self.other = other
        if not cuda.is_initialized() and cuda.status().available:
            cuda.start_torch()
        self.recording.arm()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.recording.close()

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        if self.default is None:
            return []  # the markers' limits: said where a test goes over one
        from gpumagic.units import format_bytes

        return [
            f"cuda memory limit: {format_bytes(self.default)} per device a test "
            f"({self.default_source}); allocation stacks recorded"
        ]

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        error = None
        try:
            limit = limit_of(item, self.default, self.default_source)
        except ValueError as exc:
            error, limit = f"malformed @pytest.mark.{MARKER} on {item.nodeid}: {exc}", None
        if limit is not None and cuda.status().available:
            item.stash[_WATCH] = LimitWatch(*limit, outermost=_test_function(item))
        result = yield
        if error is not None:
            pytest.fail(error, pytrace=False)
        return result

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        watch = item.stash.get(_WATCH, None)
        if watch is None:
            return (yield)
        self.recording.ensure()
        with CallPeaks(item, marks=start_marks_needed()) as start:
            watch.begin(start)
            try:
                result = yield
            except BaseException as exc:
                if out_of_memory(exc) is None:  # the out-of-memory report says more
                    self._judge(item, watch, failed=True)
                raise
            self._judge(item, watch, failed=False)
        return result

    def _judge(self, item: pytest.Item, watch: LimitWatch, *, failed: bool) -> None:
        # The ring is ours (its size known) unless the user records with their own; read
        # now: a test that first used CUDA switched recording on inside it.
        ours = self.recording.owned or (self.other is not None and self.other.owned)
        watch.ring_size = HISTORY_MAX_ENTRIES if ours else None
        try:
            over = watch.over()
        except Exception as exc:  # a bug here must not hide the test's own outcome
            text = f"the CUDA memory limit of {item.nodeid} could not be measured: {exc!r}"
            item.add_report_section("call", SECTION, text)
            return
        if not over:
            return
        lines = [o.summary(item.name, self.root) for o in over]
        lines += [o.details(self.root) for o in over]
        if self.snapshots is not None:
            from pytest_cuda.leaks.snapshots import snapshot_line

            lines.append(
                snapshot_line(
                    self.snapshots,
                    item.nodeid,
                    "over its memory limit",
                    snapshot=watch.snapshot,
                    search_s=self.search_s,
                )
            )
        text = "\n".join(lines)
        if failed:
            item.add_report_section("call", SECTION, text)
            return
        pytest.fail(text, pytrace=False)


def limit_of(item: pytest.Item, default: int | None, default_source: str) -> tuple[int, str] | None:
    """``(bytes, where it comes from)`` of ``item``'s limit: its closest
    ``cuda_limit_memory`` marker, else ``default``; ``None``: no limit.
    :class:`ValueError` for a malformed marker."""
    marker = item.get_closest_marker(MARKER)
    if marker is not None:
        return parse_limit(marker.args, marker.kwargs), f"{MARKER} marker"
    return None if default is None else (default, default_source)


def planned_limit(item: pytest.Item) -> tuple[int, str] | None:
    """``(bytes, where it comes from)`` of the limit planned for ``item`` at its setup
    (each rank of a ``cuda_distributed`` test is held to it), ``None``: none."""
    watch = item.stash.get(_WATCH, None)
    return None if watch is None else (watch.limit, watch.source)


def _test_function(item: pytest.Item) -> tuple[str, str] | None:
    function = getattr(item, "function", None)
    code = getattr(function, "__code__", None)
    return (code.co_filename, code.co_name) if code is not None else None
