"""``%gpumem`` / ``%%gpumem``: IPython glue over :mod:`gpumagic.memory`.

Parses the options, reads the figures through the core, and shows them with
``display()`` (HTML and text). ``%gpumem watch`` hooks ``pre_run_cell`` /
``post_run_cell``; ``%gpumem off`` unhooks them.
"""

from __future__ import annotations

import linecache
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from IPython import display as _display
from IPython.core import magic_arguments as _magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from gpumagic import cuda, memory, memory_cell, memory_holders, memory_text
from gpumagic.cell_code import cell_number, cell_syntax_error, file_source, run_cell_body
from gpumagic.devices import DeviceSpec, DeviceSpecError, parse_device_spec, pick_devices
from gpumagic.memory_result import CellMemResult, GpuMemResult
from gpumagic.memory_snapshot import write_cell_snapshot
from gpumagic.stacks import FrameFilter

if TYPE_CHECKING:
    from collections.abc import Callable

    from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult, InteractiveShell

    from gpumagic.devices import CudaStatus, DeviceInfo

__all__ = ["MAGICS", "GpuMemMagics", "unregister"]

# IPython's helpers are untyped; these typed names keep mypy strict here.
magic_arguments: Callable[[], Callable[[Callable[..., Any]], Callable[..., Any]]] = (
    _magic_arguments.magic_arguments
)
argument: Callable[..., Callable[[Callable[..., Any]], Callable[..., Any]]] = (
    _magic_arguments.argument
)
parse_argstring: Callable[[Callable[..., Any], str], Any] = _magic_arguments.parse_argstring
display: Callable[..., None] = _display.display


_Result = GpuMemResult | CellMemResult


@dataclass(frozen=True)
class _GpuMemCall:
    """One ``%gpumem`` or ``%%gpumem``, parsed and checked (as line_profiler's
    ``_ParseParamResult``)."""

    action: str | None  # watch, off
    cell: str | None
    top: int | None
    collect: bool  # --gc
    empty_cache: bool
    device: str | None
    keep_peak: bool
    trace: bool
    timeline: bool
    output: bool  # -o
    snapshot: str | None = None


def _parse_call(args: Any, cell: str | None) -> _GpuMemCall:
    """Every usage error before anything runs or is read."""
    _device_spec(args.device)  # checked with or without a GPU
    if cell is None:
        _check_line(args)
    else:
        _check_cell(args)
    return _GpuMemCall(
        action=args.action,
        cell=cell,
        top=args.top,
        collect=args.gc,
        empty_cache=args.empty_cache,
        device=args.device,
        keep_peak=args.keep_peak,
        trace=args.trace,
        timeline=args.timeline,
        output=args.return_result,
        snapshot=args.snapshot,
    )


def _check_line(args: Any) -> None:
    cell_options = (("--trace", args.trace), ("--timeline", args.timeline))
    for option, on in (*cell_options, ("--snapshot", args.snapshot is not None)):
        if on:
            raise UsageError(
                f"{option} is an option of the cell magic: put %%gpumem {option} "
                "on the first line of the cell"
            )
    if args.action == "off":
        _check_alone(args, "off", allowed=())
    elif args.action == "watch":
        _check_alone(args, "watch", allowed=("device", "keep_peak"))
    elif args.keep_peak:
        raise UsageError("--keep-peak applies to %%gpumem and %gpumem watch")
    elif args.top is not None and args.top < 1:
        raise UsageError(f"--top takes a positive number of tensors, not {args.top}")


def _check_cell(args: Any) -> None:
    if args.action is not None:
        raise UsageError(f"'{args.action}' is for the line magic: %gpumem {args.action}")
    misplaced = [
        name
        for name, on in (
            ("--top", args.top is not None),
            ("--gc", args.gc),
            ("--empty-cache", args.empty_cache),
        )
        if on
    ]
    if misplaced:
        what = "is an option" if len(misplaced) == 1 else "are options"
        raise UsageError(
            "%%gpumem takes --trace, --timeline, --snapshot, --keep-peak, --device and -o; "
            f"{', '.join(misplaced)} {what} of the line magic %gpumem"
        )


