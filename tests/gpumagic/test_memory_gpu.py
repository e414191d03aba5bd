"""%gpumem on a real GPU: exact deltas and peaks, names, --trace lines, NVML, no context.

Every test here runs on the GPU machine (``scripts/gpu-check.sh``); elsewhere the
``cuda`` marker skips them with the reason.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pathlib import Path

    from IPython.core.interactiveshell import InteractiveShell

pytestmark = pytest.mark.cuda

MiB = 2**20
GiB = 2**30


def device0(data: dict[str, Any]) -> dict[str, Any]:
    return next(d for d in data["devices"] if d["index"] == 0)


def test_a_new_256_mib_tensor_shows_as_plus_256_mib(
    gpu_shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    cell = "x = torch.empty(256 * 2**20, dtype=torch.uint8, device='cuda')"
    result = gpu_shell.run_cell_magic("gpumem", "-o", cell)
    device = device0(result.to_dict())
    assert device["allocated_delta"] == 256 * MiB
    assert device["allocated_end"] - device["allocated_start"] == 256 * MiB
    assert re.search(r"allocated\s+\+256\.0 MiB", result.text())

    gpu_shell.run_cell("%%gpumem\ny = torch.empty(256 * 2**20, dtype=torch.uint8, device='cuda')")
    out = capsys.readouterr().out
    assert re.search(r"%%gpumem In\[\d+\] · cuda:0 ", out), out
    assert re.search(r"allocated\s+\+256\.0 MiB", out), out


def test_a_freed_1_gib_temporary_shows_its_peak_and_no_change(
    gpu_shell: InteractiveShell,
) -> None:
    torch = gpu_shell.user_ns["torch"]
    # An earlier, higher peak: it would hide the cell's peak in the allocator's counter.
    gpu_shell.run_cell("big = torch.empty(2 * 2**30, dtype=torch.uint8, device='cuda'); del big")
    temporary = "tmp = torch.empty(2**30, dtype=torch.uint8, device='cuda')\ndel tmp"
    result = gpu_shell.run_cell_magic("gpumem", "-o", temporary)
    device = device0(result.to_dict())
    assert device["allocated_delta"] == 0
    assert device["peak_above_start"] >= GiB
    assert device["peak"] >= device["allocated_start"] + GiB
    # Said clearly: the counter was reset, and what it held before.
    assert device["peak_counter_reset"] is True
    assert device["peak_before_reset"] >= device["allocated_start"] + 2 * GiB
    assert "reset before the cell" in result.text()
    assert torch.cuda.max_memory_allocated(0) == device["peak"]

    # --keep-peak: the user's counter is left alone, and the peak is a bound.
    gpu_shell.run_cell("big = torch.empty(2 * 2**30, dtype=torch.uint8, device='cuda'); del big")
    users_peak = torch.cuda.max_memory_allocated(0)
    kept = device0(gpu_shell.run_cell_magic("gpumem", "--keep-peak -o", temporary).to_dict())
    assert kept["allocated_delta"] == 0
    assert kept["peak_counter_reset"] is False
    assert kept["peak"] is None
    assert kept["peak_upper_bound"] == users_peak
    assert torch.cuda.max_memory_allocated(0) == users_peak


def test_top_names_tensors_module_weights_grads_and_optimizer_state(
    gpu_shell: InteractiveShell,
) -> None:
    setup = textwrap.dedent(
        """
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layer1 = torch.nn.Linear(1024, 1024)

            def forward(self, x):
                return self.layer1(x)

        model = Net().cuda()
        opt = torch.optim.Adam(model.parameters())
        model(torch.ones(8, 1024, device="cuda")).sum().backward()
        opt.step()
        x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        v = x[:10]
        hidden = (lambda t: (lambda: t))(torch.empty(32 * 2**20, dtype=torch.uint8, device="cuda"))
        """
    )
    assert gpu_shell.run_cell(setup).success
    data = gpu_shell.run_line_magic("gpumem", "--top 50 -o").to_dict()
    holders = {h["names"][0]: h for h in data["holders"]}
    assert holders["x"]["nbytes"] == 64 * MiB
    assert holders["x"]["device"] == "cuda:0"
    assert holders["x"]["shape"] == [64 * MiB]
    assert "v" in holders["x"]["names"]  # the view is named with its storage ...
    assert "v" not in holders  # ... and not counted again
    weight = holders["model.layer1.weight"]
    assert (weight["nbytes"], weight["shape"], weight["dtype"]) == (
        4 * MiB,
        [1024, 1024],
        "float32",
    )
    assert "model.layer1.bias" in holders
    assert holders["model.layer1.weight.grad"]["nbytes"] == 4 * MiB
    assert holders["opt.state[model.layer1.weight]['exp_avg']"]["nbytes"] == 4 * MiB
    assert "opt.state[model.layer1.weight]['exp_avg_sq']" in holders
    # The tensor only a closure holds is reachable from no name.
    assert data["unreachable"]["cuda:0"] >= 32 * MiB


def test_trace_names_the_line_that_allocated_what_is_left(gpu_shell: InteractiveShell) -> None:
    torch = gpu_shell.user_ns["torch"]
    gpu_shell.run_cell(
        "def make():\n    return torch.empty(8 * 2**20, dtype=torch.uint8, device='cuda')\n",
        store_history=True,
    )
    cell = (
        "a = 1\n"
        "keep = torch.empty(64 * 2**20, dtype=torch.uint8, device='cuda')\n"
        "tmp = torch.empty(2**20, device='cuda')\n"
        "del tmp\n"
        "made = make()\n"
    )
    result = gpu_shell.run_cell_magic("gpumem", "--trace -o", cell)
    trace = result.to_dict()["trace"]
    first = trace[0]
    assert (first["line"], first["nbytes"], first["blocks"]) == (2, 64 * MiB, 1)
    assert first["where"].endswith(" line 2")
    assert first["source"] == "keep = torch.empty(64 * 2**20, dtype=torch.uint8, device='cuda')"
    made = next(t for t in trace if t["function"] == "make")
    assert (made["line"], made["nbytes"]) == (2, 8 * MiB)
    assert made["via"].endswith(" line 5")
    assert sum(t["nbytes"] for t in trace) == 72 * MiB  # the freed temporary is not listed
    assert re.search(r"64\.0 MiB\s+1\s+In\[\d+\] line 2: keep = torch\.empty", result.text())
    # Recording was switched off again.
    assert not torch._C._cuda_isHistoryEnabled()


def test_trace_keeps_a_recording_the_user_started(gpu_shell: InteractiveShell) -> None:
    torch = gpu_shell.user_ns["torch"]
    torch.cuda.memory._record_memory_history(max_entries=1000)
    try:
        gpu_shell.run_cell("before = torch.empty(2 * 2**20, dtype=torch.uint8, device='cuda')")
        cell = "after = torch.empty(4 * 2**20, dtype=torch.uint8, device='cuda')"
        result = gpu_shell.run_cell_magic("gpumem", "--trace -o", cell)
        assert torch._C._cuda_isHistoryEnabled()
        assert [t["nbytes"] for t in result.to_dict()["trace"]] == [4 * MiB]
        assert "settings were kept" in result.text()
    finally:
        torch.cuda.memory._record_memory_history(None)


def test_nvml_shows_this_process_once_cuda_is_in_use(gpu_shell: InteractiveShell) -> None:
    gpu_shell.run_cell("held = torch.empty(512 * 2**20, dtype=torch.uint8, device='cuda')")
    result = gpu_shell.run_line_magic("gpumem", "-o")
    device = device0(result.to_dict())
    assert device["torch_initialized"]
    assert device["allocated"] >= 512 * MiB
    assert device["this_process"] is not None, device["notes"]
    assert device["this_process"] >= device["reserved"] >= device["allocated"]
    assert device["outside_allocator"] > 0  # the CUDA context, at least
    assert device["device_used"] >= device["this_process"]
    assert device["total"] > device["device_used"]
    text = result.text()
    assert f"= this process (pid {os.getpid()})" in text
    assert "+ CUDA context, libraries" in text
    html = result._repr_html_()
    assert "role='img'" in html
    assert "<script" not in html


def test_gc_and_empty_cache_report_what_they_released(gpu_shell: InteractiveShell) -> None:
    # 4 GiB blocks: too big to be carved out of a partly used segment that an earlier
    # test left cached, so each gets a segment of its own that empty_cache() can return.
    setup = textwrap.dedent(
        """
        import gc
        gc.collect()
        torch.cuda.empty_cache()
        gc.disable()  # only the collection %gpumem --gc runs may find the cycle

        class Box:
            pass

        box = Box()
        box.me = box
        box.t = torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda")
        del box
        spare = torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda")
        del spare
        """
    )
    try:
        assert gpu_shell.run_cell(setup).success
        result = gpu_shell.run_line_magic("gpumem", "--gc --empty-cache -o")
    finally:
        gc.enable()
    data = result.to_dict()
    released = next(r for r in data["released"] if r["index"] == 0)
    assert data["gc_objects"] >= 1
    assert released["gc_freed"] >= 4 * GiB
    assert released["cache_released"] >= 8 * GiB
    assert released["process_released"] >= 4 * GiB
    assert re.search(r"gc freed \d+\.\d GiB of tensors", result.text())


def test_watch_prints_one_line_after_each_cell(
    gpu_shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu_shell.run_cell("%gpumem watch", store_history=True)
    capsys.readouterr()
    try:
        gpu_shell.run_cell(
            "w = torch.empty(256 * 2**20, dtype=torch.uint8, device='cuda')", store_history=True
        )
        out = capsys.readouterr().out
        assert re.fullmatch(
            r"gpumem In\[\d+\]: cuda:0 allocated \+256\.0 MiB → .*, peak .*, reserved .*\n", out
        ), out
    finally:
        gpu_shell.run_cell("%gpumem off")


FRESH_PROCESS = """
import contextlib, io, json, os
import torch
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "gpumagic")
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    for cell in (
        "%gpumem",
        "%gpumem --top 5 --gc --empty-cache",
        "%%gpumem\\ny = sum(range(10))",
        "%gpumem watch",
        "z = 2",
        "%gpumem off",
    ):
        assert shell.run_cell(cell).success, cell
