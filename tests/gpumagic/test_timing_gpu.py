"""``%cudatime`` on a real GPU (run by ``scripts/gpu-check.sh``; skipped without CUDA).

References come from the GPU itself: a spin kernel of known length, CUPTI kernel
durations from torch.profiler, and what IPython's ``%timeit`` reports for the same code.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING, Any

import pytest
from cudatime_call import cudatime

if TYPE_CHECKING:
    from collections.abc import Callable

    from IPython.core.interactiveshell import InteractiveShell


pytestmark = pytest.mark.cuda


def cupti_per_call(torch: Any, fn: Callable[[], object], calls: int = 10) -> float:
    """Median over calls of the summed CUPTI device time of one call, in seconds."""
    from torch.profiler import ProfilerActivity, profile, schedule

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(
        activities=[ProfilerActivity.CUDA],
        schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
    ) as prof:
        fn()
        torch.cuda.synchronize()
        prof.step()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        prof.step()
    durations = [
        e.time_range.end - e.time_range.start
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not e.is_user_annotation
        and not e.name.startswith("ProfilerStep")
    ]
    assert durations, "CUPTI recorded no kernels"
    return sum(durations) / calls * 1e-6


@pytest.mark.gpu_timing
def test_synchronization_is_real_for_a_20ms_spin_kernel(
    shell: InteractiveShell, torch: Any, cycles_per_ms: float
) -> None:
    cycles = int(20 * cycles_per_ms)
    shell.user_ns.update(torch=torch, cycles=cycles)
    reference = cupti_per_call(torch, lambda: torch.cuda._sleep(cycles), calls=5)
    r = cudatime(shell, "torch.cuda._sleep(cycles)")
    print(f"spin: CUPTI {reference * 1e3:.4f} ms, %cudatime {r.median * 1e3:.4f} ms")
    assert r.clock == "gpu"
    assert r.median == pytest.approx(reference, rel=0.01)
    assert r.median == pytest.approx(20e-3, rel=0.05)
    assert r.host_time == pytest.approx(reference, rel=0.02)
    # IPython's %timeit never synchronizes: it sees only the launch.
    naive = shell.run_line_magic("timeit", "-o -q -n 5 -r 3 torch.cuda._sleep(cycles)")
    torch.cuda.synchronize()
    assert naive.best < 1e-3


@pytest.mark.gpu_timing
def test_validate_agrees_with_cupti_on_a_spin_kernel(
    shell: InteractiveShell, torch: Any, cycles_per_ms: float
) -> None:
    shell.user_ns.update(torch=torch, cycles=int(2 * cycles_per_ms))
    r = cudatime(shell, "--validate torch.cuda._sleep(cycles)")
    assert r.cupti_ratio is not None
    assert r.cupti_ratio == pytest.approx(1.0, abs=0.01)
    assert r.kernel_time == pytest.approx(r.median, rel=0.01)
    assert r.verdict.startswith("GPU-bound")
    assert "CUPTI check" in r.text()


@pytest.mark.gpu_timing
def test_default_runs_fit_the_budget_plus_one_run(
    shell: InteractiveShell, torch: Any, cycles_per_ms: float
) -> None:
    """The default 1 s budget holds on the GPU: the runs kept, on the host clock the
    engine stops by, add up to at most the budget and one more run. The engine's own
    readings against each other, which a loaded host cannot upset; the wall time a user
    waits is ``benchmarks/bench_timing.py --default-run``'s (a bound on it here failed
    on a busy machine: issue 39)."""
    x = torch.ones(1024, device="cuda")
    shell.user_ns.update(torch=torch, cycles=int(10 * cycles_per_ms), x=x)
    for statement in ("torch.cuda._sleep(cycles)", "x.add_(1.0)"):
        r = cudatime(shell, statement)
        assert r.repeat == len(r.host_runs) >= 3, r.text()
        assert sum(r.host_runs) <= 1.0 + max(r.host_runs), (statement, r.host_runs)


@pytest.mark.gpu_timing
def test_kernels_verdicts(shell: InteractiveShell, torch: Any) -> None:
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1024, device="cuda")
    on_cpu = torch.randn(1000)
    shell.user_ns.update(torch=torch, a=a, x=x, on_cpu=on_cpu)
    matmul = cudatime(shell, "--validate --flops 2*4096**3 torch.mm(a, a)")
    assert matmul.verdict.startswith("GPU-bound"), matmul.text()
    # Same loops, same clocks: events and CUPTI agree up to the gaps between kernels.
    assert matmul.cupti_ratio is not None
    assert 0.97 < matmul.cupti_ratio < 1.06, matmul.text()
    assert matmul.kernels
    assert matmul.tflops is not None
    assert matmul.tflops > 100
    tiny = cudatime(shell, "--kernels x.add_(1.0)")
    assert tiny.verdict.startswith("launch/CPU-bound: GPU busy"), tiny.text()
    assert tiny.kernel_time is not None
    assert tiny.kernel_time < tiny.host_time / 2
    chain = cudatime(
        shell,
        "--kernels",
        "y = x\nfor _ in range(50):\n    y = torch.relu(y * 1.0001 + 0.1)",
    )
    assert chain.verdict.startswith("launch/CPU-bound"), chain.text()
    assert sum(k.calls_per_loop for k in chain.kernels) == pytest.approx(150, rel=0.1)
    cpu = cudatime(shell, "--kernels on_cpu * 2")
    assert cpu.verdict == "no GPU work was launched (CPU tensors?)", cpu.text()


@pytest.mark.gpu_timing
def test_graph_removes_launch_overhead_of_a_tiny_op(shell: InteractiveShell, torch: Any) -> None:
    x = torch.ones(1024, device="cuda")
    shell.user_ns.update(x=x)
    eager = cudatime(shell, "x.add_(1.0)")
    graph = cudatime(shell, "--graph --kernels x.add_(1.0)")
    print(
        f"tiny op: eager {eager.median * 1e6:.2f} µs, graph {graph.median * 1e6:.2f} µs, "
        f"CUPTI {graph.kernel_time * 1e6 if graph.kernel_time else float('nan'):.2f} µs"
    )
    assert graph.mode == "graph", graph.warnings
    assert graph.median < eager.median
    assert graph.kernel_time is not None
    assert abs(graph.median - graph.kernel_time) < 1.5e-6
    assert torch.cuda.is_current_stream_capturing() is False


def test_graph_capture_failure_says_why_and_falls_back(shell: InteractiveShell, torch: Any) -> None:
    x = torch.ones(1024, device="cuda")
    shell.user_ns.update(x=x)
    stream = torch.cuda.current_stream()
    r = cudatime(shell, "--graph", "y = x * 2\nv = y.sum().item()")
    assert r.mode == "eager"
    assert any(
        w.startswith("--graph: capture failed, timed eagerly instead: the body synchronizes")
        for w in r.warnings
    ), r.warnings
    assert r.not_applied == ["--graph not used: capture failed"]  # compare() shows it
    assert r.median > 0
    # CUDA is fine afterwards: no capture left open, random numbers (the RNG takes part
    # in every capture), timing and capturing still work.
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.randn(8, device="cuda").shape == (8,)
    # ... the caller's stream is current again (torch leaves its capture stream current
    # when ending the capture fails) ...
    assert torch.cuda.current_stream() == stream
    # ... and empty_cache() still returns memory (torch's allocator believes a failed
    # capture is still under way, and then releases nothing, until told it ended).
    torch.cuda.empty_cache()
    big = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # a segment of its own
    del big
    reserved = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= reserved - 256 * 2**20
    assert cudatime(shell, "--graph x.add_(1.0)").mode == "graph"
    again = cudatime(shell, "x.add_(1.0)")
    assert again.mode == "eager"
    assert not again.warnings or all("capture" not in w for w in again.warnings)


@pytest.mark.gpu_timing
def test_cold_flushes_l2_outside_the_timed_window(shell: InteractiveShell, torch: Any) -> None:
    x = torch.randn(2 * 1024 * 1024, device="cuda")  # 8 MiB in, 8 MiB out: fits in L2
    out = torch.empty_like(x)
    shell.user_ns.update(torch=torch, x=x, out=out)
    warm = cudatime(shell, "--graph torch.mul(x, 2, out=out)")
    cold = cudatime(shell, "--cold --graph --kernels torch.mul(x, 2, out=out)")
    buffer = torch.empty(200 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    flush = cupti_per_call(torch, buffer.zero_, calls=5)
    print(
        f"8 MiB mul: warm {warm.median * 1e6:.2f} µs, cold {cold.median * 1e6:.2f} µs, "
        f"200 MiB flush {flush * 1e6:.1f} µs"
    )
    assert cold.mode == "cold graph", cold.warnings
    assert cold.loops == 1
    assert cold.median > warm.median  # the data came from DRAM
    assert cold.median < flush / 2  # and the flush was not inside the interval
    assert cold.kernel_time is not None
    assert not any("told apart" in w for w in cold.warnings), cold.warnings
    assert cold.kernel_time < flush / 2  # CUPTI figures leave the flush out too


def test_sync_check_names_the_op_and_line_and_restores_the_mode(
    shell: InteractiveShell, torch: Any
) -> None:
    x = torch.ones(1024, device="cuda")
    shell.user_ns.update(x=x)
    torch.cuda.set_sync_debug_mode("default")
    r = cudatime(shell, "--sync-check", "y = x * 2\nv = y.sum().item()\nz = y + 1")
    assert r.syncs_per_loop == 1, r.text()
    site = r.sync_sites[0]
    assert site.op == "Tensor.item"
    assert site.where == "line 3"  # the cell's line: the magic line is line 1
    assert site.code == "v = y.sum().item()"
    assert torch.cuda.get_sync_debug_mode() == 0
    torch.cuda.set_sync_debug_mode("warn")
    try:
        clean = cudatime(shell, "--sync-check x.add_(1.0)")
        assert clean.syncs_per_loop == 0
        assert torch.cuda.get_sync_debug_mode() == 1
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu_timing
def test_work_on_a_side_stream_counts(
    shell: InteractiveShell, torch: Any, cycles_per_ms: float
) -> None:
    side = torch.cuda.Stream()
    shell.user_ns.update(torch=torch, side=side, cycles=int(2 * cycles_per_ms))
    reference = cupti_per_call(torch, lambda: torch.cuda._sleep(int(2 * cycles_per_ms)))
    unjoined = cudatime(shell, "", "with torch.cuda.stream(side):\n    torch.cuda._sleep(cycles)")
    print(f"side stream: CUPTI {reference * 1e3:.4f} ms, unjoined {unjoined.median * 1e3:.4f} ms")
    assert unjoined.side_streams
    assert unjoined.median == pytest.approx(reference, rel=0.02)
    joined = cudatime(
        shell,
        "",
        "side.wait_stream(torch.cuda.current_stream())\n"
        "with torch.cuda.stream(side):\n"
        "    torch.cuda._sleep(cycles)\n"
        "torch.cuda.current_stream().wait_stream(side)",
    )
    assert not joined.side_streams
    assert joined.median == pytest.approx(reference, rel=0.01)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


@pytest.mark.gpu_timing
def test_a_default_stream_matmul_is_not_side_stream_work(
    shell: InteractiveShell, torch: Any
) -> None:
    # cuBLAS launches a memset and a GEMM, both on the current stream.
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    shell.user_ns.update(a=a, b=a.T.contiguous())
    r = cudatime(shell, "--budget 0.5 a @ b")
    assert not r.side_streams, r.text()
    assert "other streams" not in r.text()


def test_global_state_is_restored(shell: InteractiveShell, torch: Any) -> None:
    import gc

    x = torch.ones(1024, device="cuda")
    shell.user_ns.update(x=x)
    stream = torch.cuda.current_stream()
    cudatime(shell, "--kernels --validate --sync-check --graph --cold x.add_(1.0)")
    assert torch.cuda.current_stream() == stream
    assert torch.cuda.get_sync_debug_mode() == 0
    assert not torch.cuda.is_current_stream_capturing()
    assert not torch._C._autograd._profiler_enabled()
    assert gc.isenabled()
    # A body that raises leaves the same state behind.
    result = shell.run_cell("%%cudatime --sync-check\ny = x * 2\nraise ValueError('body')")
    assert isinstance(result.error_in_exec, ValueError)
    assert torch.cuda.current_stream() == stream
    assert gc.isenabled()


def test_device_option(shell: InteractiveShell, torch: Any) -> None:
    x = torch.ones(1024, device="cuda:0")
    shell.user_ns.update(x=x)
    r = cudatime(shell, "--device cuda:0 x.add_(1.0)")
    assert r.device_index == 0
    assert r.device_name == torch.cuda.get_device_name(0)


def run_fresh(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_cpu_body_in_a_fresh_process_creates_no_context() -> None:
    done = run_fresh(
        """
        from IPython.core.interactiveshell import InteractiveShell
        ip = InteractiveShell.instance()
        ip.run_line_magic("load_ext", "gpumagic")
        ip.run_cell("import torch\\nc = torch.randn(100)")
        import torch
        r = ip.run_line_magic("cudatime", "-q -o --budget 0.2 c * 2")
        print("VERDICT", r.verdict)
        print("CLOCK", r.clock)
        print("CONTEXT", torch.cuda.is_initialized())
        """
    )
    assert done.returncode == 0, done.stderr
    assert "VERDICT no GPU work was launched" in done.stdout
    assert "CLOCK host" in done.stdout
    assert "CONTEXT False" in done.stdout


def test_a_cuda_error_in_the_body_is_explained_and_the_kernel_survives() -> None:
    done = run_fresh(
        """
        from IPython.core.interactiveshell import InteractiveShell
        ip = InteractiveShell.instance()
        ip.run_line_magic("load_ext", "gpumagic")
        ip.run_cell("import torch")
        ip.run_cell("x = torch.zeros(4, device='cuda'); i = torch.tensor([99], device='cuda')")
        result = ip.run_cell("%cudatime x[i] = 1.0")
        print("ERROR", type(result.error_in_exec).__name__)
        print("STILL ALIVE", flush=True)
        import os, sys
        sys.stderr.flush()
        os._exit(0)  # the context is poisoned: skip CUDA's teardown
        """
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "STILL ALIVE" in output
    assert "device-side assert" in output
    assert "CUDA_LAUNCH_BLOCKING=1" in output
    assert "sticky" in output


def test_ctrl_c_in_the_first_call_or_warm_up_on_the_gpu_is_short(
    gpu_shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 29: at most 10 lines, none from gpumagic, as on the host; the GPU is
    synchronized and the stream put back all the same."""
    import re

    gpu_shell.user_ns["seen"] = []
    step = (
        "def step():\n"
        "    if seen.append(torch.ones(1, device='cuda')) or len(seen) > 3: raise KeyboardInterrupt"
    )
    assert gpu_shell.run_cell(step).success
    capsys.readouterr()
    for cell in ("%cudatime raise KeyboardInterrupt", "%cudatime step()"):
        result = gpu_shell.run_cell(cell, store_history=True)
        assert isinstance(result.error_in_exec, KeyboardInterrupt), cell
        text = re.sub(r"\x1b\[[0-9;]*m", "", "".join(capsys.readouterr()))
        assert len(text.strip().splitlines()) <= 10, text
        assert "gpumagic" not in text, text
    assert gpu_shell.run_cell(
        "import torch\nassert torch.cuda.current_stream() == torch.cuda.default_stream()"
    ).success


