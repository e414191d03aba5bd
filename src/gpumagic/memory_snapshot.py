"""torch's memory snapshot with each live block's holder in it: the file memory_viz opens.

``torch.cuda.memory._snapshot()`` dumped with :mod:`pickle` is what
https://pytorch.org/memory_viz and ``python -m torch.cuda._memory_viz`` read. Neither
knows which Python object holds a block, so :func:`with_holders` adds it as a frame of
the block's stack (and of the allocation event that made the block), innermost:
memory_viz shows it at the top of the block's stack, as ``held by:0:<holder>``.
:func:`side_data` is the same as plain JSON for tools (every live block, largest first,
with its holder and stack). Used by ``%%gpumem --snapshot`` and pytest_cuda's
``--cuda-memory-snapshot``. Pure, but for :func:`write_snapshot`: no torch, no IPython.
"""

from __future__ import annotations

import copy
import json
import pickle
import re
from typing import TYPE_CHECKING, Any

from gpumagic.stacks import blocks_from_segments

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping
    from pathlib import Path

    from gpumagic.memory_holders import HolderScan

__all__ = [
    "HOLDER_FILE",
    "block_holders",
    "side_data",
    "snapshot_name",
    "with_holders",
    "write_cell_snapshot",
    "write_snapshot",
]

#: The file name of the frame that names a block's holder.
HOLDER_FILE = "held by"

#: Blocks and their holders: ``{(device, block address): holder}``.
Holders = dict[tuple[int, int], str]


def block_holders(
    snapshot: Mapping[str, Any], holders: Iterable[tuple[str, Iterable[tuple[str, int]]]]
) -> Holders:
    """The holder of each live block of ``snapshot``: ``holders`` gives each holder's
    text with the storages it holds (``(device, address)`` as
    :func:`gpumagic.cuda.tensor_facts` keys them: ``("cuda:0", 0x7f...)``); a storage
    lies in the block whose address range holds it. The first holder of a block wins."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for block in blocks_from_segments(snapshot.get("segments") or ()):
        spans.setdefault(block.device, []).append((block.address, block.size))
    found: Holders = {}
    for text, storages in holders:
        for device_text, address in storages:
            device = _device_index(device_text)
            if device is None:
                continue
            for start, size in spans.get(device, ()):
                if start <= address < start + size:
                    found.setdefault((device, start), text)
                    break
    return found


def _device_index(text: str) -> int | None:
    match = re.fullmatch(r"cuda:(\d+)", text)
    return int(match.group(1)) if match else None


def _frame(holder: str) -> dict[str, Any]:
    return {"filename": HOLDER_FILE, "line": 0, "name": holder}


def with_holders(snapshot: Mapping[str, Any], holders: Holders) -> dict[str, Any]:
    """A copy of ``snapshot`` whose live blocks held by someone (``holders``, see
    :func:`block_holders`) have their holder as their innermost frame, and so has the
    last allocation event at each such block's address."""
    found = copy.deepcopy(dict(snapshot))
    for segment in found.get("segments") or ():
        device = int(segment.get("device", 0))
        for block in segment.get("blocks") or ():
            holder = holders.get((device, int(block.get("address", 0))))
            if holder is not None and block.get("state") == "active_allocated":
                block["frames"] = [_frame(holder), *(block.get("frames") or ())]
    for device, events in enumerate(found.get("device_traces") or ()):
        named: set[int] = set()
        for event in reversed(events):
            address = int(event.get("addr", -1))
            holder = holders.get((device, address))
            if holder is None or event.get("action") != "alloc" or address in named:
                continue
            named.add(address)
            event["frames"] = [_frame(holder), *(event.get("frames") or ())]
    return found


def side_data(snapshot: Mapping[str, Any], holders: Holders, **about: Any) -> dict[str, Any]:
    """Plain data for tools: ``about`` (what the snapshot is of), then every live block,
    largest first, with its holder (``None``: none known) and allocating stack."""
    blocks = sorted(
        blocks_from_segments(snapshot.get("segments") or ()),
        key=lambda b: (-b.size, b.device, b.address),
    )
    return {
        "version": 1,
        **about,
        "blocks": [
            {
                "device": f"cuda:{b.device}",
                "address": b.address,
                "size": b.size,
                "requested": b.requested,
                "holder": holders.get((b.device, b.address)),
                "frames": [
                    {"filename": f.filename, "line": f.line, "name": f.name} for f in b.frames
                ],
            }
            for b in blocks
        ],
    }


def snapshot_name(label: str) -> str:
    """A file name (without suffix) for ``label`` (a test's node id, a cell's label):
    what is not a letter, a digit, ``.``, ``-`` or ``_`` becomes ``_``."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("._") or "snapshot"
    return name[:200]


def write_snapshot(path: Path, snapshot: Mapping[str, Any], side: Mapping[str, Any]) -> Path:
    """Write ``snapshot`` to ``path`` (a pickle, as memory_viz reads it) and ``side`` to
    the same name with ``.json``; the JSON file's path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as out:
        pickle.dump(dict(snapshot), out)
    beside = path.with_suffix(".json")
    beside.write_text(json.dumps(side, indent=1) + "\n")
    return beside


def write_cell_snapshot(
    path: Path, snapshot: Mapping[str, Any], scan: HolderScan, label: str
) -> Path:
    """``%%gpumem --snapshot``: the cell's snapshot written to ``path``, each block
    named by the user's names that reach it (``scan``, from
    :func:`gpumagic.memory_holders.find_holders`)."""
    holders = block_holders(
        snapshot,
        ((", ".join(h.names), (h.storage,)) for h in scan.holders if h.storage and h.names),
    )
    side = side_data(snapshot, holders, cell=label, file=path.name)
    write_snapshot(path, with_holders(snapshot, holders), side)
    return path
