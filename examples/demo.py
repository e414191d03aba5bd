"""gpumagic's demo: the magics in a real IPython shell, then the plugin on a sample suite.

Run it with ``make demo``. Without a GPU everything runs on the CPU and says so.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gpumagic import cuda

HERE = Path(__file__).parent

# Each demo step: a title and the IPython cells it runs. Features add theirs here.
CELLS: list[tuple[str, list[str]]] = [
    ("Load the extension", ["%load_ext gpumagic"]),
]


def banner(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 70 - len(text)))


def run_magics() -> None:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    for title, cells in CELLS:
        banner(title)
        for cell in cells:
            print("".join(f"In  > {line}\n" for line in cell.splitlines()), end="")
            result = shell.run_cell(cell, store_history=True)
            if not result.success:
                raise SystemExit(f"demo cell failed: {cell!r}")


def run_sample_suite() -> int:
    banner("pytest with the pytest_cuda plugin on examples/sample_suite")
    return subprocess.call(
        [
            sys.executable,
            "-m",
            "pytest",
            "-rs",
            "-p",
            "no:cacheprovider",
            str(HERE / "sample_suite"),
        ]
    )


def main() -> int:
    status = cuda.status()
    banner("Where this runs")
    if status.available:
        print(status.summary())
        for device in status.devices:
            print("  cuda:" + device.describe())
    else:
        print(f"No GPU here ({status.reason}): the demo runs on the CPU.")
    run_magics()
    return run_sample_suite()


if __name__ == "__main__":
    raise SystemExit(main())
