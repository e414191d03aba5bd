"""The notes under an ``%lprun`` table: how the numbers were taken, what ``--gpu``
recorded and what it cost, and the GPU work no line of the table got; and which of
``--gpu``'s optional columns (Self, Bwd) a table needs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpumagic.units import format_time

if TYPE_CHECKING:
    from gpumagic.lineprof import LineProfileResult
    from gpumagic.lineprof_attribution import LineGpu
    from gpumagic.lineprof_record import Label

__all__ = ["backward_column", "kernel_notes", "line_gpu", "notes", "self_column"]


def _aggregated_statements(result: LineProfileResult) -> bool:
    """Whether a row of the table stands for a statement over several lines."""
    for label, rows in result.stats.timings.items():
        mapping = result.statements.get(label, {})
        firsts = {first for line, first in mapping.items() if line != first}
        if any(line in firsts for line, _, _ in rows):
            return True
    return False


def kernel_notes(result: LineProfileResult) -> list[str]:
    """How ``--gpu`` measured, what it cost, and the GPU work no line in the table got."""
    kernels = result.kernels
    syncs = "" if result.sync else ", and not one at a line boundary"
    found = [
        "GPU Time: the device time CUPTI recorded for the kernels, copies and memsets "
        "launched while the line ran, on any stream, its calls to profiled functions "
        "included (torch.profiler; each launch matched to its line by its host thread "
        "and time after the run: no CUDA event, no wait per line); % GPU: its share of "
        "the function's. Syncs: "
        "synchronizing CUDA calls made on the line (torch's sync debug mode): there the "
        "host waited for the GPU."
    ]
    if kernels is None:
        if result.kernels_failure:
            found.append(f"--gpu: {result.kernels_failure}.")
        return found
    if self_column(result):
        found.append(
            "Self: the part of GPU Time the line launched itself, not through the "
            "profiled functions it called."
        )
    if kernels.backward_to_forward_ns:
        found.append(
            f"Bwd: backward kernels charged to the forward line that built their graph "
            f"node (torch's sequence numbers), also in GPU Time: "
            f"{format_time(kernels.backward_to_forward_ns * 1e-9)} of the backward's "
            f"{format_time(kernels.backward_ns * 1e-9)}; the rest stays on the line that "
            "called backward()."
        )
    cost = result.trace_cost
    spent = f"; recording cost {format_time(cost.total_s)} outside the lines" if cost else ""
    waits = {0: "no synchronize", 1: "one synchronize"}.get(
        result.end_syncs, f"{result.end_syncs} synchronizes"
    )
    found.append(
        f"--gpu: {kernels.work} kernels, copies and memsets, "
        f"{format_time(kernels.total_ns * 1e-9)} on the GPU{spent} (torch.profiler "
        "records CUDA launches throughout and torch ops only inside backward(): what "
        f"that slows is in Time); {waits} after the run, so that the record is "
        f"complete{syncs}."
    )
    if kernels.graph_replays:
        found.append(
            f"{kernels.graph_replays} CUDA-graph replay{'s' * (kernels.graph_replays != 1)} "
            f"({format_time(kernels.graph_ns * 1e-9)}): each charged to the line that "
            "replayed it, as one launch; the lines captured into the graph get none of it."
        )
    apart = [
        (kernels.outside_ns, "launched outside the profiled lines"),
        (kernels.other_threads_ns, "launched on threads that ran no profiled line"),
        (kernels.unlinked_ns, "with no launch in the record"),
    ]
    for ns, where in apart:
        if ns:
            found.append(f"{format_time(ns * 1e-9)} of GPU work {where}: in no line.")
    if result.kernels_failure:
        found.append(f"--gpu: {result.kernels_failure}.")
    return found


def self_column(result: LineProfileResult) -> bool:
    """Whether some line's GPU time is not all its own (it called a profiled function)."""
    if result.kernels is None:
        return False
    return any(
        figures.self_ns != figures.total_ns
        for per_line in result.kernels.lines.values()
        for figures in per_line.values()
    )


def backward_column(result: LineProfileResult) -> bool:
    """Whether backward kernels were charged to forward lines."""
    return result.kernels is not None and result.kernels.backward_to_forward_ns > 0


def line_gpu(result: LineProfileResult, label: Label) -> dict[int, LineGpu]:
    if result.kernels is None:
        return {}
    return result.kernels.lines.get(label, {})


def notes(result: LineProfileResult) -> list[str]:
    """What the reader needs to know about how the numbers were taken."""
    found: list[str] = []
    if result.cuda_used:
        devices = ", ".join(f"cuda:{d}" for d in result.devices) or "the GPU"
        if result.sync:
            found.append(
                f"Synchronized {devices} at every profiled line boundary ({result.syncs} "
                f"times; an idle synchronize, {result.sync_floor_ns / 1e3:.1f} µs, is not "
                "billed): each line's time includes the GPU work it launched."
            )
        else:
            found.append(
                "--no-sync: no synchronize at line boundaries; Time is the host's, and GPU "
                "work the host waits for is billed to the line that waits."
            )
        found.append(f"Wall time of the profiled statement: {format_time(result.wall_s)}.")
    elif result.gpu or result.memory:
        found.append("The statement used no CUDA: there are no GPU or memory columns.")
    if result.gpu_columns:
        found.extend(kernel_notes(result))
    if result.memory_columns:
        found.append(
            "Mem Δ: change of allocated CUDA memory over the line's hits. Peak: the most "
            "memory allocated above the line's start while it ran (≤: an upper bound; "
            "torch's peak counters are left alone)."
        )
    if result.capture_skips:
        found.append(
            f"{result.capture_skips} line boundaries fell inside CUDA graph capture: "
            "not synchronized or timed there."
        )
    if result.failure:
        found.append(f"gpumagic stopped its CUDA work after an error: {result.failure}")
    if _aggregated_statements(result):
        found.append("A statement written over several lines is counted once, on its first line.")
    found.extend(result.notes)
    return found
