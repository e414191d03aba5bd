"""Run one how-to page as a reader would and record what it prints.

    python scripts/howto_outputs.py distributed OUT_FILE
    python scripts/howto_outputs.py time-a-kernel --cells

With ``OUT_FILE``: writes the page's files into a fresh folder, runs each ``$ `` command
there, and appends ``$ command``, its output and exit status to ``OUT_FILE``: the
transcripts that pages quote come from this, on the machine the page names.

With ``--cells``: runs the page's ``ipython`` cells in order in one fresh IPython shell
and writes what each printed into the page itself, in place of the ``text`` block that
follows the cell (a cell without one keeps none). The sentence between
``<!-- outputs -->`` and ``<!-- /outputs -->`` is rewritten to name this machine's
device, torch and date, and a paragraph ``On ...:`` that named another run for one
block is dropped. A cell that fails stops the script and the page is left as it was.
Run it where the page's cells run (the how-to cells need a GPU), then review the diff.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_howto import read_page

HOWTO = Path(__file__).resolve().parents[1] / "docs" / "howto"
BLOCK = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
OUTPUT = re.compile(r"^(?:text|\{code-block\} text)$")
PROVENANCE = re.compile(r"<!-- outputs -->.*?<!-- /outputs -->", re.S)
ONE_RUN = re.compile(r"On [^\n]+(?:\n[^\n]+)*:\Z")


def run_commands(page: str, out: Path) -> None:
    """Each ``$ `` command of ``page``, its output and exit status, appended to ``out``."""
    content = read_page(HOWTO / f"{page}.md")
    with tempfile.TemporaryDirectory(prefix=f"howto-{page}-") as folder:
        for name, text in content.files.items():
            (Path(folder) / name).write_text(text)
        env = dict(os.environ)
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
        with out.open("a") as log:
            for command in content.commands:
                result = subprocess.run(
                    ["bash", "-c", command],
                    cwd=folder,
                    capture_output=True,
                    text=True,
                    env=env,
                    check=False,
                )
                output = (result.stdout + result.stderr).replace(folder, ".")
                log.write(f"$ {command}\n{output}[exit status {result.returncode}]\n\n")


def run_cells(cells: list[str]) -> list[str]:
    """What each cell printed, run in order in one fresh IPython shell."""
    from IPython.core.interactiveshell import InteractiveShell

    InteractiveShell.clear_instance()
    shell = InteractiveShell.instance()
    printed: list[str] = []
    try:
        for number, cell in enumerate(cells, 1):
            with contextlib.redirect_stdout(io.StringIO()) as out:
                result = shell.run_cell(cell, store_history=True)
            if not result.success:
                error = result.error_before_exec or result.error_in_exec
                raise SystemExit(f"cell {number} failed ({error!r}):\n{cell}{out.getvalue()}")
            printed.append(out.getvalue())
    finally:
        InteractiveShell.clear_instance()
    return printed


def provenance() -> str:
    """This machine's device, torch and today's date, as a page names them."""
    import torch

    if torch.cuda.is_available():
        device = f"an {torch.cuda.get_device_name(0)}"
        versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    else:
        device, versions = "a machine without a GPU", f"torch {torch.__version__}"
    return (
        f"The outputs below come from {device} ({versions}) on {datetime.date.today()}, "
        f"recorded with `python scripts/howto_outputs.py PAGE --cells`."
    )


def with_outputs(text: str, printed: list[str], said: str) -> str:
    """``text`` with the output block after each cell (prose between them allowed, no
    other block) holding what that cell printed; a last paragraph ``On ...:`` before
    the block, which named another run, is dropped."""
    parts: list[str] = []
    at = 0
    cell = -1
    cell_end: int | None = None
    for block in BLOCK.finditer(text):
        info = block["info"].strip()
        if info == "ipython":
            cell, cell_end = cell + 1, block.end()
            continue
        if cell_end is None or not OUTPUT.match(info):
            cell_end = None
            continue
        prose = [p for p in text[cell_end : block.start()].strip().split("\n\n") if p]
        if prose and ONE_RUN.match(prose[-1]):
            prose.pop()
        options = re.match(r"(?::[^\n]*\n)*\n?", block["body"]) if "{" in info else None
        head = options.group(0) if options else ""
        output = "\n".join(line.rstrip() for line in printed[cell].strip("\n").splitlines())
        if not output:
            raise SystemExit(f"cell {cell + 1} printed nothing, and the page shows an output")
        kept = "".join(f"\n\n{p}" for p in prose)
        parts += [text[at:cell_end], f"{kept}\n\n```{block['info']}\n{head}{output}\n```"]
        at, cell_end = block.end(), None
    parts.append(text[at:])
    updated = "".join(parts)
    if not PROVENANCE.search(updated):
        raise SystemExit("the page has no <!-- outputs --> ... <!-- /outputs --> sentence")
    return PROVENANCE.sub(f"<!-- outputs -->\n{said}\n<!-- /outputs -->", updated)


def update_page(page: str) -> None:
    """Run ``page``'s cells and write their outputs into it."""
    path = HOWTO / f"{page}.md"
    text = path.read_text()
    path.write_text(with_outputs(text, run_cells(read_page(path).cells), provenance()))


if __name__ == "__main__":
    if sys.argv[2:] == ["--cells"]:
        update_page(sys.argv[1])
    else:
        run_commands(sys.argv[1], Path(sys.argv[2]))
