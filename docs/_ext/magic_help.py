"""``magic-help``: a magic's help exactly as ``%magic?`` shows it, read from the magic.

In a MyST page::

    ```{magic-help} gpumagic.timing_magics:CudaTimeMagics.cudatime
    ```

imports the module, looks up the method and renders its docstring, cleaned the way
IPython's inspector cleans it (``IPython.core.oinspect.getdoc``), as a literal block.
For magics declared with ``magic_arguments`` the docstring already holds the argparse
usage line and the option list, so the page cannot drift from ``%cudatime?``.

Importing a magics module imports IPython and gpumagic's pure core, never torch: the
directive works on a machine without a GPU and creates no CUDA context.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, ClassVar

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

if TYPE_CHECKING:
    from sphinx.application import Sphinx


def magic_help(target: str) -> str:
    """The help of ``module:Class.method`` as ``%magic?`` shows it (its "Docstring:" part)."""
    from IPython.core.oinspect import getdoc

    module_name, sep, path = target.partition(":")
    if not sep or not path:
        raise ValueError(f"{target!r}: expected module:Class.method")
    obj: Any = importlib.import_module(module_name)
    for name in path.split("."):
        obj = getattr(obj, name)
    doc = getdoc(obj)
    if not doc:
        raise ValueError(f"{target} has no docstring")
    return str(doc)


class MagicHelp(SphinxDirective):
    """``{magic-help} module:Class.method``: the magic's help as a literal block."""

    required_arguments = 1
    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {}

    def run(self) -> list[nodes.Node]:
        target = self.arguments[0]
        try:
            text = magic_help(target)
        except (ImportError, AttributeError, ValueError) as exc:
            raise self.error(f"magic-help {target}: {exc}") from None
        module = importlib.import_module(target.partition(":")[0])
        if module.__file__:
            self.env.note_dependency(module.__file__)
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        self.set_source_info(block)
        return [block]


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("magic-help", MagicHelp)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
