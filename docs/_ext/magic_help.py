"""``magic-help``: a magic's help exactly as ``%magic?`` shows it, read from the magic.

In a MyST page::

    ```{magic-help} gpumagic.timing_magics:CudaTimeMagics.cudatime
    ```

imports the module, looks up the method and renders its docstring, cleaned the way
IPython's inspector cleans it (``IPython.core.oinspect.getdoc``), as a literal block.
For magics declared with ``magic_arguments`` the docstring already holds the argparse
usage line and the option list, so the page cannot drift from ``%cudatime?``.

``{magic-option-sections} module:Class.method`` makes one section per option of the
magic instead: its usage as the title, its help as a paragraph, and a label other pages
link to (``{ref}`cudatime-option-kernels```, ``{ref}`gpumem-option-top```,
``{ref}`lprun-option-f```; see :func:`magic_options`). The options come from the
magic's argparse parser (``magic_arguments``), or, for a magic that parses its options
itself (``%lprun``), from the ````-x ...``: help`` paragraphs under ``Options:`` in its
docstring, which is what ``%lprun?`` shows.

Importing a magics module imports IPython and gpumagic's pure core, never torch: the
directive works on a machine without a GPU and creates no CUDA context.
"""

from __future__ import annotations

import argparse
import importlib
import re
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeVar

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

if TYPE_CHECKING:
    from collections.abc import Callable

    from sphinx.application import Sphinx

T = TypeVar("T")


class MagicOption(NamedTuple):
    """One option of a magic, as its help shows it."""

    label: str  # cudatime-option-kernels
    usage: str  # --kernels, --top N, -f <function>
    help: str


def _resolve(target: str) -> Any:
    module_name, sep, path = target.partition(":")
    if not sep or not path:
        raise ValueError(f"{target!r}: expected module:Class.method")
    obj: Any = importlib.import_module(module_name)
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def magic_options(target: str) -> list[MagicOption]:
    """Every option of the magic at ``module:Class.method``, in its help's order.

    Labels are ``<magic>-option-<name>``: the longest option string without its dashes
    (``--sync-check`` gives ``cudatime-option-sync-check``, ``-n`` ``cudatime-option-n``),
    or the argument's name for a positional (``gpumem-option-action``).
    """
    magic = target.rpartition(".")[2]
    parser = getattr(_resolve(target), "parser", None)
    if isinstance(parser, argparse.ArgumentParser):
        found = _argparse_options(magic, parser)
    else:
        found = _docstring_options(magic, magic_help(target))
    # Sphinx lowercases labels: -D is lprun-option-d. Two options must not share one.
    found = [o._replace(label=o.label.lower()) for o in found]
    labels = [o.label for o in found]
    if len(set(labels)) != len(labels):
        raise ValueError(f"%{magic}: two options share a label: {labels}")
    return found


def _argparse_options(magic: str, parser: argparse.ArgumentParser) -> list[MagicOption]:
    formatter = parser._get_formatter()
    found: list[MagicOption] = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        help_text = " ".join(formatter._expand_help(action).split()) if action.help else ""
        if action.option_strings:
            name = max(action.option_strings, key=len)
            usage = ", ".join(action.option_strings)
            if action.nargs != 0:
                usage += f" {action.metavar or action.dest.upper()}"
        else:
            name = action.dest
            usage = " | ".join(map(str, action.choices or [])) or action.dest
        found.append(MagicOption(f"{magic}-option-{name.lstrip('-')}", usage, help_text))
    return found


_DOC_OPTION = re.compile(r"^``(?P<usage>-[^`]+)``(?: / ``(?P<more>-[^`]+)``)?: (?P<help>.*)")


def _docstring_options(magic: str, doc: str) -> list[MagicOption]:
    _, found_options, rest = doc.partition("\nOptions:\n")
    if not found_options:
        raise ValueError(f"%{magic}: no argparse parser and no 'Options:' in its help")
    found: list[MagicOption] = []
    for paragraph in rest.split("\n\n"):
        match = _DOC_OPTION.match(" ".join(paragraph.split()))
        if not match:
            continue
        usage = match["usage"] + (f", {match['more']}" if match["more"] else "")
        name = match["usage"].split()[0].lstrip("-")
        found.append(MagicOption(f"{magic}-option-{name}", usage, match["help"]))
    if not found:
        raise ValueError(f"%{magic}: no ``-x``: paragraphs under 'Options:' in its help")
    return found


def magic_help(target: str) -> str:
    """The help of ``module:Class.method`` as ``%magic?`` shows it (its "Docstring:" part)."""
    from IPython.core.oinspect import getdoc

    doc = getdoc(_resolve(target))
    if not doc:
        raise ValueError(f"{target} has no docstring")
    return str(doc)


def _read(directive: SphinxDirective, name: str, read: Callable[[str], T]) -> T:
    """``read(target)`` for the directive's ``module:Class.method`` argument, the
    module's file noted as a dependency of the page; a bad target is the directive's
    error."""
    target = directive.arguments[0]
    try:
        found = read(target)
    except (ImportError, AttributeError, ValueError) as exc:
        raise directive.error(f"{name} {target}: {exc}") from None
    module = importlib.import_module(target.partition(":")[0])
    if module.__file__:
        directive.env.note_dependency(module.__file__)
    return found


class MagicHelp(SphinxDirective):
    """``{magic-help} module:Class.method``: the magic's help as a literal block."""

    required_arguments = 1
    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {}

    def run(self) -> list[nodes.Node]:
        text = _read(self, "magic-help", magic_help)
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        self.set_source_info(block)
        return [block]


class MagicOptionSections(SphinxDirective):
    """``{magic-option-sections} module:Class.method``: a labelled section per option."""

    required_arguments = 1
    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {}

    def run(self) -> list[nodes.Node]:
        options = _read(self, "magic-option-sections", magic_options)
        sections: list[nodes.Node] = []
        for option in options:
            section = nodes.section(ids=[option.label], names=[option.label])
            section += nodes.title("", "", nodes.literal(option.usage, option.usage))
            section += _paragraph(option.help)
            self.set_source_info(section)
            self.state.document.note_explicit_target(section)
            sections.append(section)
        return sections


_INLINE_LITERAL = re.compile(r"``([^`]+)``")


def _paragraph(text: str) -> nodes.paragraph:
    """``text`` as a paragraph, its ````literal```` parts as code."""
    parts: list[nodes.Node] = []
    at = 0
    for match in _INLINE_LITERAL.finditer(text):
        parts.append(nodes.Text(text[at : match.start()]))
        parts.append(nodes.literal(match[1], match[1]))
        at = match.end()
    parts.append(nodes.Text(text[at:]))
    return nodes.paragraph("", "", *parts)


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("magic-help", MagicHelp)
    app.add_directive("magic-option-sections", MagicOptionSections)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
