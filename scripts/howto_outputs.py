"""Run one how-to page's commands as a reader would and write their outputs to a file.

    python scripts/howto_outputs.py distributed OUT_FILE

Writes the page's files into a fresh folder, runs each ``$ `` command there, and appends
``$ command``, its output and exit status to OUT_FILE: the transcripts that pages quote
come from this, on the machine the page names.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_howto import read_page


def main(page: str, out: Path) -> None:
    content = read_page(Path(__file__).resolve().parents[1] / "docs" / "howto" / f"{page}.md")
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


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
