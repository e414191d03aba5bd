"""The demo notebook: in step with ``examples/demo.py`` and run by a real Jupyter kernel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "demo.ipynb"


def load_demo() -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpumagic_demo", ROOT / "examples" / "demo.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_notebook_is_generated_from_the_demo_script() -> None:
    demo = load_demo()
    assert NOTEBOOK.read_text() == demo.notebook_json(), (  # type: ignore[attr-defined]
        "examples/demo.ipynb is stale: run `python examples/demo.py --write-notebook`"
    )


@pytest.mark.xdist_group("demo_notebook")  # one worker executes the notebook, once
def test_notebook_runs_in_a_real_kernel(executed_demo: dict[str, object]) -> None:
    cells = [c for c in executed_demo["cells"] if c["cell_type"] == "code"]  # type: ignore[attr-defined, index]
    assert cells
    for cell in cells:
        errors = [o for o in cell["outputs"] if o["output_type"] == "error"]
        assert not errors, (cell["source"], errors)
        # Terminal-style text never carries HTML.
        for output in cell["outputs"]:
            text = output.get("text") or output.get("data", {}).get("text/plain", "")
            assert "<table" not in text
            assert "<div" not in text


def test_demo_script_runs_end_to_end() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py")],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "=== Where this runs" in result.stdout
    assert "passed" in result.stdout
    from gpumagic import cuda

    status = cuda.status()
    if not status.available:
        # The reason is said where it matters, not once per cell and skipped test; the
        # GPU-only cells show the recorded GPU output, labelled.
        assert result.stdout.count(status.reason) <= 3, result.stdout
        # Recorded where docs/demo-gpu.ipynb was last executed (its metadata says).
        import json

        recorded = json.loads((ROOT / "docs" / "demo-gpu.ipynb").read_text())["metadata"]
        device, executed = recorded["gpumagic"]["device"], recorded["gpumagic"]["executed"]
        assert f"[recorded on {device}, {executed}: this machine has no GPU]" in result.stdout
        assert f"%%gpumem In[4] · cuda:0 {device}" in result.stdout
    else:
        assert "[recorded on" not in result.stdout


def test_the_docs_notebook_says_where_and_when_it_ran() -> None:
    """The demo page shows its outputs' device and date (they were only in the
    notebook's metadata; issue 29): ``scripts/run-notebook.py`` stamps its first cell."""
    import json

    book = json.loads((ROOT / "docs" / "demo-gpu.ipynb").read_text())
    info = book["metadata"]["gpumagic"]
    first = "".join(book["cells"][0]["source"])
    assert f"Outputs executed on {info['device']} ({info['versions']}), {info['executed']}." in (
        first
    )
