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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import CodeType, TracebackType

    from IPython.core.interactiveshell import InteractiveShell

__all__ = [
    "cell_number",
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


def parse_source(shell: InteractiveShell, source: str, filename: str, offset: int) -> ast.Module:
    """``source`` through the shell's input and AST transformers, its lines numbered
    ``offset`` further (the body of a cell magic starts on the cell's second line)."""
    any_shell: Any = shell
    tree: ast.Module = any_shell.transform_ast(
        any_shell.compile.ast_parse(any_shell.transform_cell(source), filename)
    )
    ast.increment_lineno(tree, offset)
    return tree


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
    not through the magic's own frames. (IPython shows a ``SyntaxError`` its own way;
    filed under the running cell's name, it names that cell.)"""
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    if tb is None:
        return
    start = tb

    def render() -> list[str]:
        lines: list[str] = shell.InteractiveTB.structured_traceback(
            type(exc), exc, start, tb_offset=0
        )
        return lines

    # An exception type with __slots__ refuses the attribute: IPython then shows it all.
    with contextlib.suppress(AttributeError):
        exc._render_traceback_ = render  # type: ignore[attr-defined]
