"""``--cuda-memory-snapshot``: torch's memory snapshot of a test that leaked, went over
its limit or ran out of memory, with each live block's holder in it.

The file is the pickle memory_viz opens, with a JSON file beside it
(:mod:`gpumagic.memory_snapshot`), named for the test's node id in the folder given.
The holders are the leak engine's (:class:`~pytest_cuda.leaks.walk.holders.LeakHolderScan`):
the leak check's or the out-of-memory report's walk, else one walk over every live
block. Never imports pytest; CUDA only through :mod:`gpumagic.cuda`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpumagic import cuda
from gpumagic.memory_snapshot import (
    block_holders,
    side_data,
    snapshot_name,
    with_holders,
    write_snapshot,
)
from gpumagic.stacks import FrameFilter, blocks_from_segments
from pytest_cuda.leaks.stacks import holders_of

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_cuda.leaks.walk.holders import LeakHolderScan

__all__ = ["snapshot_line", "write_test_snapshot"]


def write_test_snapshot(
    folder: Path,
    nodeid: str,
    reason: str,
    *,
    scan: LeakHolderScan | None = None,
    snapshot: dict[str, Any] | None = None,
    search_s: float | None = None,
) -> Path:
    """Write the snapshot of ``nodeid`` (``snapshot``, else one taken now) to
    ``folder``, each block held by one of ``scan``'s holders named (without ``scan``,
    the holders of every live block, searched for ``search_s`` seconds at most);
    ``reason``: why (``leaked``, ``over its memory limit``, ``out of memory``). The
    pickle's path."""
    if snapshot is None:
        snapshot = cuda.memory_snapshot()
    if scan is None:
        blocks = blocks_from_segments(snapshot.get("segments") or ())
        scan = holders_of(blocks, FrameFilter.default().is_user, budget_s=search_s)
    holders = block_holders(snapshot, ((f"{h.path} ({h.kind})", h.storages) for h in scan.holders))
    path = folder / f"{snapshot_name(nodeid)}.pickle"
    side = side_data(snapshot, holders, test=nodeid, reason=reason, file=path.name)
    write_snapshot(path, with_holders(snapshot, holders), side)
    return path


def snapshot_line(
    folder: Path,
    nodeid: str,
    reason: str,
    *,
    scan: LeakHolderScan | None = None,
    snapshot: dict[str, Any] | None = None,
    search_s: float | None = None,
) -> str:
    """:func:`write_test_snapshot`, said in one line for the test's report: where the
    file is, or why it could not be written (the test's own verdict stands)."""
    try:
        path = write_test_snapshot(
            folder, nodeid, reason, scan=scan, snapshot=snapshot, search_s=search_s
        )
    except OSError as exc:
        return f"Memory snapshot not written: {exc}"
    return f"Memory snapshot (memory_viz): {path}"