def _check_alone(args: Any, action: str, allowed: tuple[str, ...]) -> None:
    given = {
        "top": args.top is not None,
        "gc": args.gc,
        "empty_cache": args.empty_cache,
        "device": args.device is not None,
        "keep_peak": args.keep_peak,
        "return_result": args.return_result,
    }
    extra = [name for name, on in given.items() if on and name not in allowed]
    if extra:
        options = ", ".join(
            "-o" if n == "return_result" else "--" + n.replace("_", "-") for n in extra
        )
        takes = " and ".join("--" + a.replace("_", "-") for a in allowed) or "no option"
        raise UsageError(f"%gpumem {action} takes {takes}, not {options}")


def _finish(call: _GpuMemCall, result: _Result | None, failure: BaseException | None) -> Any:
    """Show the result (or return it, -o); a cell's error after its memory figures."""
    if failure is not None:
        # The cell's error stops the notebook as it would without the magic; the memory
        # it used up to the error is shown first.
        display(result)
        raise failure
    if result is None or call.output:
        return result
    display(result)
    return None


@magics_class
class GpuMemMagics(Magics):
    """``%gpumem`` and ``%%gpumem``."""

    def __init__(self, shell: InteractiveShell) -> None:
        super().__init__(shell)
        self._peak_resets: dict[int, memory.PeakReset] = {}
        self._watch: tuple[tuple[DeviceInfo, ...], bool] | None = None
        self._meters: list[memory_cell.CellMeter | None] = []
        self._cell_magic_ran = False

    @property
    def _shell(self) -> InteractiveShell:
        assert self.shell is not None, "GpuMemMagics needs a shell"
        return self.shell

    @magic_arguments()
    @argument(
        "action",
        nargs="?",
        choices=("watch", "off"),
        help="watch: after every cell print one line (allocated change, peak, reserved); "
        "off: stop that.",
    )
    @argument(
        "--top",
        type=int,
        metavar="N",
        help="list the N largest live CUDA tensors with the names that reach them "
        "(x, model.layer1.weight.grad, opt.state[...]); views of one storage count once; "
        "memory no name reaches is given as a total.",
    )
    @argument("--gc", action="store_true", help="run gc.collect() first; report what it freed.")
    @argument(
        "--empty-cache",
        action="store_true",
        help="return torch's cached, unused memory to the driver first "
        "(torch.cuda.empty_cache()); report what it released.",
    )
    @argument(
        "--device",
        metavar="D",
        help="only these devices: 0, cuda:1 or 0,1 (default: every visible device).",
    )
    @argument(
        "--trace",
        action="store_true",
        help="%%%%gpumem only: attribute the memory still allocated after the cell to the "
        "lines that allocated it (torch's allocation stacks, recorded only during the "
        "cell).",
    )
    @argument(
        "--timeline",
        action="store_true",
        help="%%%%gpumem only: draw allocated memory over the cell (torch's allocator "
        "events, recorded only during the cell; reserved as a dashed line), mark the peak "
        "and split what was live at the peak by the line that allocated it; in a terminal "
        "a one-line sparkline and that table. -o gives the data (to_dict()['timeline']).",
    )
    @argument(
        "--snapshot",
        metavar="FILE",
        help="%%%%gpumem only: write torch's memory snapshot after the cell to FILE (the "
        "pickle https://pytorch.org/memory_viz opens; allocations recorded during the "
        "cell), each live block named by the variables that hold it, and FILE with .json "
        "for tools.",
    )
    @argument(
        "--keep-peak",
        action="store_true",
        help="%%%%gpumem and watch: never reset the allocator's peak counters; when your "
        "earlier peak hides the cell's, report an upper bound instead.",
    )
    @argument(
        "-o",
        dest="return_result",
        action="store_true",
        help="return the result object (to_dict(), HTML and text) instead of displaying it.",
    )
    @line_cell_magic
    def gpumem(self, line: str, cell: str | None = None) -> Any:
        """Show where the GPU memory went, without disturbing it.

        ``%gpumem``: for each device, memory allocated by tensors, cached by torch's
        allocator (together: reserved), the peak, this process's total as nvidia-smi
        shows it (CUDA context and libraries included), the other processes, and the
        device's used / free / total. It never creates a CUDA context (before this
        kernel uses CUDA it shows NVML's figures and says so) and frees nothing unless
        asked (``--gc``, ``--empty-cache``).

        ``%%gpumem``: run the cell, then show the change in allocated memory, the exact
        peak during the cell (the allocator's own counter, not sampling) and the growth
        of reserved memory. The peak counters are reset before the cell only when an
        earlier, higher peak would hide the cell's; the report then says so
        (``--keep-peak`` never resets). ``--trace`` adds the lines that allocated what
        is still alive at the end; ``--timeline`` draws the memory over the cell with
        the lines behind its peak; ``--snapshot FILE`` writes torch's memory snapshot
        for https://pytorch.org/memory_viz, each block named by the variables holding it.

        ``%gpumem watch`` prints one such line after every cell; ``%gpumem off`` stops.

        Examples::

            %gpumem
            %gpumem --top 10
            %gpumem --gc --empty-cache
            r = %gpumem -o
            r.to_dict()["devices"][0]["allocated"]

            %%gpumem --trace
            y = model(x)

            %%gpumem --timeline
            loss = model(x).sum()
            loss.backward()

            %%gpumem --snapshot step.pickle
            loss = model(x).sum()
        """
        call = _parse_call(parse_argstring(self.gpumem, line), cell)
        try:
            return _finish(call, *self._run(call))
        except SyntaxError as exc:
            shown = cell_syntax_error(exc, self._shell)
            if shown is None:
                raise
            raise shown from None  # the user's line and caret

    def _run(self, call: _GpuMemCall) -> tuple[_Result | None, BaseException | None]:
        """Do what the call asks: the report, the cell's, or watch on or off; and the
        cell's error, reported after its memory figures."""
        if call.cell is not None:
            return self._cell(call, call.cell)
        if call.action == "off":
            self._stop_watch(say=True)
        elif call.action == "watch":
            self._start_watch(call)
        else:
            return self._line(call), None
        return None, None

    # -- %gpumem ---------------------------------------------------------------

    def _line(self, call: _GpuMemCall) -> GpuMemResult:
        status = cuda.status()
        if not status.available:
            return GpuMemResult(memory.MemoryReport(summary="", unavailable=_no_cuda(status)))
        devices = self._devices(status, call.device)
        roots = (
            memory_holders.namespace_roots(self._shell.user_ns, self._shell.user_ns_hidden)
            if call.top
            else []
        )
        report = memory.read_report(
            devices,
            summary=status.summary(),
            top=call.top or 0,
            roots=roots,
            collect=call.collect,
            empty_cache=call.empty_cache,
            peak_resets=self._peak_resets.values(),
        )
        return GpuMemResult(report)

    def _devices(self, status: CudaStatus, spec: str | None) -> tuple[DeviceInfo, ...]:
        if spec is None:
            return status.devices
        try:
            return pick_devices(status.devices, _device_spec(spec), where=f"--device {spec!r}")
        except DeviceSpecError as exc:
            raise UsageError(str(exc)) from None

    # -- %%gpumem ----------------------------------------------------------------

    def _cell(self, call: _GpuMemCall, cell: str) -> tuple[CellMemResult, BaseException | None]:
        label = f"In[{cell_number(self._shell)}]"
        filename = file_source(self._shell, cell)
        status = cuda.status()
        self._cell_magic_ran = True
        if not status.available:
            run_cell_body(self._shell, cell, filename, 0)
            report = memory_cell.CellMemoryReport(label=label, unavailable=_no_cuda(status))
            return CellMemResult(report), None
        devices = self._devices(status, call.device)
        meter = memory_cell.CellMeter(
            devices,
            label,
            keep_peak=call.keep_peak,
            trace=call.trace,
            timeline=call.timeline,
            keep_snapshot=call.snapshot is not None,
        )
        files_before = set(linecache.cache) if call.trace or call.timeline else set()
        meter.start()
        failure: BaseException | None = None
        try:
            run_cell_body(self._shell, cell, filename, 0)
        except BaseException as exc:  # reported after the memory figures
            failure = exc
        finally:
            cell_files = frozenset({filename, *(set(linecache.cache) - files_before)})

            def where(filename: str, line: int) -> str:
                if filename in cell_files:
                    return f"{label} line {line}"
                return self._where(filename, line)

            report = meter.finish(
                cell_files=cell_files,
                is_user=FrameFilter.default().is_user,
                where=where,
                source=_source,
            )
            self._remember(meter.resets)
            if call.snapshot is not None and meter.snapshot is not None:
                report = self._write_snapshot(call.snapshot, meter.snapshot, report)
        return CellMemResult(report), failure

    def _write_snapshot(
        self, file: str, snapshot: dict[str, Any], report: memory_cell.CellMemoryReport
    ) -> memory_cell.CellMemoryReport:
        roots = memory_holders.namespace_roots(self._shell.user_ns, self._shell.user_ns_hidden)
        scan = memory_holders.find_holders(roots, keep=lambda facts: facts.device != "cpu")
        try:
            path = write_cell_snapshot(Path(file), snapshot, scan, report.label)
        except OSError as exc:
            note = f"--snapshot: could not write {file}: {exc}"
        else:
            note = f"memory snapshot written to {path} (open it at https://pytorch.org/memory_viz)"
        return replace(report, notes=(*report.notes, note))

    def _where(self, filename: str, line: int) -> str:
        named = self._shell.compile.format_code_name(filename)
        if named is not None:
            return f"{named[1]} line {line}"
        try:
            relative = os.path.relpath(filename)
        except ValueError:
            relative = filename
        shown = filename if relative.startswith("..") else relative
        return f"{shown}:{line}"

    def _remember(self, resets: tuple[memory.PeakReset, ...]) -> None:
        for reset in resets:
            self._peak_resets[reset.device] = reset

    # -- %gpumem watch -----------------------------------------------------------

    def _start_watch(self, args: _GpuMemCall) -> None:
        status = cuda.status()
        if not status.available:
            display({"text/plain": f"gpumem: {_no_cuda(status)}; nothing to watch"}, raw=True)
            return
        devices = self._devices(status, args.device)
        if self._watch is None:
            self._shell.events.register("pre_run_cell", self._pre_run_cell)
            self._shell.events.register("post_run_cell", self._post_run_cell)
        self._watch = (devices, args.keep_peak)
        peaks = (
            "peak counters are never reset (--keep-peak)"
            if args.keep_peak
            else "the allocator's peak counters are reset before a cell when an earlier, "
            "higher peak would hide the cell's"
        )
        display(
            {
                "text/plain": "gpumem: watching GPU memory after every cell "
                f"(%gpumem off stops); {peaks}"
            },
            raw=True,
        )

    def _stop_watch(self, *, say: bool) -> None:
        if self._watch is None:
            if say:
                display({"text/plain": "gpumem: watch was not on"}, raw=True)
            return
        self._shell.events.unregister("pre_run_cell", self._pre_run_cell)
        self._shell.events.unregister("post_run_cell", self._post_run_cell)
        self._watch = None
        self._meters.clear()
        if say:
            display({"text/plain": "gpumem: watch is off"}, raw=True)

    def _pre_run_cell(self, info: ExecutionInfo) -> None:
        if self._watch is None:
            self._meters.append(None)
            return
        devices, keep_peak = self._watch
        meter = memory_cell.CellMeter(devices, "this cell", keep_peak=keep_peak)
        meter.start()
        self._cell_magic_ran = False
        self._meters.append(meter)

    def _post_run_cell(self, result: ExecutionResult) -> None:
        meter = self._meters.pop() if self._meters else None
        if meter is None:
            return
        meter.label = f"In[{result.execution_count}]"
        report = meter.finish()
        self._remember(meter.resets)
        if self._cell_magic_ran:
            return  # a %%gpumem in this cell already reported (and may have reset peaks)
        display({"text/plain": memory_text.format_watch_line(report)}, raw=True)


def _source(filename: str, line: int) -> str:
    text = linecache.getline(filename, line).strip()
    return text if len(text) <= 100 else text[:99] + "…"


def _device_spec(spec: str | None) -> DeviceSpec:
    """``--device`` in the shared grammar: GPUs only, lists and ``all`` allowed."""
    if spec is None:
        return DeviceSpec(None)
    try:
        return parse_device_spec(spec, where=f"--device {spec!r}", place="%gpumem")
    except DeviceSpecError as exc:
        raise UsageError(str(exc)) from None


def _no_cuda(status: CudaStatus) -> str:
    return f"no CUDA here: {status.reason}"


#: What ``%load_ext gpumagic`` registers from this module.
MAGICS = GpuMemMagics


def unregister(shell: InteractiveShell) -> None:
    """Stop ``%gpumem watch`` (``%unload_ext gpumagic``)."""
    magics = shell.magics_manager.registry.get("GpuMemMagics")
    if isinstance(magics, GpuMemMagics):
        magics._stop_watch(say=False)
