"""``pytest-help``, ``pytest-markers``, ``pytest-fixtures``: pytest_cuda's part of
``pytest --help``, ``pytest --markers`` and ``pytest --fixtures -v``, generated at build
time so the docs cannot drift from what pytest prints.

Each runs pytest once per build (cached) in a fresh process, in an empty temporary
directory with an empty ``pytest.ini`` (so no project configuration applies), with only
pytest_cuda loaded (``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 -p pytest_cuda.plugin``; other
installed plugins cannot change the output), ``PYTEST_*`` variables removed and
``COLUMNS=80``, then keeps pytest_cuda's part:

``{pytest-help}``
    The option group whose options start with ``--cuda-`` (its title included) and
    pytest_cuda's ini options. ``:options: --cuda-leak-check --cuda-leak-trace`` keeps
    only those entries.
``{pytest-markers}``
    The ``@pytest.mark.cuda…`` lines: each signature, then its text wrapped to 88
    columns below it. ``:markers: cuda_sync``
    keeps only those.
``{pytest-fixtures}``
    The fixtures defined by ``pytest_cuda`` modules, with their docstrings (file paths
    left out). ``:fixtures: cuda_device cuda_devices`` keeps only those.
``{pytest-option-sections}``
    One section per option (``:kind: options``) or ini key (``:kind: ini``) of that
    ``pytest --help`` text: its usage as the title, its help as a paragraph, and a label
    other pages link to (``{ref}`option-cuda-leak-check```, ``{ref}`ini-cuda-devices```;
    see :func:`option_label`). Another option, ini key or environment variable named in
    a help text links to its section (the environment variables' sections, labelled by
    :func:`env_label`, are written on the page itself).

A name given in an option that pytest does not print is a build error. None of this
discovers devices or imports torch: ``--help``, ``--markers`` and ``--fixtures`` in an
empty directory use no CUDA feature.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx import addnodes
from sphinx.util.docutils import SphinxDirective

if TYPE_CHECKING:
    from collections.abc import Callable

    from sphinx.application import Sphinx

WIDTH = 80
MARKER_WIDTH = 88


@functools.cache
def pytest_output(*args: str) -> str:
    """What ``pytest <args>`` prints with only pytest_cuda loaded, in an empty directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(
        COLUMNS=str(WIDTH),
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
        PYTHONDONTWRITEBYTECODE="1",
        NO_COLOR="1",
    )
    env.pop("FORCE_COLOR", None)
    env.pop("PY_COLORS", None)
    command = [sys.executable, "-m", "pytest", "-p", "pytest_cuda.plugin"]
    command += ["-p", "no:cacheprovider", *args]
    with tempfile.TemporaryDirectory(prefix="pytest-help-") as tmp:
        Path(tmp, "pytest.ini").write_text("[pytest]\n")
        proc = subprocess.run(
            command, cwd=tmp, env=env, capture_output=True, text=True, timeout=120, check=False
        )
    if proc.returncode not in (0, 5):  # 5: no tests collected (--fixtures)
        raise RuntimeError(
            f"{' '.join(command)} exited with {proc.returncode}:\n{proc.stdout}{proc.stderr}"
        )
    return proc.stdout


def _blocks(lines: list[str]) -> list[list[str]]:
    """Split at blank lines, dropping empty blocks."""
    blocks: list[list[str]] = [[]]
    for line in lines:
        if line.strip():
            blocks[-1].append(line.rstrip())
        elif blocks[-1]:
            blocks.append([])
    return [b for b in blocks if b]


def _entries(lines: list[str], indent: int) -> list[list[str]]:
    """Group help lines into entries: an entry starts at exactly ``indent`` spaces."""
    entries: list[list[str]] = []
    for line in lines:
        starts = len(line) - len(line.lstrip(" ")) == indent
        if starts or not entries:
            entries.append([line])
        else:
            entries[-1].append(line)
    return entries


def _entry_name(entry: list[str]) -> str:
    return re.split(r"[\s=,]", entry[0].strip(), maxsplit=1)[0]


def _cuda_groups(text: str) -> list[list[str]]:
    """The option groups of ``pytest --help`` that hold ``--cuda-*`` options."""
    groups = [
        b
        for b in _blocks(text.splitlines())
        if b[0].endswith(":")
        and not b[0].startswith(" ")
        and any(line.startswith("  --cuda-") for line in b[1:])
    ]
    if not groups:
        raise ValueError("pytest --help shows no option group with --cuda-* options")
    return groups


