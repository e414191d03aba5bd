"""gpumagic's demo: the magics in a real IPython shell, then the plugin on a sample suite.

Run it with ``make demo``. Without a GPU, the cells that time work run on the CPU; the
GPU-only ones (``%gpumem``, ``--kernels``) show what they showed on a GPU instead,
recorded in ``docs/demo-gpu.ipynb`` and labelled as such.

``CELLS`` is the one source of the demo: ``examples/demo.ipynb`` is generated from it
(``python examples/demo.py --write-notebook``) and executed by a real Jupyter kernel in
the test suite, and on the GPU machine for the docs.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from gpumagic import cuda

HERE = Path(__file__).parent
RECORDED = HERE.parent / "docs" / "demo-gpu.ipynb"
#: Cells that only say "no CUDA here" without a GPU: there, the recorded output instead.
GPU_ONLY = ("%gpumem", "%%gpumem", "%cudatime --kernels")

# Each demo step: a title and the IPython cells it runs. Features add theirs here.
CELLS: list[tuple[str, list[str]]] = [
    ("Load the extension", ["%load_ext gpumagic"]),
    (
        "GPU memory: %gpumem and %%gpumem",
        [
            "%gpumem",
            "import torch\n\ndevice = 'cuda' if torch.cuda.is_available() else 'cpu'",
            "%%gpumem --trace\n"
            "weights = torch.randn(1024, 1024, device=device)\n"
            "scratch = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)\n"
            "del scratch",
            "%gpumem --top 5",
            "%%gpumem --timeline\n"
            "kept = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)\n"
            "tmp = torch.empty(2**30, dtype=torch.uint8, device=device)\n"
            "del tmp",
        ],
    ),
    (
        "Line profiling with the GPU work on the line that launched it: %lprun",
        [
            "import torch\n\n"
            "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
            "a = torch.randn(2048, 2048, device=device)\n"
            "b = torch.randn(2048, 2048, device=device)\n\n"
            "def step(a, b):\n"
            "    c = a @ b\n"
            "    return c.sum().item()",
            "%lprun -f step --gpu --memory step(a, b)",
        ],
    ),
    (
        "Timing GPU work correctly: %cudatime",
        [
            "import torch\n\n"
            "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
            "x = torch.randn(1024, 1024, device=device)",
            "%%cudatime w = torch.randn(1024, 1024, device=device)\ny = x @ w",
            "%cudatime --kernels --sync-check x.sum().item()",
            "n = 4096 if device == 'cuda' else 512\n"
            "xb = torch.randn(n, n, device=device, dtype=torch.bfloat16)",
            "%cudatime xb @ xb",
        ],
    ),
]


def banner(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 70 - len(text)))


def recorded_outputs() -> tuple[str, dict[str, str]]:
    """Where ``docs/demo-gpu.ipynb`` was run, and each cell's text output there."""
    import json

    book = json.loads(RECORDED.read_text())
    texts = {}
    for cell in book["cells"]:
        if cell["cell_type"] != "code":
            continue
        text = "".join(
            "".join(out.get("data", {}).get("text/plain", "")) for out in cell.get("outputs", ())
        )
        texts["".join(cell["source"])] = text
    meta = book["metadata"].get("gpumagic", {})
    return f"{meta.get('device', 'a GPU')}, {meta.get('executed', '')}".rstrip(", "), texts


def run_magics(gpu: bool) -> None:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    where, recorded = recorded_outputs() if not gpu else ("", {})
    for title, cells in CELLS:
        banner(title)
        for cell in cells:
            print("".join(f"In  > {line}\n" for line in cell.splitlines()), end="")
            if not gpu and cell.startswith(GPU_ONLY) and recorded.get(cell):
                print(f"[recorded on {where}: this machine has no GPU]")
                print(recorded[cell])
                continue
            result = shell.run_cell(cell, store_history=True)
            if not result.success:
                raise SystemExit(f"demo cell failed: {cell!r}")


def run_sample_suite() -> int:
    banner("pytest with the pytest_cuda plugin on examples/sample_suite")
    # -rs would repeat the no-GPU reason for every skipped test; the header says it once.
    return subprocess.call(
        [
            sys.executable,
            "-m",
            "pytest",
            "-rN",
            "-p",
            "no:cacheprovider",
            str(HERE / "sample_suite"),
        ]
    )


def notebook_json() -> str:
    """The demo as a Jupyter notebook (no outputs): a Markdown title per step, then its cells."""
    import nbformat

    book = nbformat.v4.new_notebook()
    book.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    book.cells.append(
        nbformat.v4.new_markdown_cell(
            "# gpumagic demo\n\nGenerated from `examples/demo.py` (`CELLS`); "
            "without a GPU the magics run on the CPU and say so.",
            id="title",
        )
    )
    for i, (title, cells) in enumerate(CELLS):
        book.cells.append(nbformat.v4.new_markdown_cell(f"## {title}", id=f"step-{i}"))
        for j, cell in enumerate(cells):
            book.cells.append(nbformat.v4.new_code_cell(cell, id=f"step-{i}-{j}"))
    return str(nbformat.writes(book)) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write-notebook",
        nargs="?",
        const=str(HERE / "demo.ipynb"),
        metavar="PATH",
        help="write the demo as a notebook (default examples/demo.ipynb) and exit",
    )
    args = parser.parse_args()
    if args.write_notebook:
        Path(args.write_notebook).write_text(notebook_json())
        return 0
    status = cuda.status()
    banner("Where this runs")
    if status.available:
        print(status.summary())
        for device in status.devices:
            print("  cuda:" + device.describe())
    else:
        print(
            f"No GPU here ({status.reason}): the timing cells run on the CPU, the GPU-only "
            "cells show a recorded GPU output, and the sample suite's GPU tests skip."
        )
    run_magics(status.available)
    return run_sample_suite()


if __name__ == "__main__":
    raise SystemExit(main())
