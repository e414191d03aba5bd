"""IPython glue for ``%lprun``: line_profiler's magic, with each line charged for the
GPU work it launched. Loading gpumagic replaces line_profiler's ``%lprun`` on purpose;
``%load_ext line_profiler`` afterwards brings the original back."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from IPython import display as _display
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from gpumagic.cell_code import compile_source, file_source, parse_source, show_from

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from types import CodeType

    from gpumagic.lineprof_result import LineProfileDisplay

__all__ = ["MAGICS", "LprunMagics"]

_LONG_OPTIONS = ("no-sync", "gpu", "memory")
display: Callable[..., None] = _display.display


@dataclass(frozen=True)
class _LprunCall:
    """One ``%lprun``, parsed (line_profiler's ``_ParseParamResult``): what runs, what
    is profiled, where the table goes."""

    statement: str
    functions: tuple[str, ...]  # -f
    modules: tuple[str, ...]  # -m
    stats_files: tuple[str, ...]  # -D
    text_files: tuple[str, ...]  # -T
    output_unit: float | None  # -u
    stripzeros: bool  # -s / -z
    return_profiler: bool  # -r
    sync: bool
    gpu: bool
    memory: bool


@magics_class
class LprunMagics(Magics):
    """``%lprun``, synchronized when CUDA is in use."""

    @line_cell_magic
    def lprun(self, parameter_s: str = "", cell: str | None = None) -> Any:
        """Line-profile a statement; each line is charged for the GPU work it launched.

        Usage::

            %lprun [-f func] [-m module] [-D file] [-T file] [-r] [-s] [-z] [-u unit]
                   [--no-sync] [--gpu] [--memory] <statement>

            %%lprun [options]
            <statements run as the profiled code: the whole cell>

        line_profiler's ``%lprun`` options and table, plus: when the process uses CUDA,
        every device with a context is synchronized at each line boundary of the
        profiled functions (never during CUDA graph capture), so a line's time
        includes the GPU work it launched instead of landing on a later ``.item()``.
        gpumagic's own cost is subtracted and a statement over several lines counts
        once. With no CUDA in use it behaves like line_profiler's ``%lprun``.

        Options:

        ``-f <function>``: profile this function, method, property, class, partial or
        ``nn.Module`` (its ``forward``); repeatable. Any expression, without spaces.

        ``-m <module>``: profile every function of this module.

        ``-D <file>``: save the statistics as a ``.lprof`` file (read it with
        ``python -m line_profiler <file>``).

        ``-T <file>``: save the text table.

        ``-r``: return the profiler (a ``line_profiler.LineProfiler``; its
        ``get_stats()``/``print_stats()``/``dump_stats()`` give the same numbers, and
        ``.result()`` gpumagic's per-line GPU and memory figures).

        ``-s`` / ``-z``: leave out functions that never ran.

        ``-u <seconds>``: the time unit of the text table (e.g. ``1e-3``).

        ``--no-sync``: do not synchronize (host times only, as line_profiler).

        ``--gpu``: add GPU-time columns: torch.profiler (CUPTI) records every kernel,
        copy and memset, on any stream, and after the run each is charged to the line
        that launched it (no CUDA event and no wait per line). *GPU Time* includes the
        profiled functions the line called (*Self*: what it launched itself);
        backward kernels are charged to the forward line that built their graph node
        (*Bwd*); a CUDA-graph replay to the replay line. Also counts, per line, the
        synchronizing calls where the host waited for the GPU (``.item()``,
        ``.cpu()``, printing a tensor, ``nonzero()``).

        ``--memory``: add the change of allocated CUDA memory per line and the peak
        above the line's start while it ran (from the allocator's counters).

        Output is displayed (HTML with time bars, and the text table), not paged.
        """
        call = self._parse(parameter_s, cell)
        try:
            filename, code = self._compile(call.statement, parameter_s, cell)
        except SyntaxError as exc:
            raise _not_runnable(exc) from None  # the user's line and caret, one frame
        return self._finish(call, *self._run(call, filename, code))

    def _parse(self, parameter_s: str, cell: str | None) -> _LprunCall:
        """The options and the statement, every usage error raised before anything runs."""
        # line_profiler's quoting, so that statements behave exactly as under its %lprun.
        parameter_s = parameter_s.replace('"', r"\"").replace("'", r"\"")
        try:
            opts, statement = self.parse_options(
                parameter_s, "rszf:m:D:T:u:", *_LONG_OPTIONS, list_all=True
            )
        except UsageError as exc:
            raise UsageError(f"%lprun: {exc}") from None
        if cell is not None:
            if statement.strip():
                raise UsageError(
                    "%%lprun takes only options on its first line; the cell is what runs, "
                    f"not {statement.strip()!r}"
                )
            statement = cell
        if not statement.strip():
            raise UsageError("%lprun needs a statement to run, e.g. %lprun -f step step(x)")
        for letter in ("D", "T"):
            for raw in opts.get(letter, []):
                _check_output_file(letter, raw)
        return _LprunCall(
            statement=statement,
            functions=tuple(opts.get("f", [])),
            modules=tuple(opts.get("m", [])),
            stats_files=tuple(opts.get("D", [])),
            text_files=tuple(opts.get("T", [])),
            output_unit=_output_unit(opts.get("u")),
            stripzeros="z" in opts or "s" in opts,
            return_profiler="r" in opts,
            sync="no-sync" not in opts,
            gpu="gpu" in opts,
            memory="memory" in opts,
        )

    def _run(
        self, call: _LprunCall, filename: str, code: CodeType
    ) -> tuple[Any, str | None, BaseException | None]:
        """Profile the statement (``code``, filed as ``filename``): the profiler,
        line_profiler's message for an exit or Ctrl-C, and the statement's error (its
        traceback already shown)."""
        from gpumagic.lineprof import GpuLineProfiler, patched_builtins_profile
        from gpumagic.lineprof_install import ProfilerBusy

        assert self.shell is not None
        profiler = GpuLineProfiler(sync=call.sync, gpu=call.gpu, memory=call.memory)
        self._add_targets(profiler, call)
        message = None
        failure: BaseException | None = None
        try:
            with patched_builtins_profile(profiler):
                profiler.runctx(code, self.shell.user_global_ns, self.shell.user_ns)
        except (SystemExit, KeyboardInterrupt) as exc:
            message = f"{type(exc).__name__} exception caught in code being profiled."
        except ProfilerBusy as exc:
            raise UsageError(str(exc)) from None
        except Exception as exc:  # shown with the profile, then raised to the user
            show_from(exc, filename, self.shell)
            failure = exc
        finally:
            profiler.restore_code()
        return profiler, message, failure

    def _finish(
        self,
        call: _LprunCall,
        profiler: Any,
        message: str | None,
        failure: BaseException | None,
    ) -> Any:
        """Display the table, save the files, then raise the statement's error."""
        from gpumagic.lineprof_result import LineProfileDisplay

        result = profiler.result(message)
        view = LineProfileDisplay(
            result,
            call.output_unit,
            stripzeros=call.stripzeros,
            cells=self._cell_names(label[0] for label in result.stats.timings),
        )
        display(view)
        _save(profiler, view, call)
        if message:
            print("\n*** " + message)
        if failure is not None:
            raise failure
        return profiler if call.return_profiler else None

    def _compile(self, statement: str, line: str, cell: str | None) -> tuple[str, Any]:
        """The statement compiled under the running cell's name, placed where it sits in
        the cell, so that a traceback, or a syntax error's caret, shows the user's line.
        A statement that cannot run is an error before anything is profiled."""
        assert self.shell is not None
        if cell is not None:
            source, where = f"%%lprun {line}\n{cell}", (1, 0)
        elif statement.strip() and line.rstrip().endswith(statement.strip()):
            column = len("%lprun ") + len(line.rstrip()) - len(statement.strip())
            source, where = f"%lprun {line}", (0, column)
            statement = statement.strip()
        else:  # line_profiler's quoting changed it: the statement as it runs
            source, where = statement, (0, 0)
        filename = file_source(self.shell, source)
        tree = parse_source(self.shell, statement, filename, *where)
        return filename, compile_source(self.shell, tree, filename, "exec")

    def _cell_names(self, filenames: Iterable[str]) -> dict[str, str]:
        """``{filename: "In[2]"}`` for the files that are notebook or terminal cells."""
        assert self.shell is not None
        compiler: Any = self.shell.compile
        found = {}
        for filename in filenames:
            named = compiler.format_code_name(filename)
            if named is not None:
                found[filename] = str(named[1])
        return found

    def _add_targets(self, profiler: Any, call: _LprunCall) -> None:
        """Resolve ``-f`` expressions and ``-m`` modules in the user's namespace."""
        assert self.shell is not None
        namespace = self.shell.user_ns
        for expression in call.functions:
            try:
                target = eval(expression, self.shell.user_global_ns, namespace)
            except Exception as exc:
                raise UsageError(
                    f"Could not find function {expression}.\n{type(exc).__name__}: {exc}"
                ) from None
            try:
                profiler.add_target(target, name=expression)
            except TypeError:
                raise UsageError(
                    f"-f {expression}: {type(target).__name__!r} objects are not code to profile; "
                    "give a function, method, property, class, partial or nn.Module"
                ) from None
        for module_name in call.modules:
            try:
                module = __import__(module_name, fromlist=[""])
            except Exception as exc:
                raise UsageError(
                    f"Could not find module {module_name}.\n{type(exc).__name__}: {exc}"
                ) from None
            profiler.add_module(module)


def _not_runnable(exc: SyntaxError) -> Exception:
    """What to raise for a statement that does not compile: the syntax error itself,
    without our frames (IPython shows the line and a caret), or a usage error that says
    how to profile a coroutine."""
    if "await" in str(exc.msg):
        return UsageError(
            "%lprun runs its statement with exec, where top-level await is not "
            "allowed: wrap it, e.g. %lprun -f acoro asyncio.run(acoro(10))"
        )
    return exc.with_traceback(None)


def _check_output_file(letter: str, raw: str) -> None:
    """``-D`` / ``-T`` name a file that can be written, not the next option."""
    if raw.startswith("-"):
        raise UsageError(
            f"-{letter} takes a file name, got {raw!r}: put the file name right after -{letter}"
        )
    parent = Path(raw).expanduser().parent
    if not parent.is_dir():
        raise UsageError(f"-{letter} {raw}: there is no directory {str(parent)!r}")


def _output_unit(values: list[str] | None) -> float | None:
    if not values:
        return None
    try:
        unit = float(values[-1])
    except ValueError:
        raise UsageError(
            f"-u takes the time unit in seconds, e.g. -u 1e-3; got {values[-1]!r}"
        ) from None
    if not (unit > 0 and math.isfinite(unit)):
        raise UsageError(
            f"-u takes a positive time unit in seconds, e.g. -u 1e-3; got {values[-1]!r}"
        )
    return unit


def _save(profiler: Any, view: LineProfileDisplay, call: _LprunCall) -> None:
    for raw in call.stats_files:
        profiler.dump_stats(Path(raw))
        print(f"\n*** Profile stats pickled to file {raw!r}.")
    for raw in call.text_files:
        Path(raw).write_text(view.text + "\n", encoding="utf-8")
        print(f"\n*** Profile printout saved to text file {raw!r}.")


#: What ``%load_ext gpumagic`` registers from this module.
MAGICS = LprunMagics
