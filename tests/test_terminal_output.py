"""Terminal output stays plain text and aligned: no HTML leaks into IPython in a terminal
or into pytest's logs.

The magics display results with HTML *and* text; a terminal shows only the text. Here
every magic runs in a real IPython shell whose display publisher and display hook print
``text/plain`` to stdout, as the terminal's do, in a real ``ipython`` process reading an
``.ipy`` file, and the plugin's reports are read from pytest's own terminal output. On a
machine with a GPU the same cells run on it (the GPU renderings are checked too).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING

import pytest

from ipython_shell import fresh_shell

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from IPython.core.interactiveshell import InteractiveShell

# Tags our HTML renderings use (and common ones): none may reach a terminal.
HTML_TAG = re.compile(
    r"</?(?:table|thead|tbody|tr|td|th|div|span|style|pre|code|svg|rect|script|b|i|br|p|"
    r"small|strong|em|details|summary|a|html|body)\b[^<>]*>",
    re.IGNORECASE,
)
ESCAPES = ("&lt;", "&gt;", "&amp;", "&nbsp;", "&#")
FAST = "-n 20 -r 3 -w 2"

SETUP = """\
import torch
device = "cuda" if torch.cuda.is_available() else "cpu"
x = torch.randn(256, 256, device=device)

def step(a):
    b = a @ a
    return b.sum().item()
"""

CELLS = (
    f"%cudatime {FAST} x @ x",
    f"%cudatime --kernels --sync-check {FAST} x.sum().item()",
    f"%%cudatime {FAST} w = torch.randn(256, 256, device=device)\ny = x @ w",
    f"r = %cudatime -q -o {FAST} x @ x\nr",
    f"r = %cudatime -q -o {FAST} x @ x\nimport gpumagic\ngpumagic.compare(r, r, labels=['a', 'b'])",
    "%gpumem",
    "%gpumem --top 3",
    "%%gpumem\nz = torch.ones(1024, device=device)",
    "%gpumem -o",
    "%lprun -f step step(x)",
    "%lprun -f step --gpu --memory step(x)",
)


def assert_plain(text: str) -> None:
    assert text.strip(), "no output at all"
    tag = HTML_TAG.search(text)
    assert tag is None, f"HTML in terminal output: {tag.group(0)!r} in\n{text}"
    for escape in ESCAPES:
        assert escape not in text, f"HTML escape {escape!r} in terminal output:\n{text}"
    assert "\x1b[" not in text, f"terminal colour codes in plain output:\n{text}"


@pytest.fixture
def shell() -> Iterator[InteractiveShell]:
    """A fresh, real ``InteractiveShell`` with gpumagic loaded and the setup run."""
    with fresh_shell() as ip:
        ip.run_line_magic("load_ext", "gpumagic")
        assert ip.run_cell(SETUP).success
        yield ip


@pytest.mark.parametrize("cell", CELLS, ids=[c.splitlines()[0] for c in CELLS])
def test_each_magic_prints_plain_text(
    shell: InteractiveShell, capfd: pytest.CaptureFixture[str], cell: str
) -> None:
    capfd.readouterr()
    result = shell.run_cell(cell, store_history=True)
    out, err = capfd.readouterr()
    assert result.success, (cell, out, err)
    assert_plain(out)
    assert HTML_TAG.search(err) is None, err


def _value_columns(text: str) -> set[int]:
    """Where the value column starts on the labelled rows of a ``%cudatime`` report."""
    columns = set()
    for line in text.splitlines()[1:]:
        match = re.match(r"^  ([a-zA-Z][a-zA-Z ]*?) {2,}(\S)", line)
        if match:
            columns.add(match.start(2))
    return columns


def test_cudatime_rows_are_aligned(
    shell: InteractiveShell, capfd: pytest.CaptureFixture[str]
) -> None:
    capfd.readouterr()
    assert shell.run_cell(f"%cudatime --kernels --verbose {FAST} x @ x").success
    out = capfd.readouterr().out
    assert len(_value_columns(out)) == 1, out


def test_lprun_table_columns_line_up(
    shell: InteractiveShell, capfd: pytest.CaptureFixture[str]
) -> None:
    capfd.readouterr()
    assert shell.run_cell("%lprun -f step step(x)").success
    lines = capfd.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("Line #"))
    assert set(lines[header + 1]) == {"="}
    assert len(lines[header + 1]) == len(lines[header])
    # Each number ends where its column's title ends: Line #, Hits, Time, Per Hit, % Time.
    titles = [m.end() for m in re.finditer(r"Line #|Hits|Per Hit|% Time|Time", lines[header])]
    assert len(titles) == 5, lines[header]
    rows = [line for line in lines[header + 2 :] if re.match(r"^\s+\d+\s+\d+\s", line)]
    assert len(rows) == 2, lines
    for row in rows:
        assert [m.end() for m in re.finditer(r"\S+", row)][:5] == titles, (row, lines[header])


def test_compare_columns_line_up(shell: InteractiveShell) -> None:
    import gpumagic

    assert shell.run_cell(f"r = %cudatime -q -o {FAST} x @ x").success
    r = shell.user_ns["r"]
    table = str(gpumagic.compare(r, r, labels=["eager", "again"]))
    lines = table.splitlines()
    starts = [m.start() for m in re.finditer(r"(?<=  )\S", lines[0])]
    for line in lines[1:]:
        for start in starts:
            assert line[start - 2 : start] == "  ", (start, table)
            assert line[start] != " ", (start, table)


def test_a_real_terminal_ipython(tmp_path: Path) -> None:
    """``ipython cells.ipy``: IPython's terminal application prints every result as text."""
    script = tmp_path / "cells.ipy"
    script.write_text(
        "%load_ext gpumagic\n"
        + SETUP
        + "\n".join(
            (
                f"%cudatime --kernels {FAST} x @ x",
                f"r = %cudatime -q -o {FAST} x @ x",
                "display(r)",
                "%gpumem --top 3",
                "%lprun -f step --gpu --memory step(x)",
            )
        )
        + "\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "IPython", "--no-banner", "--colors=nocolor", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert result.stdout.count("%cudatime  x @ x") == 2, output
    assert "gpumem" in result.stdout, output
    assert "Line #" in result.stdout, output
    assert_plain(output)


SUITE = textwrap.dedent(
    """
    import pytest
    import torch

    _kept = []


    def test_on_the_cpu():
        assert torch.ones(3).sum().item() == 3


    @pytest.mark.cuda(min_memory="1TiB")
    def test_needs_a_terabyte():
        pass


    @pytest.mark.cuda
    @pytest.mark.cuda_leak_check
    def test_leaks_a_block():
        _kept.append(torch.ones(1024, device="cuda"))


    @pytest.mark.cuda
    def test_fails_on_the_gpu():
        assert torch.zeros(1, device="cuda").item() == 1
    """
)


def test_pytest_reports_are_plain_text(pytester: pytest.Pytester) -> None:
    """The plugin's header, skip reasons, leak and memory reports in pytest's log."""
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess(
        "-v", "-rA", "--cuda-leak-check", "--cuda-leak-trace", "--cuda-memory-report", "3"
    )
    text = result.stdout.str() + result.stderr.str()
    assert "test_on_the_cpu PASSED" in text
    assert result.ret in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED), text
    assert "INTERNALERROR" not in text
    assert_plain(text)
