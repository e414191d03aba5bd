"""The sync modes' per-test checks, imported only when a test asks for one.

:mod:`pytest_cuda.sync.plugin` registers :class:`SyncModes` when ``--cuda-sync=per-op``
is given or a collected test carries ``cuda_sync`` or ``cuda_no_sync``; it wraps the
body of each test that asks in its CUDA checks (per-op synchronize, no implicit
synchronization). :func:`no_implicit_sync` is the implicit-sync check for one block
(the ``cuda_no_sync`` marker and fixture).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import pytest

from gpumagic import cuda
from gpumagic.stacks import FrameFilter
from pytest_cuda.markers import check_no_arguments
from pytest_cuda.repro import describe_sync_op, failure_site
from pytest_cuda.sync.poison_report import note

if TYPE_CHECKING:
    from collections.abc import Generator, Iterator

__all__ = ["SyncModes", "no_implicit_sync"]


class SyncModes:
    """Wraps the body of each test that asks (option or marker) in its CUDA checks."""

    def __init__(self, config: pytest.Config, *, per_op_all: bool) -> None:
        self.config = config
        self.per_op_all = per_op_all

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """A marker given arguments it would ignore is an error, not a silent no-op."""
        for name in ("cuda_sync", "cuda_no_sync"):
            for mark in item.iter_markers(name):
                try:
                    check_no_arguments(mark.args, mark.kwargs)
                except ValueError as exc:
                    malformed = f"malformed @pytest.mark.{name} on {item.nodeid}: {exc}"
                else:
                    continue
                # Outside the except: pytest would show the ValueError first, then
                # "During handling of the above exception" and this.
                pytest.fail(malformed, pytrace=False)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, object, object]:
        per_op = self.per_op_all or item.get_closest_marker("cuda_sync") is not None
        no_sync = item.get_closest_marker("cuda_no_sync") is not None
        if not (per_op or no_sync):
            return (yield)
        status = cuda.status()
        if not status.available:
            if per_op:
                note(self.config, f"per-op sync did nothing: CUDA unavailable: {status.reason}")
            if no_sync:
                note(
                    self.config, f"cuda_no_sync checked nothing: CUDA unavailable: {status.reason}"
                )
            return (yield)
        with contextlib.ExitStack() as stack:
            if no_sync:
                stack.enter_context(no_implicit_sync(self.config))
            if per_op:
                stack.enter_context(cuda.sync_after_each_op(note=_per_op_note))
            return (yield)


def _per_op_note(op: str) -> str:
    """What per-op sync adds to the error its synchronize raised right after ``op``."""
    return (
        f"pytest_cuda: raised by the synchronize right after {op} (per-op sync): "
        "this op queued the kernel that failed"
    )


@contextlib.contextmanager
def no_implicit_sync(config: pytest.Config) -> Iterator[None]:
    """Fail the test if the block makes the host wait for the GPU implicitly."""
    status = cuda.status()
    if not status.available:
        note(config, f"cuda_no_sync checked nothing: CUDA unavailable: {status.reason}")
        yield
        return
    try:
        with cuda.forbid_implicit_sync():
            yield
    except RuntimeError as error:
        if cuda.SYNC_WARNING_MESSAGE not in str(error):
            raise
        op = error.op if isinstance(error, cuda.ImplicitSyncError) else None
        site = failure_site(
            error.__traceback__, FrameFilter.default().is_user, relative_to=config.rootpath
        )
        where = f" at {site.describe()}" if site else ""
        # from None: the report is this one line, not torch's error followed by "During
        # handling of the above exception, another exception occurred".
        raise pytest.fail.Exception(
            f"cuda_no_sync: implicit host-device synchronization: {describe_sync_op(op)}{where}",
            pytrace=False,
        ) from None
