"""%gpumem and %%gpumem through a real InteractiveShell: options, output, errors.

Without CUDA (``CUDA_VISIBLE_DEVICES=''`` forces that path on any machine) and with the
fake seam of ``fake_cuda``; the real GPU is exercised by ``test_memory_gpu.py``.
"""

from __future__ import annotations

import json
import os
import pickle
from typing import TYPE_CHECKING

import pytest
from IPython.core.error import UsageError

from fake_cuda import FakeAllocator, GiB, MiB, install
from gpumagic.memory_result import CellMemResult, GpuMemResult

if TYPE_CHECKING:
    from pathlib import Path

    from IPython.core.interactiveshell import InteractiveShell


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


# ---------------------------------------------------------------------------
# No CUDA: one clear line, and the cell still runs


@pytest.mark.usefixtures("no_cuda")
def test_without_cuda_gpumem_says_so_in_one_line(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    shell.run_cell("%gpumem --top 3 --gc --empty-cache")
    out = capsys.readouterr().out.strip()
    assert out.startswith("gpumem: no CUDA here: ")
    assert "\n" not in out


@pytest.mark.usefixtures("no_cuda")
def test_without_cuda_the_cell_runs_and_the_report_says_why(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    result = shell.run_cell("%%gpumem --trace\ny = 6 * 7\nprint('ran', y)")
    assert result.success
    assert shell.user_ns["y"] == 42
    out = capsys.readouterr().out
    assert "ran 42" in out
    assert out.strip().splitlines()[-1].startswith("gpumem: no CUDA here: ")


@pytest.mark.usefixtures("no_cuda")
def test_without_cuda_o_returns_a_result_with_the_reason(shell: InteractiveShell) -> None:
    result = shell.run_line_magic("gpumem", "-o")
    assert isinstance(result, GpuMemResult)
    assert result.to_dict()["unavailable"].startswith("no CUDA here: ")
    cell = shell.run_cell_magic("gpumem", "-o", "z = 1")
    assert isinstance(cell, CellMemResult)
    assert cell.to_dict()["unavailable"].startswith("no CUDA here: ")


@pytest.mark.usefixtures("no_cuda")
def test_without_cuda_watch_has_nothing_to_watch(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    shell.run_cell("%gpumem watch")
    assert "nothing to watch" in capsys.readouterr().out
    shell.run_cell("a = 1")
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------------------
# Bad options


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--bogus", "unrecognized arguments: --bogus"),
        ("--top", "expected one argument"),
        ("--top many", "invalid int value"),
        ("--top 0", "--top takes a positive number of tensors, not 0"),
        ("--trace", "--trace is an option of the cell magic"),
        ("--timeline", "--timeline is an option of the cell magic"),
        ("--keep-peak", "--keep-peak applies to %%gpumem and %gpumem watch"),
        ("sideways", "invalid choice: 'sideways'"),
        ("watch --top 3", "%gpumem watch takes --device and --keep-peak, not --top"),
        ("off -o", "%gpumem off takes no option, not -o"),
        (
            "--device abc",
            "--device 'abc': 'abc' is not a device index; use indices into the "
            "visible devices such as 0 or cuda:0, a list such as 0,1 or 'all'",
        ),
        ("watch --device 0,x", "--device '0,x': 'x' is not a device index"),
        ("--device 0,0", "--device '0,0': cuda:0 is listed twice"),
        ("watch --device cuda:1,1", "--device 'cuda:1,1': cuda:1 is listed twice"),
        ("--device cpu", "--device 'cpu': %gpumem takes CUDA devices only, not cpu"),
    ],
)
def test_bad_line_options_are_usage_errors(
    shell: InteractiveShell, line: str, message: str
) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace("%", "%")):
        shell.run_line_magic("gpumem", line)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("watch", "'watch' is for the line magic: %gpumem watch"),
        ("--top 3 --gc", "--top, --gc are options of the line magic %gpumem"),
        ("--empty-cache", "--empty-cache is an option of the line magic %gpumem"),
        ("--device gpu1", "--device 'gpu1': 'gpu1' is not a device index"),
        ("--device 0,0", "--device '0,0': cuda:0 is listed twice"),
    ],
)
def test_bad_cell_options_are_usage_errors_and_the_cell_does_not_run(
    shell: InteractiveShell, line: str, message: str
) -> None:
    with pytest.raises(UsageError, match=message):
        shell.run_cell_magic("gpumem", line, "ran = True")
    assert "ran" not in shell.user_ns


