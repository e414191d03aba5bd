"""``%cudatime`` and ``%%cudatime``: the IPython glue around :mod:`gpumagic.timing`.

Parses the options, compiles the body once through the shell's input transformers into
a function (as ``%timeit`` builds its template), runs the setup once, calls the engine
and displays the result.
"""

from __future__ import annotations

import ast
import functools
import io
import keyword
import re
import time
import tokenize
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from IPython import display as _display
from IPython.core import magic_arguments as _magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import (
    Magics,
    line_cell_magic,
    magics_class,
    needs_local_scope,
    no_var_expand,
    output_can_be_silenced,
)

from gpumagic.cell_code import compile_source, file_source, parse_source, show_from
from gpumagic.devices import DeviceSpecError, parse_device_spec
from gpumagic.timing import (
    TimingOptions,
    check_device,
    device_scope,
    time_cuda,
    wait_for_setup,
)
from gpumagic.timing_counts import SETUP_NOTE
from gpumagic.timing_plan import Loops
from gpumagic.units import parse_amount

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Iterator
    from types import CodeType

    from gpumagic.timing import Body
    from gpumagic.timing_result import CudaTimeResult

__all__ = ["MAGICS", "CudaTimeMagics"]

# The %timeit template: the loop runs inside the compiled function, not in the engine.
_TEMPLATE = """\
def __cudatime_body(_cudatime_it):
    for _cudatime_i in _cudatime_it:
        pass
"""

# IPython's helpers are untyped; these typed names keep mypy strict here.
magic_arguments: Callable[[], Callable[[Callable[..., Any]], Callable[..., Any]]] = (
    _magic_arguments.magic_arguments
)
argument: Callable[..., Callable[[Callable[..., Any]], Callable[..., Any]]] = (
    _magic_arguments.argument
)
display: Callable[..., None] = _display.display


