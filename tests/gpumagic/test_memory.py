"""The core of %gpumem: the namespace walk, peaks, trace grouping, ladders and text.

Plain calls, CPU tensors and a fake seam (``fake_cuda``); the real seam runs in
``test_memory_gpu.py`` on the GPU machine.
"""

from __future__ import annotations

import collections
import gc
import json
import os
from typing import TYPE_CHECKING, Any, NamedTuple

import pytest

from fake_cuda import FakeAllocator, GiB, MiB, install
from gpumagic import memory, memory_cell, memory_holders, memory_text, stacks
from gpumagic.cuda import AllocatorStats, objects
from gpumagic.devices import DeviceInfo
from gpumagic.memory_result import CellMemResult, GpuMemResult

if TYPE_CHECKING:
    from collections.abc import Callable

torch = pytest.importorskip("torch")


def scan(namespace: dict[str, object], **kwargs: Any) -> memory_holders.HolderScan:
    """Walk a namespace keeping tensors of every device (CPU tensors stand in for CUDA)."""
    return memory_holders.find_holders(
        memory_holders.namespace_roots(namespace), keep=lambda f: True, **kwargs
    )


def names(found: memory_holders.HolderScan) -> list[str]:
    return [h.names[0] for h in found.holders]


# ---------------------------------------------------------------------------
# Who holds it


def test_a_tensor_is_found_under_its_name_with_its_facts() -> None:
    x = torch.empty(64, 32, dtype=torch.float16)
    found = scan({"x": x, "n": 3, "s": "text"})
    (holder,) = found.holders
    assert holder.names == ("x",)
    assert (holder.nbytes, holder.shape, holder.dtype, holder.device) == (
        64 * 32 * 2,
        (64, 32),
        "float16",
        "cpu",
    )


def test_views_of_one_storage_are_counted_once_and_named_together() -> None:
    x = torch.empty(1000)
    found = scan({"x": x, "v": x[:10], "t": x.view(10, 100).t()})
    (holder,) = found.holders
    assert holder.nbytes == 4000
    assert holder.shape == (1000,)  # the base leads, not a view
    assert holder.names[0] == "x"
    assert set(holder.names) == {"x", "v", "t"}
    assert holder.tensors == 3


def test_module_parameters_are_named_by_attribute_path() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer1 = torch.nn.Linear(8, 4)
            self.blocks = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
            self.register_buffer("scale", torch.ones(3))
            self.cache = torch.zeros(5)

    model = Net()
    found = scan({"model": model})
    assert set(names(found)) == {
        "model.layer1.weight",
        "model.layer1.bias",
        "model.blocks[0].weight",
        "model.blocks[0].bias",
        "model.scale",
        "model.cache",
    }


def test_gradients_and_optimizer_state_are_named_from_the_model() -> None:
    model = torch.nn.Sequential(collections.OrderedDict(layer1=torch.nn.Linear(16, 16)))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 16)).sum().backward()
    opt.step()
    # The optimizer comes first in the namespace: its param_groups path must still lose.
    found = scan({"opt": opt, "model": model})
    got = set(names(found))
    assert {"model.layer1.weight", "model.layer1.weight.grad", "model.layer1.bias.grad"} <= got
    assert "opt.state[model.layer1.weight]['exp_avg']" in got
    assert "opt.state[model.layer1.weight]['exp_avg_sq']" in got
    assert not any("param_groups" in n for h in found.holders for n in h.names)
    # Without the model in the namespace the optimizer's own path names the parameters.
    alone = names(scan({"opt": opt}))
    assert "opt.param_groups[0]['params'][0]" in alone


def test_items_of_lists_dicts_tuples_and_namedtuples() -> None:
    class Pair(NamedTuple):
        a: object
        b: object

    found = scan(
        {
            "xs": [1, torch.empty(3)],
            "d": {"k": torch.empty(4), 7: torch.empty(5), ("a", 1): torch.empty(6)},
            "p": Pair(torch.empty(7), None),
            "q": collections.deque([torch.empty(8)]),
        }
    )
    assert set(names(found)) == {"xs[1]", "d['k']", "d[7]", "d[('a', 1)]", "p.a", "q[0]"}