def test_a_huge_n_says_its_wait_and_ctrl_c_keeps_the_loops_launched(
    gpu_shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 39: ``%cudatime -n 100000000 -r 1 torch.mm(a, b)`` started with no estimate
    and Ctrl-C before the first run ended gave a bare KeyboardInterrupt. Ctrl-C (raised
    by the body in its 3001st call) keeps the loops the run finished, timed on the GPU
    to their end; the stream is put back."""
    gpu_shell.user_ns["calls"] = [0]
    step = (
        "a = torch.randn(256, 256, device='cuda')\n"
        "def step():\n"
        "    calls[0] += 1\n"
        "    if calls[0] > 3000: raise KeyboardInterrupt\n"
        "    return a @ a"
    )
    assert gpu_shell.run_cell(step).success
    capsys.readouterr()
    result = gpu_shell.run_cell("r = %cudatime -o -n 100000000 -r 1 --no-count step()")
    assert result.success, result.error_in_exec
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("%cudatime: about "), out
    assert "for 1 run of 100,000,000 loops" in first
    assert "Ctrl-C stops with what has run" in first
    assert "Traceback" not in out
    r = gpu_shell.user_ns["r"]
    assert (r.clock, r.repeat, r.interrupted) == ("gpu", 1, True)
    assert 100 < r.loops < 3000
    assert r.warnings[0] == f"interrupted (Ctrl-C) after {r.loops:,} of 100,000,000 loops"
    assert r.median > 0
    assert gpu_shell.run_cell(
        "assert torch.cuda.current_stream() == torch.cuda.default_stream()"
    ).success
