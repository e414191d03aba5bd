"""``scripts/howto_outputs.py --cells`` writes what a page's cells print into the page.

The how-to cells need a GPU; here the same rewriting runs on cells that need none.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import howto_outputs

PAGE = """\
<!-- outputs -->
The outputs below come from an old run.
<!-- /outputs -->

```ipython
x = 41
```

```ipython
print(x + 1)
```

On an NVIDIA H200 (another run, 2026-11-21):

```text
40
```

```python
print("not a cell")
```

```text
an output no cell made
```

```ipython
print(x - 40)
```

What this cell does, in prose that stays.

On an NVIDIA H100 (another run, 2026-11-25):

```text
old
```

```ipython
print("wide")
```

```{code-block} text
:class: wrap

old
```
"""
CELLS = ["x = 41\n", "print(x + 1)\n", "print(x - 40)\n", 'print("wide")\n']


def test_each_output_block_gets_what_its_cell_printed() -> None:
    printed = howto_outputs.run_cells(CELLS)
    assert printed == ["", "42\n", "1\n", "wide\n"]
    page = howto_outputs.with_outputs(PAGE, printed, "The outputs below come from here.")
    assert "```ipython\nprint(x + 1)\n```\n\n```text\n42\n```" in page
    assert "another run" not in page
    assert "```text\nan output no cell made\n```" in page
    assert "What this cell does, in prose that stays.\n\n```text\n1\n```" in page
    assert "```{code-block} text\n:class: wrap\n\nwide\n```" in page
    assert "<!-- outputs -->\nThe outputs below come from here.\n<!-- /outputs -->" in page
    assert "old" not in page


def test_a_failing_cell_stops_before_the_page_is_written() -> None:
    with pytest.raises(SystemExit, match="cell 2 failed"):
        howto_outputs.run_cells(["y = 1\n", "1 / 0\n"])


@pytest.mark.parametrize("page", ["time-a-kernel", "gpu-memory"])
def test_the_pages_with_recorded_cells_say_where_their_outputs_come_from(page: str) -> None:
    text = (howto_outputs.HOWTO / f"{page}.md").read_text()
    assert howto_outputs.PROVENANCE.search(text), page
