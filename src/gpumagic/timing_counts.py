"""The counting pass of ``%cudatime``: one more call of the body, after every timed
run, under torch's flop counter and a byte counter (:func:`gpumagic.cuda.count_ops`),
so the result can show FLOP/s, bytes/s, the arithmetic intensity and where the body
sits on the device's roofline without ``--flops`` / ``--bytes`` worked out by hand.

Pure glue: what to count, what to keep, which notes to add. No IPython.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpumagic import cuda
from gpumagic.peaks import peaks_for

if TYPE_CHECKING:
    from collections.abc import Callable

    from gpumagic.timing_plan import TimingOptions
    from gpumagic.timing_result import CudaTimeResult

__all__ = ["SETUP_NOTE", "count_work", "counting_asked", "set_peaks"]

NOT_COUNTED_SHOWN = 8  # op names shown in the note; the rest are in result.not_counted

#: The note ``%%cudatime`` adds when a cell with setup code was counted.
SETUP_NOTE = (
    "FLOPs and bytes come from one more call after the runs, without the setup: a body "
    "that changes the setup's state or draws random numbers may count differently; "
    "--no-count skips it (or give --flops and --bytes)."
)


def set_peaks(result: CudaTimeResult, hardware_bandwidth: float | None) -> None:
    """Put the device's peaks for the body's precision on ``result`` (GPU results)."""
    if result.device_name is None:
        return
    peaks = peaks_for(result.device_name, result.flops_dtype, hardware_bandwidth)
    result.peak_flops = peaks.flops
    result.peak_flops_basis = peaks.basis
    result.peak_bytes_per_s = peaks.bandwidth
    result.peak_source = peaks.source


def counting_asked(options: TimingOptions) -> bool:
    """Whether the options leave a figure to count: no ``--no-count``, and ``--flops``
    and ``--bytes`` not both given."""
    return options.count and (options.flops is None or options.bytes is None)


def count_work(
    call: Callable[[], object], result: CudaTimeResult, options: TimingOptions
) -> tuple[list[str], list[str]]:
    """Count the FLOPs and bytes of one call of the body into ``result`` (the figures
    given with ``--flops`` / ``--bytes`` win); returns ``(warnings, notes)``.

    Runs nothing with ``--no-count``, when both figures were given, or when torch was
    never imported; a body that ran no torch op leaves the result as it was.
    """
    if not counting_asked(options):
        return [], []
    try:
        counts = cuda.count_ops(call)
    except Exception as exc:
        return [
            f"counting FLOPs and bytes failed ({exc!r}): no counts; --no-count skips the "
            "counting call"
        ], []
    if counts is None or counts.ops == 0:
        return [], []
    notes = []
    if counts.dtype:
        result.flops_dtype = counts.dtype
    if options.flops is None:
        result.flops = float(counts.flops)
        result.flops_counted = True
        result.not_counted = list(counts.not_counted)
        if counts.not_counted:
            shown = ", ".join(counts.not_counted[:NOT_COUNTED_SHOWN])
            more = len(counts.not_counted) - NOT_COUNTED_SHOWN
            if more > 0:
                shown += f" and {more} more"
            notes.append(
                f"not counted: {shown} (arithmetic without a FLOP formula in torch's "
                "FlopCounterMode): the FLOP figure leaves their work out (give --flops "
                "to set it)."
            )
    if options.bytes is None:
        result.bytes = float(counts.bytes)
        result.bytes_counted = True
    return [], notes