def test_an_unknown_device_is_a_usage_error_naming_the_visible_ones(
    shell: InteractiveShell, gpu: FakeAllocator
) -> None:
    with pytest.raises(UsageError, match=r"there is no cuda:5 here \(visible: cuda:0, cuda:1\)"):
        shell.run_line_magic("gpumem", "--device 5")
    with pytest.raises(UsageError, match="there is no cuda:5"):
        shell.run_cell_magic("gpumem", "--device cuda:5", "pass")


def test_usage_errors_in_a_cell_are_shown_not_raised(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    result = shell.run_cell("%gpumem --top -1")
    assert not result.success
    captured = capsys.readouterr()
    assert "UsageError: --top takes a positive number of tensors, not -1" in (
        captured.out + captured.err
    )


def test_the_help_documents_the_options(shell: InteractiveShell) -> None:
    doc = shell.find_magic("gpumem").__doc__
    for option in (
        "--top N",
        "--gc",
        "--empty-cache",
        "--device D",
        "--trace",
        "--timeline",
        "--keep-peak",
    ):
        assert option in doc
    assert "watch" in doc
    assert "never creates a CUDA context" in doc


# ---------------------------------------------------------------------------
# With a (fake) GPU


def test_gpumem_shows_every_device_as_text_and_html(
    shell: InteractiveShell, gpu: FakeAllocator, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu.alloc(GiB)
    shell.run_cell("%gpumem")
    out = capsys.readouterr().out
    assert out.startswith("gpumem: torch 2.11, CUDA 13.0; 2 device(s)\n")
    assert "cuda:0 Fake H200 0 · 140.0 GiB" in out
    assert "cuda:1 Fake H200 1 · 140.0 GiB" in out
    assert "allocated by tensors            1.0 GiB" in out
    result = shell.run_line_magic("gpumem", "-o --device 1")
    assert [d["index"] for d in result.to_dict()["devices"]] == [1]
    assert "<table" in result._repr_html_()


def test_top_names_the_tensors_and_gc_empty_cache_report_releases(
    shell: InteractiveShell, gpu: FakeAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    from gpumagic import cuda
    from gpumagic.cuda import objects

    def as_cuda(obj: object) -> cuda.TensorFacts | None:  # the real seam's, made cuda:0's
        found = objects.tensor_facts(obj)
        if found is None:
            return None
        return cuda.TensorFacts(
            found.storage, found.nbytes, "cuda:0", found.shape, found.dtype, found.grad, found.view
        )

    install(monkeypatch, tensor_facts=as_cuda)
    shell.user_ns["torch"] = torch
    shell.run_cell("x = torch.empty(1000)\nv = x[:10]\n_hidden = torch.empty(10)\nx")
    gpu.alloc(4000 + 40)
    result = shell.run_line_magic("gpumem", "--top 5 -o --gc --empty-cache")
    data = result.to_dict()
    assert data["holders"][0]["names"][:2] == ["x", "v"]
    assert data["holders"][0]["nbytes"] == 4000
    assert data["holders"][1]["names"] == ["_hidden"]
    assert data["gc_objects"] is not None
    assert gpu.empty_cache_calls == 1
    assert "released: cuda:0:" in result.text()


def test_cell_magic_reports_the_change_and_shows_the_cells_value(
    shell: InteractiveShell, gpu: FakeAllocator, capsys: pytest.CaptureFixture[str]
) -> None:
    shell.run_cell("%%gpumem\nblock = gpu.alloc(256 * MiB)\n'value'")
    out = capsys.readouterr().out
    assert "'value'" in out  # the cell's own output still shows
    assert "%%gpumem In[1] · cuda:0 Fake H200 0" in out
    assert "  allocated      +256.0 MiB   0 B → 256.0 MiB" in out
    assert "cuda:1" not in out  # unchanged devices are left out


def test_cell_magic_o_returns_the_result(shell: InteractiveShell, gpu: FakeAllocator) -> None:
    gpu.free(gpu.alloc(GiB))  # an earlier peak above what is allocated now
    result = shell.run_cell_magic("gpumem", "-o", "gpu.free(gpu.alloc(256 * MiB))")
    (device, _) = result.to_dict()["devices"]
    assert (device["allocated_delta"], device["peak_above_start"]) == (0, 256 * MiB)
    assert device["peak_counter_reset"] is True
    assert device["peak_before_reset"] == GiB
    assert gpu.resets == [0]
    # %gpumem tells afterwards that the counter was reset, and what it held.
    text = shell.run_line_magic("gpumem", "-o").text()
    assert (
        "cuda:0's peak counter was reset by %gpumem for In[1]; the peak before was 1.0 GiB" in text
    )


def test_keep_peak_leaves_the_counters_alone(shell: InteractiveShell, gpu: FakeAllocator) -> None:
    gpu.free(gpu.alloc(GiB))
    result = shell.run_cell_magic("gpumem", "--keep-peak -o", "gpu.free(gpu.alloc(MiB))")
    assert gpu.resets == []
    assert result.to_dict()["devices"][0]["peak_upper_bound"] == GiB


def test_an_exception_in_the_cell_still_reports_and_stops_recording(
    shell: InteractiveShell, gpu: FakeAllocator, capsys: pytest.CaptureFixture[str]
) -> None:
    shell.run_cell("%%gpumem --trace\nkept = gpu.alloc(MiB)\nraise ValueError('boom')")
    out = capsys.readouterr()
    assert "ValueError" in out.out + out.err
    assert "allocated        +1.0 MiB" in out.out
    assert not gpu.recording


def test_an_exception_in_the_cell_fails_the_cell(
    shell: InteractiveShell, gpu: FakeAllocator, capsys: pytest.CaptureFixture[str]
) -> None:
    """As without the magic: "Run All", nbclient and papermill stop at the error."""
    result = shell.run_cell("%%gpumem\nkept = gpu.alloc(MiB)\nraise ValueError('boom')")
    assert not result.success
    assert isinstance(result.error_in_exec, ValueError)
    assert shell.user_ns["kept"]  # the lines before the error ran in the namespace
    assert "allocated        +1.0 MiB" in capsys.readouterr().out


@pytest.mark.parametrize("cuda_here", [True, False])
def test_tracebacks_name_the_cell_being_run(
    shell: InteractiveShell,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    cuda_here: bool,
) -> None:
    if cuda_here:
        FakeAllocator(2, initialized=True).install(monkeypatch)
    shell.InteractiveTB.set_mode("Plain")
    for _ in range(3):
        shell.run_cell("pass", store_history=True)
    capsys.readouterr()
    result = shell.run_cell("%%gpumem\nx = 1\nraise KeyError('k')", store_history=True)
    assert result.execution_count == 4
    out = capsys.readouterr().out
    assert "In[4]" in out
    assert "In[5]" not in out
    assert "raise KeyError('k')" in out
    assert "memory_magics" not in out  # the traceback starts in the cell
    shell.run_cell("%%gpumem\nx = (", store_history=True)
    out = capsys.readouterr().out
    assert "SyntaxError" in out
    assert "In[5]" in out
    assert "In[6]" not in out  # every frame names the cell being run


def test_trace_names_the_line_that_allocated_what_is_left(
    shell: InteractiveShell, gpu: FakeAllocator, capsys: pytest.CaptureFixture[str]
) -> None:
    shell.run_cell("def make():\n    return gpu.alloc(8 * MiB)\n", store_history=True)
    cell = "a = 1\nkept = gpu.alloc(64 * MiB)\ngpu.free(gpu.alloc(MiB))\nmade = make()"
    result = shell.run_cell_magic("gpumem", "--trace -o", cell)
    assert gpu.history_starts == 1
    assert not gpu.recording  # switched off again
    trace = result.to_dict()["trace"]
    assert [(t["where"], t["nbytes"]) for t in trace] == [
        ("In[2] line 2", 64 * MiB),
        ("In[1] line 2", 8 * MiB),
    ]
    assert trace[0]["source"] == "kept = gpu.alloc(64 * MiB)"
    assert trace[1]["function"] == "make"
    assert trace[1]["via"] == "In[2] line 4"
    text = result.text()
    assert "64.0 MiB       1  In[2] line 2: kept = gpu.alloc(64 * MiB)" in text
    assert "In[1] line 2 (make): return gpu.alloc(8 * MiB)  [via In[2] line 4]" in text


def test_trace_lists_only_what_this_cell_allocated(
    shell: InteractiveShell, gpu: FakeAllocator
) -> None:
    # The allocator keeps the stack of a block allocated while an earlier --trace cell
    # recorded; a later --trace cell must not charge that block to itself.
    shell.run_cell("%%gpumem --trace\nearlier = gpu.alloc(2 * MiB)\n", store_history=True)
    shell.run_cell("%%gpumem --trace -o\nlater = gpu.alloc(4 * MiB)\n", store_history=True)
    trace = shell.user_ns["_"].to_dict()["trace"]
    assert [(t["where"], t["nbytes"]) for t in trace] == [("In[2] line 1", 4 * MiB)]


def test_trace_keeps_the_users_own_recording(shell: InteractiveShell, gpu: FakeAllocator) -> None:
    gpu.user_recording = True
    old = gpu.alloc(MiB)  # recorded by the user's recording, before the cell
    result = shell.run_cell_magic("gpumem", "--trace -o", "new = gpu.alloc(2 * MiB)")
    assert gpu.history_starts == 0
    assert gpu.user_recording
    assert [t["nbytes"] for t in result.to_dict()["trace"]] == [2 * MiB]
    assert "settings were kept" in result.text()
    gpu.free(old)


def test_watch_prints_one_line_per_cell_until_off(
    shell: InteractiveShell, gpu: FakeAllocator, capsys: pytest.CaptureFixture[str]
) -> None:
    shell.run_cell("%gpumem watch", store_history=True)
    assert "watching GPU memory after every cell" in capsys.readouterr().out
    shell.run_cell("b = gpu.alloc(256 * MiB)", store_history=True)
    assert capsys.readouterr().out == (
        "gpumem In[2]: cuda:0 allocated +256.0 MiB → 256.0 MiB, peak 256.0 MiB (+256.0 MiB), "
        "reserved 256.0 MiB (+256.0 MiB)\n"
    )
    # A %%gpumem cell is reported once, by the cell magic.
    shell.run_cell("%%gpumem\nc = gpu.alloc(MiB)", store_history=True)
    out = capsys.readouterr().out
    assert "%%gpumem In[3]" in out
    assert "gpumem In[3]:" not in out
    shell.run_cell("%gpumem off", store_history=True)
    assert capsys.readouterr().out == "gpumem: watch is off\n"
    shell.run_cell("d = 1", store_history=True)
    assert capsys.readouterr().out == ""
    assert not [f for f in shell.events.callbacks["post_run_cell"] if "GpuMem" in repr(f)]


def test_unloading_the_extension_stops_watching(
    shell: InteractiveShell, gpu: FakeAllocator
) -> None:
    shell.run_line_magic("gpumem", "watch")
    shell.run_line_magic("unload_ext", "gpumagic")
    assert not [f for f in shell.events.callbacks["pre_run_cell"] if "GpuMem" in repr(f)]


def test_gpumem_before_cuda_is_used_creates_nothing(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu = FakeAllocator(2).install(monkeypatch)
    shell.run_cell("%gpumem --top 3 --empty-cache")
    out = capsys.readouterr().out
    assert not gpu.initialized
    assert gpu.empty_cache_calls == 0
    assert f"this process (pid {os.getpid()})" in out
    assert "CUDA not initialised here" in out


def test_snapshot_writes_the_pickle_with_each_holder_and_the_json(
    shell: InteractiveShell, gpu: FakeAllocator, tmp_path: Path
) -> None:
    target = tmp_path / "cell.pickle"
    cell = "kept = gpu.tensor(4 * MiB)\ngpu.free(gpu.alloc(MiB))"
    result = shell.run_cell_magic("gpumem", f"--snapshot {target} -o", cell)
    assert not gpu.recording  # recorded for the cell only
    snapshot = pickle.loads(target.read_bytes())
    (block,) = [
        b for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated"
    ]
    assert block["frames"][0] == {"filename": "held by", "line": 0, "name": "kept"}
    assert block["frames"][1]["line"] == 1  # the cell's line, as torch records it
    freed = [e for e in snapshot["device_traces"][0] if e["action"] == "free_requested"]
    assert len(freed) == 1  # the cell's events, for memory_viz's timeline
    side = json.loads(target.with_suffix(".json").read_text())
    assert side["cell"] == "In[1]"
    assert [(b["holder"], b["size"]) for b in side["blocks"]] == [("kept", 4 * MiB)]
    assert f"memory snapshot written to {target}" in result.text()


def test_snapshot_is_an_option_of_the_cell_magic(shell: InteractiveShell) -> None:
    with pytest.raises(UsageError, match="--snapshot is an option of the cell magic"):
        shell.run_line_magic("gpumem", "--snapshot out.pickle")