def cuda_help(options: list[str] | None = None) -> str:
    """pytest_cuda's option group and ini options from ``pytest --help``.

    With ``options`` (option names such as ``--cuda-require``, ini names such as
    ``cuda_devices``), only those entries, in pytest's order and layout.
    """
    text = pytest_output("--help")
    groups = _cuda_groups(text)
    heading, ini = _ini_options(text)
    if not options:
        parts = ["\n".join(g) for g in groups]
        if ini:
            parts.append("\n".join([heading, *(line for e in ini for line in e)]))
        return "\n\n".join(parts)
    flags = [e for g in groups for e in _entries(g[1:], 2)]
    known = {_entry_name(e) for e in flags + ini}
    missing = [o for o in options if o not in known]
    if missing:
        raise ValueError(f"pytest --help shows no {', '.join(missing)}")
    wanted = set(options)
    parts = ["\n".join(line for e in flags if _entry_name(e) in wanted for line in e)]
    ini_kept = [line for e in ini if _entry_name(e) in wanted for line in e]
    if ini_kept:
        parts.append("\n".join([heading, *ini_kept]))
    return "\n\n".join(p for p in parts if p)


def _ini_options(text: str) -> tuple[str, list[list[str]]]:
    """pytest's configuration-options heading and pytest_cuda's entries under it."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("[pytest] ")), None)
    if start is None:
        return "", []
    section: list[str] = []
    for line in lines[start + 1 :]:
        if line.strip() and not line.startswith(" "):
            break
        section.append(line.rstrip())
    entries = _entries([line for line in section if line], 2)
    return lines[start], [e for e in entries if _entry_name(e).startswith("cuda")]


class OptionEntry(NamedTuple):
    """One entry of pytest_cuda's part of ``pytest --help``."""

    name: str  # --cuda-sync, cuda_devices
    usage: str  # --cuda-sync={launch-blocking,per-op}, cuda_devices (string)
    help: str  # the help text on one line
    kind: str  # "option" or "ini"

    @property
    def label(self) -> str:
        return option_label(self.name, self.kind)


#: Environment variables named in the help texts, linked to their sections (labels from
#: :func:`env_label`, which the page documenting them must define).
ENV_LINKED = ("PYTEST_CUDA_DEVICES", "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING")


def env_label(name: str) -> str:
    """The docs label of an environment variable: ``env-pytest-cuda-devices``."""
    return "env-" + name.replace("_", "-").lower()


def option_label(name: str, kind: str = "option") -> str:
    """The docs label of an option or ini key: ``option-cuda-leak-check``,
    ``ini-cuda-devices``."""
    return f"{kind}-{name.lstrip('-').replace('_', '-').lower()}"


def _entry(lines: list[str], kind: str) -> OptionEntry:
    usage, _, first = lines[0].strip().partition("  ")
    words = [first.strip(), *(line.strip() for line in lines[1:])]
    usage = usage.rstrip(":")
    return OptionEntry(_entry_name(lines), usage, " ".join(w for w in words if w), kind)


def cuda_option_entries() -> list[OptionEntry]:
    """Every ``--cuda-*`` option, then every ``cuda*`` ini key, as ``pytest --help``
    shows them (in its order)."""
    text = pytest_output("--help")
    groups = _cuda_groups(text)
    flags = [_entry(e, "option") for g in groups for e in _entries(g[1:], 2)]
    _, ini = _ini_options(text)
    return flags + [_entry(e, "ini") for e in ini]


def cuda_markers(names: list[str] | None = None) -> str:
    """The ``@pytest.mark.cuda…`` lines of ``pytest --markers``, wrapped."""
    found: dict[str, str] = {}
    for line in pytest_output("--markers").splitlines():
        match = re.match(r"@pytest\.mark\.(cuda\w*)", line)
        if match:
            found[match.group(1)] = line.rstrip()
    if not found:
        raise ValueError("pytest --markers shows no cuda markers")
    if names:
        missing = [n for n in names if n not in found]
        if missing:
            raise ValueError(f"pytest --markers shows no {', '.join(missing)}")
        found = {n: found[n] for n in names}
    return "\n\n".join(_marker_entry(line) for line in found.values())


def _marker_entry(line: str) -> str:
    """``@pytest.mark.x(args): text`` as the signature, then the text wrapped below it."""
    signature, _, description = line.partition(": ")
    body = textwrap.fill(
        description,
        width=MARKER_WIDTH,
        initial_indent="    ",
        subsequent_indent="    ",
        break_long_words=False,
        break_on_hyphens=False,
    )
    return f"{signature}:\n{body}"