def test_real_names_win_over_output_history_and_underscore_names() -> None:
    x = torch.empty(10)
    namespace = {"Out": {3: x}, "_": x, "_3": x, "x": x, "In": ["x"]}
    roots = memory_holders.namespace_roots(namespace, hidden=["In", "Out"])
    assert [r[0] for r in roots] == ["Out", "_", "_3", "x"]
    found = memory_holders.find_holders(roots, keep=lambda f: True)
    (holder,) = found.holders
    assert holder.names == ("x",)  # the output history is not listed next to a real name
    # Once `x` is gone, the output history is what keeps the tensor alive: say so.
    del namespace["x"]
    roots = memory_holders.namespace_roots(namespace, hidden=["In", "Out"])
    (holder,) = memory_holders.find_holders(roots, keep=lambda f: True).holders
    assert holder.names == ("Out[3]", "_", "_3")


def test_what_only_a_closure_reaches_is_not_named() -> None:
    hidden = torch.empty(100)

    def closure() -> object:
        return hidden

    found = scan({"f": closure, "torch": torch, "Net": torch.nn.Linear})
    assert found.holders == ()


def test_cycles_and_failing_objects_do_not_stop_the_walk() -> None:
    class Broken:
        @property
        def __dict__(self) -> dict[str, object]:  # type: ignore[override]
            raise RuntimeError("no introspection here")

    a: dict[str, object] = {"t": torch.empty(2)}
    a["self"] = a
    found = scan({"a": a, "b": Broken()})
    assert names(found) == ["a['t']"]


def test_the_walk_stops_at_its_budget_and_says_so() -> None:
    found = scan({"big": [[i] for i in range(1000)], "x": torch.empty(3)}, max_objects=50)
    assert found.truncated
    assert found.visited == 50


def test_a_tensor_keyed_dict_whose_key_has_no_name_falls_back() -> None:
    key = torch.empty(1)
    found = scan({"d": {key: torch.empty(9)}})
    assert "d[<Tensor>]" in names(found)


def test_holders_are_sorted_largest_first_and_keep_filters() -> None:
    namespace = {"small": torch.empty(10), "big": torch.empty(1000), "mid": torch.empty(100)}
    assert names(scan(namespace)) == ["big", "mid", "small"]
    only_big = memory_holders.find_holders(
        memory_holders.namespace_roots(namespace), keep=lambda f: f.nbytes > 1000
    )
    assert names(only_big) == ["big"]


# ---------------------------------------------------------------------------
# Peaks


@pytest.mark.parametrize(
    ("start", "end", "reset", "expected"),
    [
        # The counter was not above the start: it tracks the cell exactly.
        (
            AllocatorStats(100, peak_allocated=100),
            AllocatorStats(100, peak_allocated=300),
            False,
            (300, None),
        ),
        # Reset at the start: exact.
        (
            AllocatorStats(100, peak_allocated=900),
            AllocatorStats(100, peak_allocated=300),
            True,
            (300, None),
        ),
        # Not reset, but the cell set a new high: exact.
        (
            AllocatorStats(100, peak_allocated=900),
            AllocatorStats(100, peak_allocated=950),
            False,
            (950, None),
        ),
        # Not reset and hidden under the earlier peak: only a bound.
        (
            AllocatorStats(100, peak_allocated=900),
            AllocatorStats(100, peak_allocated=900),
            False,
            (None, 900),
        ),
    ],
)
def test_cell_peak(
    start: AllocatorStats, end: AllocatorStats, reset: bool, expected: tuple[int | None, int | None]
) -> None:
    assert memory_cell.cell_peak(start, end, reset=reset) == expected