@magics_class
class CudaTimeMagics(Magics):
    """Holds ``%cudatime``."""

    def __init__(self, shell: Any = None, **kwargs: Any) -> None:
        super().__init__(shell, **kwargs)
        # A note shown once in this session is not shown again, whatever its numbers
        # (its wording, digits aside): a user times many cells.
        self._notes_shown: set[str] = set()

    @no_var_expand
    @magic_arguments()
    @argument(
        "-n",
        dest="loops",
        type=int,
        metavar="N",
        help="loops per run (default, or 0: sized to the budget)",
    )
    @argument(
        "-r",
        dest="repeat",
        type=int,
        metavar="R",
        help="runs (default: until the spread is below 1 %% of the "
        "median, at least 7, or the budget is spent)",
    )
    @argument(
        "-w",
        dest="warmup",
        type=int,
        metavar="W",
        help="warm-up calls (default: until two batches agree within 10 %%)",
    )
    @argument(
        "--budget",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="time for warm-up, runs and the counting call, after the first call "
        "(default: 1); a run starts only while it lasts, so the call ends within it and "
        "one run",
    )
    @argument(
        "-p",
        dest="precision",
        type=int,
        default=3,
        metavar="P",
        help="significant digits shown (default: 3)",
    )
    @argument("-q", dest="quiet", action="store_true", help="show nothing")
    @argument(
        "--verbose",
        action="store_true",
        help="on the host, show every row, warning and note (by default a host timing "
        "shows three lines: the time, the spread and one warning; the result holds the rest)",
    )
    @argument("-o", dest="output", action="store_true", help="return the CudaTimeResult")
    @argument(
        "-v", dest="variable", metavar="VAR", help="store the CudaTimeResult in the variable VAR"
    )
    @argument(
        "--cold",
        action="store_true",
        help="flush the L2 cache before each call (outside the timed "
        "interval) and time single calls",
    )
    @argument(
        "--graph",
        action="store_true",
        help="capture the body in a CUDA graph and time its replays "
        "(launch overhead removed); falls back to eager with the reason",
    )
    @argument(
        "--kernels",
        action="store_true",
        help="CUPTI kernel time (torch.profiler), the GPU's busy "
        "fraction and a verdict: GPU-bound or launch/CPU-bound",
    )
    @argument(
        "--validate",
        action="store_true",
        help="also measure with CUPTI and show events / CUPTI for the same loops",
    )
    @argument(
        "--timer",
        metavar="TIMER",
        default="events",
        help="the headline's clock: events (default: CUDA events around runs of "
        "back-to-back loops) or cupti (CUPTI's kernel time of profiled runs of the same "
        "loops, the events and their gap shown beside it; says so and falls back to "
        "events where CUPTI fails)",
    )
    @argument(
        "--clock-outliers",
        dest="clock_outliers",
        metavar="WHAT",
        default="keep",
        help="runs whose SM clock was over 10 %% off the median clock: keep (default: "
        "kept in the numbers, a note names them) or drop (left out, at least 3 runs kept)",
    )
    @argument(
        "--sync-check",
        dest="sync_check",
        action="store_true",
        help="count hidden host syncs per loop and name their ops and "
        "lines (torch.cuda.set_sync_debug_mode)",
    )
    @argument(
        "--flops",
        metavar="N",
        help="FLOPs per loop, e.g. 2*4096**3 (default: counted): shows FLOP/s and %% of peak",
    )
    @argument(
        "--bytes",
        metavar="N",
        help="bytes moved per loop, e.g. 512MiB (default: counted): shows B/s and %% of "
        "the DRAM peak",
    )
    @argument(
        "--no-count",
        dest="no_count",
        action="store_true",
        help="skip the extra, untimed call that counts FLOPs and bytes (torch's "
        "FlopCounterMode) for the roofline",
    )
    @argument(
        "--device",
        metavar="DEVICE",
        help="device to time on: cuda (the current one), 0, cuda:1, or cpu for host timing",
    )
    @needs_local_scope
    @line_cell_magic
    @output_can_be_silenced
    def cudatime(
        self, line: str = "", cell: str | None = None, local_ns: dict[str, Any] | None = None
    ) -> CudaTimeResult | None:
        """Time CUDA work correctly: GPU time, host wall time and first call.

        Usage, in line mode::

          %cudatime [options] statement

        or in cell mode, where the rest of the first line is setup code run once
        (followed by a device synchronize; the names it defines stay in your
        namespace) and the cell body is timed::

          %%cudatime [options] [setup]
          body...

        The body is compiled once into a function and called in runs of N back-to-back
        loops, each run bracketed by CUDA events and closed by a synchronize of every
        device with a context (work on side streams counts). It warms up until steady,
        reports the first call separately, and stops when the spread of the runs is
        below 1 % of their median or the budget is spent (a run starts only before it
        is: the call ends within the budget and one run). Before runs that will last
        long past the budget (a huge -n) it says about how long. Ctrl-C returns what was
        measured so far, in the first run the loops it finished. Then one more call,
        outside every timed number and within the budget, counts the FLOPs (torch's
        FlopCounterMode) and the bytes each op reads and writes, for FLOP/s, B/s, % of
        the device's peak and a roofline verdict (--no-count skips it; --flops and
        --bytes set the figures instead; a call too long for the budget is not
        counted, and a note says so). Without a GPU it times on
        the host like %timeit and says so. A note already shown in this session is not
        shown again. Names assigned in the body stay local to it, as with %timeit.

        After each run the SM clock and NVML's reasons for it (power cap, thermal
        slowdown, sync boost...) are read; the result carries them (clocks_mhz,
        throttle_reasons, at_default_clock) and, when the GPU was held back, one line
        says so: "the GPU ran at 1395-1455 MHz (power cap; 27-30 % under the default
        1980 MHz): this time holds at that clock". Runs far off the median clock are
        named in a note (--clock-outliers drop leaves them out). Without NVML the
        clocks are unknown and nothing is said about them. With kernel figures
        (--kernels, --validate, --timer cupti) a "gaps" row splits the events' excess
        over CUPTI's kernel time per loop into the idle time between kernels and the
        launching around them. --cold adds an "L2 check" row: the cold calls against
        warm single calls of the same body, and the bytes flushed against the L2 size;
        a warning says when cold and warm agree.

        Examples::

          %cudatime torch.mm(a, b)
          %cudatime --kernels --flops 2*4096**3 torch.mm(a, b)
          %cudatime --timer cupti torch.mm(a, b)
          %%cudatime --sync-check x = torch.randn(1 << 20, device="cuda")
          y = x * 2
          total = y.sum().item()
        """
        call = _parse_call(getattr(self.cudatime, "parser"), line, cell)  # noqa: B009
        shell = self.shell
        assert shell is not None
        scope = local_ns if cell is None and local_ns is not shell.user_ns else None
        try:
            compiled = self._compile_call(call, scope)
        except SyntaxError as exc:
            raise exc.with_traceback(None) from None  # the user's line and caret
        return self._finish(call, self._run(call, compiled))

    def _compile_call(self, call: _CudaTimeCall, scope: dict[str, Any] | None) -> _Compiled:
        """The setup's code and the body's ``run(n)``, filed under the running cell."""
        shell = self.shell
        assert shell is not None
        try:
            check_device(call.options)
        except ValueError as exc:
            raise UsageError(f"%cudatime: {exc}") from None
        filename = file_source(shell, call.source)
        t0 = time.perf_counter()
        setup_code = self._code(call.setup, filename, call.setup_at)
        run = self._compile(call.body, filename, call.body_at, scope)
        return _Compiled(filename, setup_code, run, time.perf_counter() - t0)

    def _run(self, call: _CudaTimeCall, compiled: _Compiled) -> CudaTimeResult:
        """Run the setup once, then time the body."""
        shell = self.shell
        assert shell is not None
        filename = compiled.filename
        try:
            with device_scope(call.options):
                exec(compiled.setup, shell.user_ns)
                wait_for_setup()
            result = time_cuda(
                compiled.run,
                call.options,
                label=_label(call.body),
                code_files=(filename,),
                compile_time=compiled.compile_time,
                say=None if call.quiet else functools.partial(_say, call.magic),
            )
        except BaseException as exc:  # Ctrl-C too: shown from the user's code on
            show_from(exc, filename, shell)
            raise
        if call.setup.strip() and (result.flops_counted or result.bytes_counted):
            result.notes.append(SETUP_NOTE)
        result.magic = call.magic
        result.verbose = call.verbose
        return result

    def _finish(self, call: _CudaTimeCall, result: CudaTimeResult) -> CudaTimeResult | None:
        """Display the result (notes already shown left out), store and return it."""
        shell = self.shell
        assert shell is not None
        if not call.quiet:
            if not result.brief:  # the notes are shown: not again this session
                result.notes = [n for n in result.notes if _wording(n) not in self._notes_shown]
                self._notes_shown.update(_wording(n) for n in result.notes)
            display(result)
        if call.variable:
            shell.user_ns[call.variable] = result
        return result if call.output else None

    def _code(self, source: str, filename: str, where: tuple[int, int]) -> CodeType:
        assert self.shell is not None
        tree = parse_source(self.shell, source, filename, *where)
        return compile_source(self.shell, tree, filename, "exec")

    def _compile(
        self, body: str, filename: str, where: tuple[int, int], local_ns: dict[str, Any] | None
    ) -> Body:
        """The body as ``run(n)``: one function, its loop inside (as %timeit's template)."""
        shell: Any = self.shell
        tree = parse_source(shell, body, filename, *where)
        # Compile it alone first: code that is invalid at module level (`return`, `yield`)
        # must not become valid inside the template function (ipython/ipython#10636).
        compile_source(shell, tree, filename, "exec")
        if not tree.body:
            raise UsageError("%cudatime: the body has no statements to time")
        template = ast.parse(_TEMPLATE)
        function = template.body[0]
        assert isinstance(function, ast.FunctionDef)
        loop = function.body[0]
        assert isinstance(loop, ast.For)
        loop.body = tree.body
        ast.fix_missing_locations(template)
        namespace: dict[str, Any] = {}
        scope = shell.user_ns if not local_ns else {**shell.user_ns, **local_ns}
        exec(compile_source(shell, template, filename, "exec"), scope, namespace)
        each: Callable[[Iterator[None]], object] = namespace["__cudatime_body"]
        return Loops(each)