def cuda_fixtures(names: list[str] | None = None) -> str:
    """The fixtures pytest_cuda defines, from ``pytest --fixtures -v``, without file paths."""
    lines = pytest_output("--fixtures", "-v").splitlines()
    found: dict[str, list[str]] = {}
    ours = False
    for line in lines:
        section = re.match(r"-+ fixtures defined from (\S+) -+$", line)
        if section:
            ours = section.group(1).split(".")[0] == "pytest_cuda"
            continue
        if line.startswith("="):
            ours = False
        if not ours:
            continue
        if line and not line.startswith(" "):
            header = line.split(" -- ", 1)[0]
            found[header.split()[0]] = [header]
        elif found:
            found[list(found)[-1]].append(line.rstrip())
    if not found:
        raise ValueError("pytest --fixtures shows no fixtures from pytest_cuda")
    if names:
        missing = [n for n in names if n not in found]
        if missing:
            raise ValueError(f"pytest --fixtures shows no {', '.join(missing)}")
        found = {n: found[n] for n in names}
    return "\n\n".join("\n".join(body).rstrip() for body in found.values())


def _names(argument: str) -> list[str]:
    return argument.split()


class _PytestText(SphinxDirective):
    """A literal block made by one of the functions above."""

    has_content = False
    make: ClassVar[Callable[[list[str] | None], str]]
    filter_option: ClassVar[str]

    def run(self) -> list[nodes.Node]:
        names = self.options.get(self.filter_option)
        try:
            text = type(self).make(names)
        except (ValueError, RuntimeError, subprocess.SubprocessError) as exc:
            raise self.error(f"{self.name}: {exc}") from None
        import pytest_cuda

        for source in sorted(Path(pytest_cuda.__file__).parent.glob("*.py")):
            self.env.note_dependency(str(source))
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        self.set_source_info(block)
        return [block]


class PytestHelp(_PytestText):
    make = staticmethod(cuda_help)
    filter_option = "options"
    option_spec: ClassVar[dict[str, Any]] = {"options": _names}


class PytestMarkers(_PytestText):
    make = staticmethod(cuda_markers)
    filter_option = "markers"
    option_spec: ClassVar[dict[str, Any]] = {"markers": _names}


class PytestFixtures(_PytestText):
    make = staticmethod(cuda_fixtures)
    filter_option = "fixtures"
    option_spec: ClassVar[dict[str, Any]] = {"fixtures": _names}


_OPTION_NAME = re.compile(rf"--cuda-[a-z-]+[a-z]|\bcuda_devices\b|\b(?:{'|'.join(ENV_LINKED)})\b")


class PytestOptionSections(SphinxDirective):
    """``{pytest-option-sections}``: a labelled section per option or ini key."""

    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {
        "kind": lambda arg: directives.choice(arg, ("options", "ini")),
    }

    def run(self) -> list[nodes.Node]:
        kind = "ini" if self.options.get("kind") == "ini" else "option"
        try:
            every = cuda_option_entries()
        except (ValueError, RuntimeError, subprocess.SubprocessError) as exc:
            raise self.error(f"{self.name}: {exc}") from None
        import pytest_cuda

        for source in sorted(Path(pytest_cuda.__file__).parent.glob("*.py")):
            self.env.note_dependency(str(source))
        labels = {e.name: e.label for e in every}
        labels.update({name: env_label(name) for name in ENV_LINKED})
        sections: list[nodes.Node] = []
        for entry in (e for e in every if e.kind == kind):
            section = nodes.section(ids=[entry.label], names=[entry.label])
            section += nodes.title("", "", nodes.literal(entry.usage, entry.usage))
            section += nodes.paragraph("", "", *self._linked(entry.help, labels, entry.name))
            self.set_source_info(section)
            self.state.document.note_explicit_target(section)
            sections.append(section)
        return sections

    @staticmethod
    def _linked(text: str, labels: dict[str, str], own: str) -> list[nodes.Node]:
        """``text`` with every other option or ini name in it as a link to its section."""
        parts: list[nodes.Node] = []
        at = 0
        for match in _OPTION_NAME.finditer(text):
            name = match.group(0)
            if name not in labels:
                continue
            parts.append(nodes.Text(text[at : match.start()]))
            literal = nodes.literal(name, name)
            if name == own:
                parts.append(literal)
            else:
                parts.append(
                    addnodes.pending_xref(
                        "",
                        literal,
                        refdomain="std",
                        reftype="ref",
                        reftarget=labels[name],
                        refexplicit=True,
                        refwarn=True,
                    )
                )
            at = match.end()
        parts.append(nodes.Text(text[at:]))
        return parts


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("pytest-help", PytestHelp)
    app.add_directive("pytest-markers", PytestMarkers)
    app.add_directive("pytest-fixtures", PytestFixtures)
    app.add_directive("pytest-option-sections", PytestOptionSections)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
