"""What inner runs on a real GPU saw: a recorder planted in the suite, and a log for $OUT."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumagic import cuda

if TYPE_CHECKING:
    import pytest

    from gpumagic.devices import DeviceInfo

# Each test that touches CUDA appends what its process saw to seen.jsonl: the xdist
# worker, its CUDA_VISIBLE_DEVICES, torch's device count and the UUID of the device.
RECORDER = """
import json
import os
from pathlib import Path

import torch

LOG = Path(__file__).with_name("seen.jsonl")


def record(request, device):
    workerinput = getattr(request.config, "workerinput", None)
    seen = {
        "worker": workerinput["workerid"] if workerinput else "main",
        "test": request.node.name,
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "device_count": torch.cuda.device_count(),
        "device": str(device),
        "uuid": str(torch.cuda.get_device_properties(device).uuid),
        "name": torch.cuda.get_device_name(device),
    }
    with LOG.open("a") as log:
        log.write(json.dumps(seen) + "\\n")
"""

WORK = """
import pytest
import torch
from recorder import record


@pytest.mark.parametrize("i", range({tests}))
def test_work(request, cuda_device, i):
    x = torch.eye(8, device=cuda_device) * i
    assert (x @ x).sum().item() == 8 * i * i
    record(request, cuda_device)
"""


def devices() -> tuple[DeviceInfo, ...]:
    return cuda.status().devices


def same_uuid(torch_uuid: str, nvml_uuid: str) -> bool:
    """torch prints ``58e4…``, NVML ``GPU-58e4…``."""
    return torch_uuid.lower().removeprefix("gpu-") == nvml_uuid.lower().removeprefix("gpu-")


def seen(pytester: pytest.Pytester) -> list[dict[str, Any]]:
    log = pytester.path / "seen.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def by_worker(records: list[dict[str, Any]]) -> dict[str, set[tuple[Any, ...]]]:
    found: dict[str, set[tuple[Any, ...]]] = {}
    for r in records:
        key = (r["CUDA_VISIBLE_DEVICES"], r["device_count"], r["device"], r["uuid"])
        found.setdefault(r["worker"], set()).add(key)
    return found


def keep(title: str, result: pytest.RunResult, records: list[dict[str, Any]]) -> None:
    """Write the inner run's header and the records to $OUT for the closing note."""
    out = os.environ.get("OUT")
    if not out:
        return
    starts = ("cuda", "  cuda:", "  gw", "  no worker", "created", "TORCH", "NVML", "CUDA")
    header = [line for line in result.outlines if line.startswith(starts)]
    summary = [line for line in result.outlines if " in " in line and "===" in line]
    lines = [f"## {title}", *header, *summary]
    lines += [
        f"{worker}: {json.dumps(sorted(seen, key=str))}"
        for worker, seen in sorted(by_worker(records).items())
    ]
    with (Path(out) / "pytest_cuda_devices.txt").open("a") as log:
        log.write("\n".join(lines) + "\n\n")