data = shell.run_line_magic("gpumem", "-o").to_dict()
print(json.dumps({
    "initialized": torch.cuda.is_initialized(),
    "pid": os.getpid(),
    "out": out.getvalue(),
    "data": data,
}))
"""


def test_gpumem_in_a_fresh_process_creates_no_cuda_context() -> None:
    result = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["initialized"] is False
    out = report["out"]
    assert "Traceback" not in out
    assert "torch has not initialised CUDA in this process" in out
    assert f"this process (pid {report['pid']})" in out
    assert "CUDA not initialised here" in out
    device = device0(report["data"])
    assert device["torch_initialized"] is False
    assert device["allocated"] is None
    assert device["this_process"] is None  # NVML does not list a process without a context
    assert device["total"] > 0
    assert device["device_used"] is not None


def test_snapshot_opens_with_torchs_memory_viz_and_names_the_variable(
    gpu_shell: InteractiveShell, tmp_path: Path
) -> None:
    _memory_viz = importlib.import_module("torch.cuda._memory_viz")  # torch's own reader
    target = tmp_path / "cell.pickle"
    result = gpu_shell.run_cell(
        f"%%gpumem --snapshot {target}\nweights = torch.empty(1 << 20, device='cuda')\n"
    )
    assert result.success, result.error_in_exec
    with target.open("rb") as file:
        snapshot = pickle.load(file)
    assert "held by:0:weights" in _memory_viz.memory(snapshot, format_flamegraph=lambda t: t)
    # The blocks are the whole process's, largest first: earlier tests in this worker may
    # hold larger ones. The cell's block is the one at the tensor's address.
    address = gpu_shell.user_ns["weights"].data_ptr()
    blocks = json.loads(target.with_suffix(".json").read_text())["blocks"]
    (block,) = [b for b in blocks if b["address"] == address]
    assert block["holder"] == "weights"