@dataclass(frozen=True)
class _CudaTimeCall:
    """One ``%cudatime``, parsed (as line_profiler's ``_ParseParamResult``): what runs,
    where it sits in the cell, and what becomes of the result."""

    options: TimingOptions
    setup: str
    body: str
    #: Where the setup and the body sit in the cell as filed: (line, column).
    setup_at: tuple[int, int]
    body_at: tuple[int, int]
    #: The magic's source, filed under the running cell's name.
    source: str
    #: ``%cudatime`` or ``%%cudatime``.
    magic: str
    quiet: bool  # -q
    verbose: bool  # --verbose
    output: bool  # -o
    variable: str | None  # -v


@dataclass(frozen=True)
class _Compiled:
    """The call's code, compiled once."""

    filename: str
    setup: CodeType
    run: Body
    compile_time: float


def _parse_call(parser: argparse.ArgumentParser, line: str, cell: str | None) -> _CudaTimeCall:
    """The options, the setup and the body; every usage error before anything runs."""
    args, rest, start = _parse(parser, line)
    options = _options(args)
    if cell is None:
        setup, body, body_at = "", rest, (0, len("%cudatime ") + start)
        source = f"%cudatime {line}"
    else:
        setup, body, body_at = rest, cell, (1, 0)
        source = f"%%cudatime {line}\n{cell}"
    if not body.strip():
        what = "a statement after the options" if cell is None else "a cell body"
        raise UsageError(f"%cudatime: nothing to time; give it {what}")
    return _CudaTimeCall(
        options=options,
        setup=setup,
        body=body,
        setup_at=(0, len("%%cudatime ") + start),
        body_at=body_at,
        source=source,
        magic="%cudatime" if cell is None else "%%cudatime",
        quiet=args.quiet,
        verbose=args.verbose,
        output=args.output,
        variable=args.variable,
    )


