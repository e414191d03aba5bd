"""``%%gpumem --timeline`` on a real GPU: torch's own event ring, replayed.

Every test here runs on the GPU machine (``scripts/gpu-check.sh``); elsewhere the
``cuda`` marker skips them with the reason.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

pytestmark = pytest.mark.cuda

MiB = 2**20
GiB = 2**30

# The timeline's reference cell: keeps 256 MiB, makes a 1 GiB temporary.
CELL = (
    "keep = torch.empty(256 * 2**20, dtype=torch.uint8, device='cuda')\n"
    "tmp = torch.empty(2**30, dtype=torch.uint8, device='cuda')\n"
    "del tmp\n"
)


def recording(shell: InteractiveShell) -> bool:
    return bool(shell.user_ns["torch"]._C._cuda_isHistoryEnabled())


def test_a_1_gib_temporary_over_256_mib_kept_peaks_with_both_lines_named(
    gpu_shell: InteractiveShell,
) -> None:
    result = gpu_shell.run_cell_magic("gpumem", "--timeline -o", CELL)
    data = result.to_dict()
    timeline = next(t for t in data["timeline"] if t["device"] == 0)
    assert timeline["peak"] >= 1.25 * GiB
    assert timeline["complete"]
    lines = {t["line"]: t for t in timeline["at_peak"]}
    assert lines[2]["nbytes"] == GiB
    assert lines[2]["source"] == "tmp = torch.empty(2**30, dtype=torch.uint8, device='cuda')"
    assert lines[1]["nbytes"] == 256 * MiB
    assert lines[1]["where"].endswith(" line 1")
    assert timeline["allocated"][-1] - timeline["allocated"][0] == 256 * MiB
    # The replay agrees with the allocator's own peak counter (which counts rounded blocks).
    counter = next(d for d in data["devices"] if d["index"] == 0)["peak"]
    assert 0 <= counter - timeline["peak"] < MiB
    assert not recording(gpu_shell)  # switched off again
    text = result.text()
    assert re.search(r"Timeline cuda:0 \(\d+ allocator events\): [▁-█]+ ", text), text
    assert re.search(r"1\.0 GiB\s+1\s+In\[\d+\] line 2: tmp = torch\.empty", text), text
    assert re.search(r"256\.0 MiB\s+1\s+In\[\d+\] line 1: keep = torch\.empty", text), text
    html = result._repr_html_()
    assert "<svg " in html
    assert "<script" not in html


def test_a_loop_of_small_ops_is_replayed_whole(gpu_shell: InteractiveShell) -> None:
    gpu_shell.run_cell("x = torch.ones(256, device='cuda')")
    cell = "for _ in range(2_000):\n    y = x * 2\ntorch.cuda.synchronize()\n"
    result = gpu_shell.run_cell_magic("gpumem", "--timeline -o", cell)
    timeline = next(t for t in result.to_dict()["timeline"] if t["device"] == 0)
    assert timeline["complete"]
    # 2,000 allocations and 1,999 frees (three events each on a torch without skip_actions)
    assert 3_999 <= timeline["events"] <= 6_000
    assert [t["line"] for t in timeline["at_peak"]] == [2]


def test_with_trace_one_recording_serves_both(gpu_shell: InteractiveShell) -> None:
    result = gpu_shell.run_cell_magic("gpumem", "--trace --timeline -o", CELL)
    data = result.to_dict()
    assert [t["nbytes"] for t in data["trace"]] == [256 * MiB]
    assert data["timeline"][0]["peak"] >= 1.25 * GiB
    assert not recording(gpu_shell)


def test_a_recording_the_user_started_is_read_and_kept(gpu_shell: InteractiveShell) -> None:
    torch = gpu_shell.user_ns["torch"]
    torch.cuda.memory._record_memory_history(max_entries=100_000)  # torch's defaults
    try:
        gpu_shell.run_cell("before = torch.empty(64 * 2**20, dtype=torch.uint8, device='cuda')")
        result = gpu_shell.run_cell_magic("gpumem", "--timeline -o", CELL)
        assert recording(gpu_shell)
        timeline = result.to_dict()["timeline"][0]
        assert timeline["complete"]
        assert timeline["peak"] >= 1.25 * GiB + 64 * MiB
        assert sorted(t["nbytes"] for t in timeline["at_peak"]) == [256 * MiB, GiB]
        assert timeline["before_cell"] >= 64 * MiB  # the earlier tensor, not a cell line
        assert "settings were kept" in result.text()
    finally:
        torch.cuda.memory._record_memory_history(None)
