"""``%lprun --gpu`` without ``--memory`` records each line boundary raw (after its
synchronize, unless ``--no-sync``) and replays it after the run: the same table as the
live boundary gives (CPU; the pretend GPU)."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

import pytest
from fake_runtime import FakeDevice
from test_lprun_magic import Run, cell, snapshot

from gpumagic.lineprof_hook import BoundaryHook
from gpumagic.lineprof_install import uses_legacy_trace

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

#: threads, a generator, an exception leaving a frame, synchronizing calls (each
#: ``dev.item()`` warns while --gpu runs) and a multi-line statement
SOURCE = """
import threading

def worker(dev):
    dev.launch(0.003)
    dev.item()

def gen(dev):
    for i in range(2):
        dev.launch(0.001)
        yield i

def bad(dev):
    dev.launch(0.001)
    raise ValueError("x")

def main(dev):
    t = threading.Thread(target=worker, args=(dev,))
    t.start()
    t.join()
    for _ in gen(dev):
        dev.item()
    try:
        bad(dev)
    except ValueError:
        pass
    total = max(
        dev.item(),
        1)
    dev.launch(0.002)
    return dev.item() + total
"""

#: Every column but the host's times: Hits, GPU Time, % GPU, Self, Syncs.
SHOWN = (0, 4, 5, 6, 7)


def profile(shell: InteractiveShell, flags: str) -> dict[str, dict[str, tuple[str, ...]]]:
    result = shell.run_cell(textwrap.dedent(SOURCE))
    assert result.success, result.error_in_exec
    run = Run(shell, f"%lprun -f main -f worker -f gen -f bad -u 1e-3 {flags} main(dev)")
    assert run.result.success, run.result.error_in_exec
    synced = "--no-sync: no synchronize at line boundaries" not in run.text
    assert synced == ("--no-sync" not in flags)
    return {
        name: {line: tuple(row[i] for i in SHOWN if i < len(row)) for line, row in rows.items()}
        for name in ("main", "worker", "gen", "bad")
        for rows in [run.table(name)]
    }


@pytest.mark.parametrize("flags", ["--gpu --no-sync", "--gpu"])
def test_the_replay_gives_the_live_boundarys_table(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch, flags: str
) -> None:
    replayed: list[int] = []
    replay = BoundaryHook.replay

    def counting(hook: BoundaryHook) -> None:
        replayed.append(len(hook.raw or ()))
        replay(hook)

    with monkeypatch.context() as patch:
        shell.user_ns["dev"] = FakeDevice().install(patch)
        patch.setattr(BoundaryHook, "replay", counting)
        raw = profile(shell, flags)
    assert replayed
    assert replayed[0] > 20  # every boundary of main and of its callees, raw
    with monkeypatch.context() as patch:
        shell.user_ns["dev"] = FakeDevice().install(patch)
        patch.setattr(BoundaryHook, "_start_raw", lambda hook, go_raw: None)
        live = profile(shell, flags)
    assert raw == live
    main = raw["main"]
    # the worker thread's synchronizing call is its own line's, not main's open line's
    assert (main["t.start()"], main["t.join()"]) == (("1",), ("1",))
    assert main["dev.launch(0.002)"][:2] == ("1", "2.0")
    assert main["bad(dev)"][1] == "1.0"  # the exception left bad's frame: its line closed
    assert main["for _ in gen(dev):"][0] == "3"
    assert main["total = max("][0] == "1"  # the multi-line statement: once
    assert main["return dev.item() + total"][-1] == "1"  # its synchronizing call
    assert raw["gen"]["dev.launch(0.001)"][:2] == ("2", "2.0")
    assert raw["bad"]['raise ValueError("x")'][0] == "1"
    if not uses_legacy_trace():  # sys.monitoring sees every thread's lines
        # the worker's kernel, on the worker's line: its thread named by its OS id
        assert raw["worker"]["dev.launch(0.003)"][:2] == ("1", "3.0")
        assert raw["worker"]["dev.item()"] == ("1", "1")


def test_an_interrupt_in_the_raw_record_is_seen_and_everything_restored(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = shell.user_ns["dev"] = FakeDevice().install(monkeypatch)
    cell(shell, "def stop(dev):\n    dev.launch(0.001)\n    x = 1\n    raise KeyboardInterrupt\n")
    before = snapshot()
    run = Run(shell, "%lprun -f stop -u 1e-3 --gpu --no-sync stop(dev)")
    assert snapshot() == before
    assert dev.debug_mode == 0
    rows = run.table("stop")
    launch = rows["dev.launch(0.001)"]
    assert (launch[0], launch[4]) == ("1", "1.0")  # Hits, GPU Time
    assert rows["x = 1"][0] == "1"
    # Interrupted: no wait for the GPU after the run (the raise event said so).
    assert "no synchronize after the run" in run.text


def test_the_raw_records_own_cost_is_subtracted(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    shell.user_ns["dev"] = FakeDevice().install(monkeypatch)
    cell(
        shell, "def busy(dev, n):\n    dev.launch(0.001)\n    for i in range(n):\n        n += i\n"
    )
    run = Run(shell, "prof = %lprun -r -f busy --gpu --no-sync busy(dev, 2000)")
    assert run.result.success
    prof = shell.user_ns["prof"]
    ((_, raw),) = prof.raw_stats().timings.items()
    ((_, corrected),) = prof.get_stats().timings.items()
    assert [hits for _, hits, _ in raw] == [hits for _, hits, _ in corrected]
    assert sum(t for _, _, t in corrected) < sum(t for _, _, t in raw)


def test_the_default_keeps_nothing_per_boundary(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --gpu the boundary is live: no record grows with the hits of a long loop."""
    cell(shell, "def step(dev):\n    dev.launch(0.02)\n    x = 1\n    return x\n")
    replayed: list[int] = []
    monkeypatch.setattr(BoundaryHook, "replay", lambda hook: replayed.append(len(hook.raw)))
    dev = shell.user_ns["dev"] = FakeDevice().install(monkeypatch)
    run = Run(shell, "prof = %lprun -r -f step -u 1e-3 step(dev)")
    assert run.result.success, run.result.error_in_exec
    prof = shell.user_ns["prof"]
    result = prof.result()
    assert replayed == []
    assert result.syncs >= 3
    assert dev.syncs == result.syncs + result.calibration_syncs
    stats = prof.get_stats()
    ((_, lines),) = stats.timings.items()
    launch_ms = lines[0][2] * stats.unit * 1e3
    assert launch_ms >= 19.5  # its 20 ms of GPU work, waited for at the next boundary