def _parse(parser: argparse.ArgumentParser, line: str) -> tuple[argparse.Namespace, str, int]:
    """Options up to the first token that is not one; the rest of the line verbatim,
    and where in ``line`` it starts."""
    takes_value = {
        option: action.nargs != 0 for action in parser._actions for option in action.option_strings
    }
    argv: list[str] = []
    position = 0
    expect_value = False
    while True:
        start = len(line) - len(line[position:].lstrip())
        if start >= len(line):
            position = len(line)
            break
        token, position = _token(line, start)
        if expect_value:
            # Attached, so that a value starting with '-' (--bytes -1GiB) stays a value.
            argv[-1] += ("=" if argv[-1].startswith("--") else "") + token
            expect_value = False
            continue
        if token == "--":
            break
        if not token.startswith("-") or token == "-" or token[1:2].isdigit():
            position = start
            break
        name = token.split("=", 1)[0] if token.startswith("--") else token[:2]
        if name in ("-t", "-c"):
            raise UsageError(
                f"%cudatime: {name} picks %timeit's host clock; %cudatime times GPU work with "
                "CUDA events and host work with time.perf_counter (as %timeit -t), so it "
                "takes no clock option"
            )
        if name not in takes_value:
            raise UsageError(
                f"%cudatime: unknown option {token!r} (see %cudatime?); put -- before a "
                "statement that starts with '-'"
            )
        argv.append(token)
        expect_value = takes_value[name] and token == name
    args = parser.parse_args(argv)  # MagicArgumentParser raises UsageError
    rest = line[position:]
    return args, rest.strip(), position + len(rest) - len(rest.lstrip())


def _token(line: str, start: int) -> tuple[str, int]:
    """One whitespace-separated token, quotes respected and stripped; and where it ends."""
    out = []
    quote = None
    i = start
    while i < len(line):
        char = line[i]
        if quote:
            if char == quote:
                quote = None
            else:
                out.append(char)
        elif char in "'\"":
            quote = char
        elif char.isspace():
            break
        else:
            out.append(char)
        i += 1
    return "".join(out), i


def _options(args: argparse.Namespace) -> TimingOptions:
    device, host_only = None, False
    # `cuda` is torch's name for the current CUDA device: the default, said aloud.
    if args.device is not None and args.device.strip().lower() != "cuda":
        try:
            where = f"%cudatime: --device {args.device!r}"
            spec = parse_device_spec(
                args.device, where=where, place="%cudatime", many=False, cpu=True
            )
        except DeviceSpecError as exc:
            raise UsageError(str(exc)) from None
        host_only = spec.cpu
        device = None if spec.indices is None else spec.indices[0]
    if args.variable is not None and (
        not args.variable.isidentifier() or keyword.iskeyword(args.variable)
    ):
        raise UsageError(
            f"%cudatime: -v {args.variable!r} is not a variable name; give a name such as -v result"
        )
    try:
        return TimingOptions(
            loops=args.loops or None,  # -n 0: choose, as %timeit does
            repeat=args.repeat,
            warmup=args.warmup,
            budget=args.budget,
            precision=args.precision,
            cold=args.cold,
            graph=args.graph,
            kernels=args.kernels,
            validate=args.validate,
            sync_check=args.sync_check,
            device=device,
            host_only=host_only,
            flops=None if args.flops is None else parse_amount(args.flops),
            bytes=None if args.bytes is None else parse_amount(args.bytes, sizes=True),
            count=not args.no_count,
            timer=args.timer,
            clock_outliers=args.clock_outliers,
            device_spec=None if args.device is None else args.device.strip(),
        )
    except ValueError as exc:
        raise UsageError(f"%cudatime: {exc}") from None


def _say(magic: str, text: str) -> None:
    """A line before a long wait, shown at once (the result comes after it)."""
    print(f"{magic}: {text}", flush=True)


def _label(body: str) -> str:
    """The output's title: the body's first line of code, without a trailing comment."""
    lines = [_uncommented(s.strip()) for s in body.strip().splitlines()]
    lines = [s for s in lines if s]
    text = lines[0] if lines else ""
    if len(lines) > 1:
        text += " …"
    return text if len(text) <= 70 else text[:69] + "…"


def _uncommented(line: str) -> str:
    """``line`` without its ``# comment`` (a ``#`` inside a string literal stays).

    A line that does not tokenize on its own (inside a triple-quoted string) is kept."""
    if "#" not in line:
        return line
    try:
        for token in tokenize.generate_tokens(io.StringIO(line).readline):
            if token.type == tokenize.COMMENT:
                return line[: token.start[1]].rstrip()
    except (tokenize.TokenError, SyntaxError):
        pass
    return line


#: What ``%load_ext gpumagic`` registers from this module.
MAGICS = CudaTimeMagics


def _wording(note: str) -> str:
    """A note's words without its numbers: the same note with other figures is not news."""
    return re.sub(r"\d+(?:[.,]\d+)*", "#", note)
