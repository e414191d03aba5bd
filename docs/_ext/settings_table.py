"""``{settings-table}``: every pytest_cuda option, ini key and environment variable in
one table, with its default, generated when the docs are built.

The options and ini keys, and what each does, are those ``pytest --help`` prints with
only pytest_cuda loaded (:func:`pytest_help.cuda_option_entries`); each default is the
one pytest_cuda's parser declares (``pytest_cuda.options.add_options`` run against a
fresh pytest parser). The environment variables are :data:`ENVIRONMENT`;
``tests/test_docs_ext.py`` checks it against the variables the code reads. Each name
links to its section on the configuration page.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from docutils import nodes
from pytest_help import cuda_option_entries
from sphinx import addnodes
from sphinx.util.docutils import SphinxDirective

if TYPE_CHECKING:
    from sphinx.application import Sphinx


class Setting(NamedTuple):
    """One row: ``name`` as written, its kind, its default as shown, what it does, and
    the label of its section."""

    name: str
    kind: str  # "option", "ini" or "env"
    default: str
    what: str
    label: str


#: The environment variables pytest_cuda and gpumagic read: the names sharing a section
#: of the configuration page, that section's label, what each does. Not set is the
#: default of every one.
ENVIRONMENT: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (
        ("PYTEST_CUDA_DEVICES",),
        "env-pytest-cuda-devices",
        "the devices a run may use, as --cuda-devices takes them",
    ),
    (
        ("CUDA_VISIBLE_DEVICES",),
        "env-cuda-visible-devices",
        "CUDA's own: the devices this process sees; every device index counts within them",
    ),
    (
        ("CUDA_LAUNCH_BLOCKING",),
        "env-cuda-launch-blocking",
        "CUDA's own: 1 makes every launch wait for its kernel",
    ),
    (
        ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"),
        "env-torchinductor-cache-dir",
        "torch.compile's and triton's caches: frames there count as library code",
    ),
    (
        ("LINE_PROFILER_CORE",),
        "env-line-profiler-core",
        "line_profiler's own: legacy makes %lprun's hook a trace function",
    ),
    (
        (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TORCHELASTIC_USE_AGENT_STORE",
            "TORCHELASTIC_RESTART_COUNT",
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "SLURM_LOCALID",
            "SLURM_NTASKS_PER_NODE",
            "SLURM_TASKS_PER_NODE",
            "SLURM_NODEID",
            "SLURM_RESTART_COUNT",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
            "OMPI_COMM_WORLD_NODE_RANK",
        ),
        "env-rank",
        "a launcher's rank variables: read under --cuda-ranks=env; set in each rank process",
    ),
    (
        ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"),
        "env-socket-ifname",
        "the ranks' network interface: kept when set, else the loopback interface",
    ),
)


def shown_default(value: object) -> str:
    """A parser default as the table shows it."""
    if value is None or value == "":
        return "not set"
    if value is False:
        return "off"
    if value is True:
        return "on"
    return str(value)


def parser_defaults() -> dict[str, object]:
    """Each option's and ini key's default, as pytest_cuda's parser declares it."""
    from _pytest.config.argparsing import Parser

    from pytest_cuda.options import add_options

    parser = Parser(_ispytest=True)
    add_options(parser)
    found: dict[str, object] = {}
    for group in parser._groups:
        for option in group.options:
            found[max(option.names(), key=len)] = option.attrs().get("default")
    for name, (_help, _type, default) in parser._inidict.items():
        found[name] = default
    return found


def first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence (one before a capital or the end;
    not ``e.g. 0,1``)."""
    found = re.match(r"(.+?)\.(?:\s+[A-Z]|\s+[\w-]+:|\s*$)", text)
    return found.group(1) if found else text


def help_default(text: str) -> str | None:
    """The default a help text states: ``continue (default)``, ``(default 0.3; ...)``."""
    found = re.search(r"(\S+) \(default\)|\(default (\S+?)[;)]", text)
    return None if found is None else (found.group(1) or found.group(2)).rstrip(":,")


def settings() -> list[Setting]:
    """Every row of the table: the options, the ini keys, then the environment."""
    defaults = parser_defaults()
    rows = [
        Setting(
            e.usage if e.kind == "option" else e.name,
            e.kind,
            help_default(e.help) or shown_default(defaults[e.name]),
            first_sentence(e.help),
            e.label,
        )
        for e in cuda_option_entries()
    ]
    rows += [
        Setting(name, "env", "not set", what, label)
        for names, label, what in ENVIRONMENT
        for name in names
    ]
    return rows


KINDS = {"option": "command line", "ini": "ini key", "env": "environment"}


class SettingsTable(SphinxDirective):
    """``{settings-table}``: the table, each name as code linked to its section."""

    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {}

    def run(self) -> list[nodes.Node]:
        try:
            rows = settings()
        except (ValueError, RuntimeError, KeyError) as exc:
            raise self.error(f"{self.name}: {exc}") from None
        widths = (30, 12, 10, 48)
        table = nodes.table(classes=["settings-table"])
        group = nodes.tgroup(cols=len(widths))
        table += group
        group += [nodes.colspec(colwidth=w) for w in widths]
        head = nodes.thead()
        head += self._row([nodes.Text(t) for t in ("setting", "where", "default", "what")])
        body = nodes.tbody()
        for row in rows:
            link = addnodes.pending_xref(
                "",
                nodes.literal(row.name, row.name),
                refdomain="std",
                reftype="ref",
                reftarget=row.label,
                refexplicit=True,
                refwarn=True,
            )
            body += self._row(
                [
                    link,
                    nodes.Text(KINDS[row.kind]),
                    nodes.literal(row.default, row.default),
                    nodes.Text(row.what),
                ]
            )
        group += [head, body]
        self.set_source_info(table)
        return [table]

    @staticmethod
    def _row(cells: list[nodes.Node]) -> nodes.row:
        row = nodes.row()
        for cell in cells:
            entry = nodes.entry()
            entry += nodes.paragraph("", "", cell)
            row += entry
        return row


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("settings-table", SettingsTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
