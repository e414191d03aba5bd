"""Execute a notebook with a real Jupyter kernel (nbclient) and save it with its outputs.

    python scripts/run-notebook.py examples/demo.ipynb OUT.ipynb

Stops at the first cell that raises, printing the error. The device and date are written
into the notebook's metadata (``gpumagic``), so docs can say where outputs came from.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import nbformat
from nbclient import NotebookClient


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook")
    parser.add_argument("output")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args()
    book = nbformat.read(args.notebook, as_version=4)
    client = NotebookClient(book, timeout=args.timeout, kernel_name="python3", allow_errors=False)
    client.execute()
    from gpumagic import cuda

    status = cuda.status()
    book.metadata["gpumagic"] = {
        "executed": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": ", ".join(d.name for d in status.devices) or f"CPU ({status.reason})",
        "versions": status.summary(),
    }
    stamp(book)
    nbformat.write(book, args.output)
    print(f"executed {args.notebook} -> {args.output} on {book.metadata['gpumagic']['device']}")
    return 0


STAMP = "Outputs executed on "


def stamp(book: nbformat.NotebookNode) -> None:
    """Say on the page (the first cell) where and when the outputs were made, from the
    notebook's ``gpumagic`` metadata; a stamp already there is replaced."""
    info = book.metadata["gpumagic"]
    line = f"{STAMP}{info['device']} ({info['versions']}), {info['executed']}."
    first = book.cells[0]
    kept = [part for part in first.source.split("\n\n") if not part.startswith(STAMP)]
    first.source = "\n\n".join([*kept, line])


if __name__ == "__main__":
    sys.exit(main())
