"""The user's code as the magics run it: filed under the running cell's own name,
through the shell's input and AST transformers, with tracebacks that start in it.

``%cudatime`` compiles its body into a function and ``%%gpumem`` runs its cell here,
the way ``%%time`` does: in the user's namespace, the value of a last expression
shown as the cell's output, an exception raised exactly as without the magic. (IPython
glue, imported only by the magic modules.)
"""

from __future__ import annotations

import ast
import contextlib
import linecache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import CodeType, TracebackType

    from IPython.core.interactiveshell import InteractiveShell

__all__ = [
    "cell_number",
    "cell_syntax_error",
    "compile_source",
    "file_source",
    "parse_source",
    "run_cell_body",
    "show_from",
]


def cell_number(shell: InteractiveShell) -> int:
    """``N`` of the ``In[N]`` being run. IPython counts ``execution_count`` up before
    it runs a cell, so during a cell it already names the next one."""
    running = shell.displayhook.exec_result
    count = running.execution_count if running is not None else None
    return int(count) if count is not None else int(shell.execution_count)


def file_source(shell: InteractiveShell, source: str) -> str:
    """Register ``source`` in linecache under the running cell's name
    (``<ipython-input-N-…>``, or the kernel's cell file); returns that name, so that
    tracebacks and ``inspect`` show the cell the user sees."""
    name: str = shell.compile.cache(source, cell_number(shell))
    return name


def parse_source(
    shell: InteractiveShell, source: str, filename: str, offset: int, column: int = 0
) -> ast.Module:
    """``source`` through the shell's input and AST transformers, its lines numbered
    ``offset`` further (the body of a cell magic starts on the cell's second line) and
    its first line ``column`` characters to the right (a line magic's statement starts
    after the magic's name and options). A ``SyntaxError`` points there too, so the
    user sees their line and a caret under the error, as for a cell of their own."""
    any_shell: Any = shell
    try:
        parsed = any_shell.compile.ast_parse(any_shell.transform_cell(source), filename)
    except SyntaxError as exc:
        _move(exc, filename, offset, column)
        raise
    tree: ast.Module = any_shell.transform_ast(parsed)
    if column:
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) == 1:
                node.col_offset += column  # type: ignore[attr-defined]
                if getattr(node, "end_lineno", None) == 1:
                    node.end_col_offset += column  # type: ignore[attr-defined]
    ast.increment_lineno(tree, offset)
    return tree


def _move(exc: SyntaxError, filename: str, offset: int, column: int) -> None:
    """``exc``, found in a magic's body, placed in the cell as the user sees it."""
    if exc.lineno is None:
        return
    if exc.lineno == 1 and exc.offset is not None:
        exc.offset += column
    if exc.end_lineno == 1 and exc.end_offset is not None:
        exc.end_offset += column
    exc.lineno += offset
    if exc.end_lineno is not None:
        exc.end_lineno += offset
    exc.filename = filename
    exc.text = linecache.getline(filename, exc.lineno) or exc.text


def cell_syntax_error(exc: BaseException, shell: InteractiveShell) -> SyntaxError | None:
    """``exc`` without its traceback, if it is a syntax error in a cell's own source
    (found while compiling it, not raised by code the cell ran). Raised again from a
    magic, IPython shows it as a cell's: the line and a caret, after only the frames
    that called the magic."""
    if not isinstance(exc, SyntaxError) or not isinstance(exc.filename, str):
        return None
    compiler: Any = shell.compile
    if compiler.format_code_name(exc.filename) is None:
        return None
    return exc.with_traceback(None)


def compile_source(
    shell: InteractiveShell, tree: ast.Module | ast.Expression, filename: str, mode: str
) -> CodeType:
    """Compile with the shell's compiler (its ``__future__`` flags carry over)."""
    compiler: Any = shell.compile
    code: CodeType = compiler(tree, filename, mode)
    return code


def run_cell_body(shell: InteractiveShell, source: str, filename: str, offset: int) -> None:
    """Run a cell magic's body as the cell itself: in the user's namespace, the value of
    a last expression displayed as the cell's output (``Out[N]``, ``_``), an exception
    raised to the caller with a traceback that starts in the cell (:func:`show_from`)."""
    namespace = shell.user_ns
    try:
        tree = parse_source(shell, source, filename, offset)
        last: ast.Expression | None = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body[-1].value)
            tree.body.pop()
        exec(compile_source(shell, tree, filename, "exec"), namespace)
        if last is not None:
            value = eval(compile_source(shell, last, filename, "eval"), namespace)
            shell.displayhook(value)
    except BaseException as exc:
        show_from(exc, filename, shell)
        raise


def show_from(exc: BaseException, filename: str, shell: InteractiveShell) -> None:
    """Make IPython show ``exc``'s traceback from the user's code (``filename``) on,
    not through the magic's own frames; a ``KeyboardInterrupt`` that landed outside the
    user's code is shown alone. (IPython shows a ``SyntaxError`` its own way: see
    :func:`cell_syntax_error`.)"""
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    if tb is None and not isinstance(exc, KeyboardInterrupt):
        return  # our own error: shown whole
    start = tb

    def render() -> list[str]:
        if start is None:  # Ctrl-C between the user's lines: where it landed is ours
            formatter: Any = shell.InteractiveTB
            only: list[str] = formatter.get_exception_only(type(exc), exc)
            return only
        lines: list[str] = shell.InteractiveTB.structured_traceback(
            type(exc), exc, start, tb_offset=0
        )
        return lines

    # An exception type with __slots__ refuses the attribute: IPython then shows it all.
    with contextlib.suppress(AttributeError):
        exc._render_traceback_ = render  # type: ignore[attr-defined]
