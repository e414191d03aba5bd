"""``%%gpumem --timeline`` through a real ``InteractiveShell``, on the fake GPU of
:mod:`fake_cuda` (the real allocator: ``test_memory_gpu.py``)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import pytest

from fake_cuda import FakeAllocator, GiB, MiB, install
from gpumagic.memory_timeline import TIMELINE_MAX_ENTRIES

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

# The done-when cell: keeps 256 MiB, makes a 1 GiB temporary.
CELL = "keep = gpu.alloc(256 * MiB)\ntmp = gpu.alloc(1024 * MiB)\ngpu.free(tmp)\n"


def test_the_peak_names_both_lines(shell: InteractiveShell, gpu: FakeAllocator) -> None:
    before = gpu.alloc(16 * MiB)
    result = shell.run_cell_magic("gpumem", "--timeline -o", CELL)
    (timeline,) = result.to_dict()["timeline"]
    assert timeline["peak"] == 16 * MiB + 256 * MiB + GiB
    assert timeline["peak"] >= 1.25 * GiB
    assert [(t["where"], t["nbytes"]) for t in timeline["at_peak"]] == [
        ("In[1] line 2", GiB),
        ("In[1] line 1", 256 * MiB),
    ]
    assert timeline["at_peak"][0]["source"] == "tmp = gpu.alloc(1024 * MiB)"
    assert timeline["before_cell"] == 16 * MiB
    assert timeline["allocated"][0] == 16 * MiB
    assert timeline["allocated"][-1] == 16 * MiB + 256 * MiB
    assert timeline["complete"]
    # The same peak as the allocator's own counter.
    assert result.to_dict()["devices"][0]["peak"] == timeline["peak"]
    gpu.free(before)


def test_recording_is_the_cheap_setting_and_is_switched_off(
    shell: InteractiveShell, gpu: FakeAllocator
) -> None:
    shell.run_cell_magic("gpumem", "--timeline -o", CELL)
    assert gpu.history_starts == 1
    assert gpu.history_settings == {
        "max_entries": TIMELINE_MAX_ENTRIES,
        "events": True,
        "skip_actions": ("free_completed",),
    }
    assert not gpu.recording


@pytest.mark.parametrize("enabled", [True, False])
def test_the_garbage_collector_is_left_as_it_was(
    shell: InteractiveShell, gpu: FakeAllocator, monkeypatch: pytest.MonkeyPatch, enabled: bool
) -> None:
    # The snapshot and the replay run with the collector off; a user's choice stands.
    import gc

    seen: list[bool] = []
    snapshot = gpu.memory_snapshot

    def watched() -> dict[str, Any]:
        seen.append(gc.isenabled())
        return snapshot()

    install(monkeypatch, memory_snapshot=watched)
    (gc.enable if enabled else gc.disable)()
    try:
        shell.run_cell_magic("gpumem", "--timeline -o", CELL)
        assert gc.isenabled() is enabled
    finally:
        gc.enable()
    assert seen == [False]


def test_an_exception_in_the_cell_still_draws_and_switches_recording_off(
    shell: InteractiveShell, gpu: FakeAllocator, capsys: pytest.CaptureFixture[str]
) -> None:
    result = shell.run_cell("%%gpumem --timeline\nkept = gpu.alloc(MiB)\nraise ValueError('x')")
    assert not result.success
    assert not gpu.recording
    assert "Timeline cuda:0 (" in capsys.readouterr().out


def test_the_terminal_shows_a_sparkline_and_the_table_at_the_peak(
    shell: InteractiveShell, gpu: FakeAllocator, capsys: pytest.CaptureFixture[str]
) -> None:
    shell.run_cell("%%gpumem --timeline\n" + CELL)
    out = capsys.readouterr().out
    assert re.search(r"Timeline cuda:0 \(\d+ allocator events\): [▁-█]+  0 B → peak 1\.2 GiB", out)
    assert "1.0 GiB       1  In[1] line 2: tmp = gpu.alloc(1024 * MiB)" in out
    assert "256.0 MiB       1  In[1] line 1: keep = gpu.alloc(256 * MiB)" in out


def test_the_notebook_gets_the_svg(shell: InteractiveShell, gpu: FakeAllocator) -> None:
    html = shell.run_cell_magic("gpumem", "--timeline -o", CELL)._repr_html_()
    assert "<svg " in html
    assert "<title>In[1] line 2: tmp = gpu.alloc(1024 * MiB) · 1.0 GiB</title>" in html
    assert "At the peak (1.2 GiB), by line:" in html
    assert "<script" not in html


def test_only_the_devices_the_cell_used_are_drawn(
    shell: InteractiveShell, gpu: FakeAllocator
) -> None:
    result = shell.run_cell_magic("gpumem", "--timeline -o", "x = gpu.alloc(MiB, device=1)")
    assert [t["device"] for t in result.to_dict()["timeline"]] == [1]
    nothing = shell.run_cell_magic("gpumem", "--timeline -o", "y = 1")
    (flat,) = nothing.to_dict()["timeline"]
    assert flat["events"] == 0
    assert "Timeline cuda:0 (0 allocator events)" in nothing.text()


def test_with_trace_one_recording_serves_both(shell: InteractiveShell, gpu: FakeAllocator) -> None:
    result = shell.run_cell_magic("gpumem", "--trace --timeline -o", CELL)
    data = result.to_dict()
    assert [t["nbytes"] for t in data["trace"]] == [256 * MiB]
    assert data["timeline"][0]["peak"] == 256 * MiB + GiB
    assert gpu.history_starts == 1
    assert gpu.history_settings["events"]
    assert not gpu.recording


def test_a_users_recording_with_events_is_read_and_kept(
    shell: InteractiveShell, gpu: FakeAllocator
) -> None:
    gpu.user_recording = gpu.user_events = True
    old = gpu.alloc(32 * MiB)  # in the user's ring, before the cell
    result = shell.run_cell_magic("gpumem", "--timeline -o", CELL)
    assert gpu.history_starts == 0
    assert gpu.user_recording
    (timeline,) = result.to_dict()["timeline"]
    assert timeline["allocated"][0] == 32 * MiB
    assert [t["nbytes"] for t in timeline["at_peak"]] == [GiB, 256 * MiB]
    assert timeline["before_cell"] == 32 * MiB
    assert timeline["complete"]
    assert "settings were kept" in result.text()
    gpu.free(old)


def test_a_users_recording_without_events_says_what_is_missing(
    shell: InteractiveShell, gpu: FakeAllocator
) -> None:
    gpu.user_recording = True  # enabled="state": no event history
    result = shell.run_cell_magic("gpumem", "--timeline -o", CELL)
    assert gpu.user_recording
    (timeline,) = result.to_dict()["timeline"]
    assert not timeline["complete"]
    assert "record with enabled='all'" in result.text()


def test_a_ring_that_wrapped_is_said(shell: InteractiveShell, gpu: FakeAllocator) -> None:
    gpu.user_recording = gpu.user_events = True
    gpu.user_max_entries = 2
    result = shell.run_cell_magic("gpumem", "--timeline -o", CELL)
    (timeline,) = result.to_dict()["timeline"]
    assert not timeline["complete"]
    assert timeline["events"] == 2
    assert timeline["allocated"][-1] == 256 * MiB
    assert "misses the start of the cell" in result.text()


@pytest.mark.usefixtures("gpu")
def test_a_usage_error_names_timeline_among_the_cell_options(shell: InteractiveShell) -> None:
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="takes --trace, --timeline, --snapshot, --keep-peak"):
        shell.run_cell_magic("gpumem", "--timeline --gc", "ran = True")
    assert "ran" not in shell.user_ns


def test_without_cuda_the_cell_runs_and_says_why(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = shell.run_cell("%%gpumem --timeline\ny = 6 * 7")
    assert result.success
    assert shell.user_ns["y"] == 42
    assert capsys.readouterr().out.strip().startswith("gpumem: no CUDA here: ")
    data = shell.run_cell_magic("gpumem", "--timeline -o", "z = 1").to_dict()
    assert data["unavailable"].startswith("no CUDA here: ")
    assert data["timeline"] is None