def test_cell_meter_resets_only_when_an_earlier_peak_would_hide_the_cells(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu = FakeAllocator(2, initialized=True).install(monkeypatch)
    meter = memory_cell.CellMeter(gpu.devices, "In[1]")
    meter.start()
    block = gpu.alloc(GiB)
    gpu.free(block)
    report = meter.finish()
    assert gpu.resets == []  # fresh counters: nothing to reset
    change = report.changes[0]
    assert (change.allocated_delta, change.peak, change.peak_above_start) == (0, GiB, GiB)
    assert change.reset is None

    meter = memory_cell.CellMeter(gpu.devices, "In[2]")
    meter.start()  # the 1 GiB peak of In[1] is above the 0 B allocated now
    block = gpu.alloc(256 * MiB)
    gpu.free(block)
    report = meter.finish()
    assert gpu.resets == [0]  # only the device whose peak hid the cell
    change = report.changes[0]
    assert (change.peak, change.peak_above_start) == (256 * MiB, 256 * MiB)
    assert change.reset == memory.PeakReset(0, "In[2]", GiB)
    assert meter.resets == (change.reset,)
    text = memory_text.format_cell_report(report)
    assert "reset before the cell (they held 1.0 GiB from earlier)" in text
    assert "--keep-peak leaves them alone" in text


def test_keep_peak_never_resets_and_reports_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeAllocator(2, initialized=True).install(monkeypatch)
    gpu.free(gpu.alloc(GiB))
    meter = memory_cell.CellMeter(gpu.devices, "In[3]", keep_peak=True)
    meter.start()
    gpu.free(gpu.alloc(256 * MiB))
    change = meter.finish().changes[0]
    assert gpu.resets == []
    assert (change.peak, change.peak_upper) == (None, GiB)
    assert "≤ 1.0 GiB" in memory_text.format_cell_report(meter.finish())


def test_cell_meter_reports_reserved_growth_and_process_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu = FakeAllocator(2).install(monkeypatch)
    meter = memory_cell.CellMeter(gpu.devices, "In[4]")
    meter.start()
    gpu.alloc(256 * MiB, device=1)
    report = meter.finish()
    assert report.initialized_by_cell
    assert [c.index for c in report.shown] == [1]
    change = report.shown[0]
    assert change.allocated_delta == change.reserved_delta == 256 * MiB
    assert change.process_delta == 256 * MiB + gpu.context
    text = memory_text.format_cell_report(report)
    assert "%%gpumem In[4] · cuda:1 Fake H200 1" in text
    assert "+256.0 MiB" in text
    assert "this cell initialised CUDA" in text


def test_watch_line(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeAllocator(2, initialized=True).install(monkeypatch)
    meter = memory_cell.CellMeter(gpu.devices, "In[5]")
    meter.start()
    gpu.alloc(256 * MiB)
    line = memory_text.format_watch_line(meter.finish())
    assert line == (
        "gpumem In[5]: cuda:0 allocated +256.0 MiB → 256.0 MiB, peak 256.0 MiB (+256.0 MiB), "
        "reserved 256.0 MiB (+256.0 MiB)"
    )
    idle = FakeAllocator(2).install(monkeypatch)
    meter = memory_cell.CellMeter(idle.devices, "In[6]")
    meter.start()
    assert memory_text.format_watch_line(meter.finish()) == (
        "gpumem In[6]: no CUDA memory in use by torch"
    )


# ---------------------------------------------------------------------------
# Trace grouping


def frame(filename: str, line: int, name: str = "<module>") -> dict[str, Any]:
    return {"filename": filename, "line": line, "name": name}


def block(
    size: int, frames: list[dict[str, Any]], state: str = "active_allocated"
) -> dict[str, Any]:
    return {"size": size, "state": state, "frames": frames}


TORCH = "/site/torch/nn/modules/module.py"


def is_library(filename: str) -> bool:
    return filename.startswith("/site/torch/")


def group_live_blocks(
    segments: list[dict[str, Any]],
    devices: set[int] | None = None,
    is_library: Callable[[str], bool] = lambda filename: False,
    **kwargs: Any,
) -> tuple[stacks.TraceLine, ...]:
    """The ``%%gpumem --trace`` path: snapshot segments -> blocks -> lines."""
    blocks = stacks.blocks_from_segments(segments, devices)
    return stacks.group_by_line(blocks, is_user=lambda f: not is_library(f), **kwargs)


def test_live_blocks_are_grouped_by_the_users_line_largest_first() -> None:
    cell = "<ipython-input-7-abc>"
    segments = [
        {
            "device": 0,
            "blocks": [
                block(64 * MiB, [frame(cell, 2)]),
                block(MiB, [frame(TORCH, 10, "cuda"), frame(cell, 3)]),
                block(MiB, [frame(TORCH, 10, "cuda"), frame(cell, 3)]),
                block(8 * MiB, [frame("/work/net.py", 42, "forward"), frame(cell, 4)]),
                block(GiB, []),  # allocated before recording: not this cell's
                block(GiB, [frame(cell, 5)], state="inactive"),
            ],
        },
        {"device": 1, "blocks": [block(4 * MiB, [frame(cell, 6)])]},
    ]
    lines = group_live_blocks(
        segments,
        cell_files=frozenset({cell}),
        is_library=is_library,
        where=lambda f, n: f"In[7] line {n}" if f == cell else f"{f}:{n}",
        source=lambda f, n: f"source {n}",
    )
    assert [(t.where, t.nbytes, t.blocks, t.devices) for t in lines] == [
        ("In[7] line 2", 64 * MiB, 1, (0,)),
        ("/work/net.py:42", 8 * MiB, 1, (0,)),
        ("In[7] line 6", 4 * MiB, 1, (1,)),
        ("In[7] line 3", 2 * MiB, 2, (0,)),
    ]
    assert lines[1].via == "In[7] line 4"
    assert lines[1].function == "forward"
    assert lines[0].via == ""
    assert lines[0].source == "source 2"
    only_device_1 = group_live_blocks(segments, devices={1}, is_library=is_library)
    assert [t.line for t in only_device_1] == [6]


def test_with_the_users_own_recording_only_blocks_through_the_cell_count() -> None:
    segments = [
        {
            "device": 0,
            "blocks": [
                block(MiB, [frame("<ipython-input-1-old>", 1)]),
                block(2 * MiB, [frame("<ipython-input-2-new>", 1)]),
                block(3 * MiB, [frame(TORCH, 1)]),
            ],
        }
    ]
    lines = group_live_blocks(
        segments, cell_files=frozenset({"<ipython-input-2-new>"}), only_cell=True
    )
    assert [t.nbytes for t in lines] == [2 * MiB]
    library_only = group_live_blocks(segments, is_library=is_library)
    assert "library code only" in [t.where for t in library_only]


def test_cpp_frames_of_a_users_stacks_all_recording_are_skipped() -> None:
    cell = "<ipython-input-3-abc>"
    frames = [
        frame("/pytorch/c10/cuda/CUDACachingAllocator.cpp", 1200, "c10::cuda::malloc"),
        frame("??", 0, "PyEval_EvalFrameDefault"),
        frame(TORCH, 10, "cuda"),
        frame(cell, 4),
    ]
    (line,) = group_live_blocks(
        [{"device": 0, "blocks": [block(MiB, frames)]}], is_library=is_library
    )
    assert (line.filename, line.line) == (cell, 4)


def test_trace_text_lists_lines_and_totals() -> None:
    lines = (
        stacks.TraceLine(
            "In[7] line 2", "c", 2, "<module>", "x = torch.empty(n)", 64 * MiB, 1, (0,)
        ),
        stacks.TraceLine(
            "net.py:42", "n", 42, "forward", "h = self.fc(x)", MiB, 2, (0,), "In[7] line 3"
        ),
    )
    report = memory_cell.CellMemoryReport(label="In[7]", trace=lines)
    text = memory_text.format_cell_report(report)
    assert "Still allocated at the end of the cell, by the line that allocated it:" in text
    assert "  64.0 MiB       1  In[7] line 2: x = torch.empty(n)" in text
    assert "net.py:42 (forward): h = self.fc(x)  [via In[7] line 3]" in text
    assert "65.0 MiB  in all (3 blocks)" in text


# ---------------------------------------------------------------------------
# Devices and the ladder


DEVICES = (
    DeviceInfo(0, "Fake H200 0", 140 * GiB, (9, 0), uuid="GPU-0", physical_index=0),
    DeviceInfo(1, "Fake H200 1", 140 * GiB, (9, 0), uuid="GPU-1", physical_index=1),
)


def test_the_ladder_adds_up_to_what_nvidia_smi_shows(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeAllocator(2, initialized=True).install(monkeypatch)
    gpu.alloc(GiB)
    gpu.free(gpu.alloc(512 * MiB))  # leaves 512 MiB cached
    state = memory.read_devices(gpu.devices)[0]
    assert state.allocated == GiB
    assert state.cached == 512 * MiB
    assert state.outside_allocator == gpu.context
    assert state.this_process == state.reserved + gpu.context  # type: ignore[operator]
    assert state.others_used == GiB
    assert state.unattributed == gpu.unlisted
    assert state.device_used == state.this_process + state.others_used + state.unattributed  # type: ignore[operator]
    text = memory_text.format_report(memory.MemoryReport(summary="s", devices=(state,)))
    pid = os.getpid()
    for expected in (
        "cuda:0 Fake H200 0 · 140.0 GiB",
        "  allocated by tensors            1.0 GiB   peak 1.5 GiB",
        "  + cached by torch             512.0 MiB   = reserved 1.5 GiB (free for torch to reuse)",
        "  + CUDA context, libraries     500.0 MiB   this process, outside torch's allocator",
        f"  = this process (pid {pid})",
        "  + other processes (1)           1.0 GiB   pid 4242 1.0 GiB",
        "  + not charged to a process     64.0 MiB",
        "  = device used                   3.1 GiB   free 136.4 GiB, reserved by the driver",
    ):
        assert expected in text, (expected, text)


def test_before_cuda_is_initialised_only_nvml_figures_are_shown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu = FakeAllocator(2).install(monkeypatch)
    state = memory.read_devices(gpu.devices)[0]
    assert state.allocated is None
    assert state.this_process is None
    text = memory_text.format_report(memory.MemoryReport(summary="s", devices=(state,)))
    assert "allocated by tensors" not in text
    assert "CUDA not initialised here: no context, nothing held" in text
    assert "torch has not initialised CUDA in this process" in text
    assert "gpumem created no context" in text


def test_without_nvml_torch_figures_come_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeAllocator(2, initialized=True, nvml=False).install(monkeypatch)
    gpu.alloc(GiB)
    state = memory.read_devices(gpu.devices)[0]
    assert (state.allocated, state.processes, state.device_used) == (GiB, None, None)
    text = memory_text.format_report(memory.MemoryReport(summary="s", devices=(state,)))
    assert "allocated by tensors" in text
    assert "this process" not in text.split("note:")[0]
    assert "note: NVML is not available (no NVIDIA driver library): no device-wide" in text


def test_mig_and_container_pids_are_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeAllocator(2, initialized=True).install(monkeypatch)
    gpu.machine.others, gpu.machine.list_self = {0: [(7, None)]}, False
    gpu.alloc(MiB)
    text = memory_text.format_report(
        memory.MemoryReport(summary="s", devices=memory.read_devices(gpu.devices[:1]))
    )
    assert "does not report per-process memory here (MIG or WDDM)" in text
    assert "NVML does not list this process" in text
    assert "--pid=host" in text


def test_gc_and_empty_cache_report_what_they_released(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeAllocator(1, initialized=True).install(monkeypatch)

    class Cycle:
        def __init__(self) -> None:
            self.me = self
            self.block = gpu.alloc(300 * MiB)

        def __del__(self) -> None:
            gpu.free(self.block)

    gc.disable()  # only the collection %gpumem --gc runs may find the cycle
    try:
        Cycle()
        report = memory.read_report(gpu.devices, summary="s", collect=True, empty_cache=True)
    finally:
        gc.enable()
    (released,) = report.released
    assert released.gc_freed == 300 * MiB
    assert released.cache_released == 300 * MiB
    assert released.process_released == 300 * MiB
    assert report.gc_objects is not None
    assert report.gc_objects >= 1
    assert gpu.empty_cache_calls == 1
    text = memory_text.format_report(report)
    assert "released: cuda:0: gc freed 300.0 MiB of tensors (kept in torch's cache); " in text
    assert "empty_cache() returned 300.0 MiB to the driver" in text


def test_empty_cache_before_cuda_is_initialised_does_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu = FakeAllocator(2).install(monkeypatch)
    report = memory.read_report(gpu.devices, summary="s", empty_cache=True)
    assert gpu.empty_cache_calls == 0
    assert not gpu.initialized
    assert (
        "--empty-cache: nothing to release, CUDA is not initialised"
        in memory_text.format_report(report)
    )


def test_top_reports_reachable_and_unreachable_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeAllocator(1, initialized=True).install(monkeypatch)
    gpu.alloc(100 * 4 + 1000)  # x and an unnamed 1000 B tensor

    def facts(obj: object) -> Any:  # the real seam's facts, of a CPU tensor made cuda:0's
        found = objects.tensor_facts(obj)
        return None if found is None else found.__class__(**{**found.__dict__, "device": "cuda:0"})

    install(monkeypatch, tensor_facts=facts)
    roots = memory_holders.namespace_roots({"x": torch.empty(100)})
    report = memory.read_report(gpu.devices, summary="s", top=5, roots=roots)
    assert report.scan is not None
    assert [h.names for h in report.scan.holders] == [("x",)]
    assert report.unreachable == ((0, 1000),)
    text = memory_text.format_report(report)
    assert "Largest live CUDA tensors reachable from your names (1 of 1 storages):" in text
    assert (
        "   size  name  shape   dtype    device\n  400 B  x     (100,)  float32  cuda:0\n" in text
    )
    assert "cuda:0: names reach 400 B in 1 storage; 1000 B is reachable from no name" in text


def test_top_says_nothing_of_a_device_that_holds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two GPUs, tensors on the first only: no "cuda:1: names reach 0 B in 0 storages"."""
    gpu = FakeAllocator(2, initialized=True).install(monkeypatch)
    gpu.alloc(100 * 4)

    def facts(obj: object) -> Any:
        found = objects.tensor_facts(obj)
        return None if found is None else found.__class__(**{**found.__dict__, "device": "cuda:0"})

    install(monkeypatch, tensor_facts=facts)
    roots = memory_holders.namespace_roots({"x": torch.empty(100)})
    report = memory.read_report(gpu.devices, summary="s", top=5, roots=roots)
    text = memory_text.format_report(report)
    assert "cuda:0: names reach 400 B in 1 storage; 0 B is reachable from no name" in text
    assert "cuda:1:" not in text


# ---------------------------------------------------------------------------
# Result objects


def test_results_serialise_and_render_self_contained_html(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeAllocator(2, initialized=True).install(monkeypatch)
    gpu.alloc(GiB)
    report = memory.read_report(gpu.devices, summary="torch 2.11 <&>", peak_resets=())
    result = GpuMemResult(report)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["devices"][0]["allocated"] == GiB
    assert data["devices"][0]["other_processes"] == [{"pid": 4242, "used": GiB}]
    page = result._repr_html_()
    assert "torch 2.11 &lt;&amp;&gt;" in page
    assert "<script" not in page
    assert "http" not in page
    assert "role='img'" in page  # the bar
    assert "allocated by tensors 1.0 GiB" in page  # its legend

    meter = memory_cell.CellMeter(gpu.devices, "In[9]")
    meter.start()
    gpu.alloc(MiB)
    cell = CellMemResult(meter.finish())
    data = json.loads(json.dumps(cell.to_dict()))
    assert data["devices"][0]["allocated_delta"] == MiB
    assert "%%gpumem In[9]" in cell._repr_html_()
    assert str(cell) == cell.text()


def test_unavailable_reports_are_one_line() -> None:
    report = memory.MemoryReport(summary="", unavailable="no CUDA here: a CPU-only build")
    assert memory_text.format_report(report) == "gpumem: no CUDA here: a CPU-only build"
    assert GpuMemResult(report).to_dict()["unavailable"] == "no CUDA here: a CPU-only build"
