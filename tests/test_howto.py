"""The how-to guides run as written: each how-to's commands, as a reader would type them.

Each page under ``docs/howto/`` is read the way a person follows it:

* a ``{code-block} python`` with a ``:caption:`` is a file to save under that name;
* every ``$ `` line of a ``console`` block is a shell command, run in a directory that
  holds the page's files;
* the ``ipython`` blocks are cells, run in order in one fresh IPython shell.

Without a GPU the commands still run (their tests skip with the reason); commands that
name more devices than the machine has are skipped here with that reason; the IPython
cells need a GPU (they say ``device="cuda"``). On a GPU the commands' outcomes are
checked too (a leak is reported, the culprit of a device-side assert is named).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from gpumagic import cuda
from ipython_shell import fresh_shell

HOWTO = Path(__file__).resolve().parents[1] / "docs" / "howto"
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```$", re.MULTILINE | re.DOTALL)


class Page(NamedTuple):
    files: dict[str, str]
    commands: list[str]
    cells: list[str]


def read_page(path: Path) -> Page:
    files: dict[str, str] = {}
    commands: list[str] = []
    cells: list[str] = []
    for match in FENCE.finditer(path.read_text()):
        kind, body = match.group(1), match.group(2)
        if kind == "{code-block}":
            caption = re.match(r":caption: (\S+)\n\n", body)
            if caption:
                files[caption.group(1)] = body[caption.end() :]
        elif kind == "console":
            commands += [line[2:] for line in body.splitlines() if line.startswith("$ ")]
        elif kind == "ipython":
            cells.append(body)
    return Page(files, commands, cells)


PAGES = {path.stem: read_page(path) for path in sorted(HOWTO.glob("*.md"))}
COMMANDS = [(name, command) for name, page in PAGES.items() for command in page.commands]

TORCHRUN = "torchrun --standalone --nproc-per-node=2 -m pytest --cuda-ranks=env test_multinode.py"

# What the commands must show on a machine with a GPU (fragments of their output).
# Expected exit status (None: any failure) and fragments of the output, on a GPU.
ON_GPU: dict[str, tuple[int | None, tuple[str, ...]]] = {
    "pytest --cuda-leak-check test_leaky.py": (
        1,
        ("LEAKED test_leaky.py::test_remembers_its_batch", "1 leaked"),
    ),
    "pytest --cuda-leak-check --cuda-leak-trace test_leaky.py::test_remembers_its_batch": (
        1,
        ("test_leaky.py:9 in test_remembers_its_batch",),
    ),
    "pytest --cuda-leak-check test_fixed.py": (0, ("2 passed",)),
    "pytest test_indexing.py": (1, ("left a sticky CUDA error", "1 failed, 1 passed")),
    "pytest --cuda-rerun-blocking test_indexing.py": (
        1,
        ("re-run alone in a fresh process with CUDA_LAUNCH_BLOCKING=1: failed",),
    ),
    "pytest --cuda-sync=per-op test_indexing.py": (
        1,
        ("raised by the synchronize right after aten.index.Tensor",),
    ),
    "pytest --cuda-devices=0,1 test_ddp.py": (0, ("3 passed",)),
    "pytest --cuda-devices=0,1 test_broken.py": (
        1,
        (
            "test_rank1_raises: rank 1 of 2 failed: ValueError: bad shard at test_broken.py:10",
            "test_rank0_skips_the_collective: timed out after 20 s (cuda_distributed timeout): "
            "rank 1 never finished",
            "2 failed",
        ),
    ),
    "pytest test_ddp_logic.py": (0, ("1 passed",)),
    "pytest -n 1 --cuda-devices=0,1 --cuda-devices-per-worker=2 test_ddp.py": (0, ("3 passed",)),
    TORCHRUN: (0, ("3 passed",)),
    # The device-side assert aborts the process under the sanitizer (exit 6 on an H200).
    "PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer pytest 'test_indexing.py::test_gather'": (
        None,
        ("COMPUTE-SANITIZER", "ERROR SUMMARY"),
    ),
}

# Commands whose tests need no GPU (gloo ranks): what they show on a machine without one.
ON_CPU: dict[str, tuple[int, tuple[str, ...]]] = {
    "pytest test_ddp_logic.py": (0, ("1 passed",)),
    TORCHRUN: (0, ("2 passed, 1 skipped", "cuda ranks: 2 started by torchrun")),
}


def test_every_guide_has_commands_or_cells() -> None:
    assert set(PAGES) == {
        "device-side-assert",
        "distributed",
        "fix-a-leak",
        "gpu-memory",
        "multi-gpu",
        "multi-node",
        "time-a-kernel",
    }
    for name, page in PAGES.items():
        assert page.commands or page.cells, name
        for command in page.commands:
            named = re.findall(r"\b(test_\w+\.py)", command)
            assert set(named) <= set(page.files), (name, command, page.files)


def devices_needed(command: str) -> int:
    """How many GPUs a command asks for by index (``--cuda-devices=0,1``) or group size."""
    need = 0
    for indices in re.findall(r"--cuda-devices=([\d,]+)", command):
        need = max(need, *(int(i) + 1 for i in indices.split(",")))
    for per_worker in re.findall(r"--cuda-devices-per-worker=(\d+)", command):
        need = max(need, int(per_worker))
    if command == TORCHRUN and cuda.status().available:
        need = max(need, 2)  # one GPU per rank where its NCCL test runs
    return need


@pytest.mark.parametrize(("page", "command"), COMMANDS, ids=[c for _, c in COMMANDS])
def test_command_runs_as_written(page: str, command: str, tmp_path: Path) -> None:
    argv = shlex.split(command)
    program = next(word for word in argv if "=" not in word)
    bindir = str(Path(sys.executable).parent)
    path = bindir + os.pathsep + os.environ.get("PATH", "")
    if shutil.which(program, path=path) is None:
        pytest.skip(f"{program} is not installed here")
    status = cuda.status()
    have = len(status.devices) if status.available else 0
    need = devices_needed(command)
    if need > have:
        pytest.skip(f"{command!r} needs {need} GPU(s), this machine has {have}")
    for name, text in PAGES[page].files.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PATH"] = path
    env.pop("GPUMAGIC_GPU_CHECK", None)
    result = subprocess.run(
        ["bash", "-c", command],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = result.stdout + result.stderr
    # The reader's own files' output, for the page to quote (on the GPU check).
    keep_transcript(f"howto_{page}_" + re.sub(r"\W+", "_", command).strip("_"), output)
    assert "INTERNALERROR" not in output, output
    assert "UsageError" not in output, output
    assert not re.search(r"^ERROR: ", output, re.MULTILINE), output
    if have == 0 and command in ON_CPU:
        returncode, fragments = ON_CPU[command]
        assert result.returncode == returncode, output
        for fragment in fragments:
            assert fragment in output, (fragment, output)
        return
    if have == 0:
        # The other tests of the guides need a GPU: here they skip, with the reason.
        assert result.returncode == 0, output
        assert "skipped" in output, output
        return
    expected = ON_GPU.get(command)
    if expected is None:
        assert result.returncode in (0, 1), output
        return
    returncode, fragments = expected
    if returncode is None:
        assert result.returncode != 0, output
    else:
        assert result.returncode == returncode, output
    for fragment in fragments:
        assert fragment in output, (fragment, output)


def keep_transcript(name: str, text: str) -> None:
    """Write ``text`` to ``name.txt`` in the folder ``GPUMAGIC_DOC_OUTPUTS`` names, when
    it is set: the transcripts the pages quote, from the machine that ran them (the GPU
    check)."""
    if folder := os.environ.get("GPUMAGIC_DOC_OUTPUTS"):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{name}.txt").write_text(text)


CELL_PAGES = [name for name, page in PAGES.items() if page.cells]


@pytest.mark.cuda
@pytest.mark.parametrize("page", CELL_PAGES)
def test_ipython_cells_run_as_written(page: str) -> None:
    transcript: list[str] = []
    with fresh_shell() as shell:
        try:
            for number, cell in enumerate(PAGES[page].cells, 1):
                with contextlib.redirect_stdout(io.StringIO()) as printed:
                    result = shell.run_cell(cell, store_history=True)
                sys.stdout.write(printed.getvalue())
                transcript.append(f"In [{number}]: {cell}\n{printed.getvalue()}")
                assert result.success, (page, cell, result.error_before_exec, result.error_in_exec)
        finally:
            keep_transcript(f"howto_{page}_cells", "\n".join(transcript))
            shell.run_line_magic("unload_ext", "gpumagic")
