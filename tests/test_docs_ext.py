"""The docs' generated reference text (``docs/_ext``) matches what the tools print.

``magic-help`` must be what ``%magic?`` shows; ``pytest-help``, ``pytest-markers`` and
``pytest-fixtures`` must hold every option, marker and fixture pytest_cuda registers.
Generating them imports no torch and creates no CUDA context.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ipython_shell import fresh_shell

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import ModuleType

# The docs tools come with the project's docs extra (``make test`` installs it); the GPU
# machine's image has no Sphinx, or a Sphinx without docutils.
for _name in ("sphinx", "docutils"):
    pytest.importorskip(_name, reason=f"{_name} is not installed (pip install -e '.[docs]')")

EXT = Path(__file__).resolve().parents[1] / "docs" / "_ext"
MAGICS = {
    "cudatime": "gpumagic.timing_magics:CudaTimeMagics.cudatime",
    "gpumem": "gpumagic.memory_magics:GpuMemMagics.gpumem",
    "lprun": "gpumagic.lineprof_magics:LprunMagics.lprun",
}
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def ext() -> Iterator[tuple[ModuleType, ModuleType]]:
    sys.path.insert(0, str(EXT))
    try:
        import magic_help
        import pytest_help

        yield magic_help, pytest_help
    finally:
        sys.path.remove(str(EXT))


@pytest.mark.parametrize("magic", sorted(MAGICS))
def test_magic_help_is_what_the_question_mark_shows(
    ext: tuple[ModuleType, ModuleType], magic: str
) -> None:
    magic_help, _ = ext
    with fresh_shell() as shell:
        shell.run_line_magic("load_ext", "gpumagic")
        shown = ANSI.sub("", shell.object_inspect_mime(f"%{magic}")["text/plain"])
    text = magic_help.magic_help(MAGICS[magic])
    assert f"Docstring:\n{text}" in shown


def test_magic_help_lists_every_option(ext: tuple[ModuleType, ModuleType]) -> None:
    magic_help, _ = ext
    text = magic_help.magic_help(MAGICS["cudatime"])
    for option in ("--kernels", "--graph", "--cold", "--sync-check", "--budget SECONDS"):
        assert option in text
    assert "%%gpumem only" in magic_help.magic_help(MAGICS["gpumem"])
    assert "--no-sync" in magic_help.magic_help(MAGICS["lprun"])


def test_pytest_help_holds_every_option_marker_and_fixture(
    ext: tuple[ModuleType, ModuleType], pytester: pytest.Pytester
) -> None:
    _, pytest_help = ext
    config = pytester.parseconfigure()
    # --cuda-internal-*: between pytest_cuda's own processes, hidden from --help.
    options = sorted(
        "--" + k.replace("_", "-")
        for k in vars(config.option)
        if k.startswith("cuda") and not k.startswith("cuda_internal")
    )
    assert "--cuda-leak-check" in options
    help_text = pytest_help.cuda_help()
    assert help_text.startswith("CUDA (pytest_cuda): devices, leak checks")
    for option in options:
        assert f"  {option}" in help_text, option
    assert "  cuda_devices (string):" in help_text

    markers = [m.split("(")[0].split(":")[0] for m in config.getini("markers")]
    ours = sorted(m for m in markers if m.startswith("cuda"))
    assert ours == [
        "cuda",
        "cuda_distributed",
        "cuda_leak_check",
        "cuda_limit_memory",
        "cuda_no_sync",
        "cuda_sync",
    ]
    marker_text = pytest_help.cuda_markers()
    for marker in ours:
        assert f"@pytest.mark.{marker}" in marker_text

    fixtures = pytest_help.cuda_fixtures()
    names = ("cuda_device [session scope]", "cuda_devices", "cuda_no_sync", "cuda_rank")
    for fixture in (*names, "no_cuda_leak"):
        assert re.search(rf"^{re.escape(fixture)}$", fixtures, re.MULTILINE), fixture
    assert " -- " not in fixtures  # file locations are left out


def test_subsets_and_unknown_names(ext: tuple[ModuleType, ModuleType]) -> None:
    _, pytest_help = ext
    leak = pytest_help.cuda_help(["--cuda-leak-check", "--cuda-leak-trace"])
    assert leak.startswith("  --cuda-leak-check")
    assert "--cuda-devices" not in leak
    assert "cuda_devices (string)" in pytest_help.cuda_help(["cuda_devices"])
    with pytest.raises(ValueError, match="--cuda-nonsense"):
        pytest_help.cuda_help(["--cuda-nonsense"])
    with pytest.raises(ValueError, match="cuda_nonsense"):
        pytest_help.cuda_markers(["cuda_nonsense"])
    with pytest.raises(ValueError, match="cuda_nonsense"):
        pytest_help.cuda_fixtures(["cuda_nonsense"])


def test_generating_the_text_imports_no_torch() -> None:
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(EXT)!r})\n"
        "import magic_help, pytest_help\n"
        f"for target in {sorted(MAGICS.values())!r}:\n"
        "    magic_help.magic_help(target)\n"
        "pytest_help.cuda_help(); pytest_help.cuda_markers(); pytest_help.cuda_fixtures()\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_option_sections_cover_every_option_and_magic_option(
    ext: tuple[ModuleType, ModuleType],
) -> None:
    magic_help, pytest_help = ext
    entries = pytest_help.cuda_option_entries()
    labels = [e.label for e in entries]
    assert len(set(labels)) == len(labels)
    assert "option-cuda-leak-check" in labels
    assert "ini-cuda-devices" in labels
    help_text = pytest_help.cuda_help()
    for entry in entries:
        assert entry.name in help_text, entry
    for magic, target in MAGICS.items():
        options = magic_help.magic_options(target)
        shown = magic_help.magic_help(target)
        assert options, magic
        for option in options:
            assert option.label.startswith(f"{magic}-option-"), option
            assert option.label == option.label.lower()
            assert option.usage.split(",")[0].split()[0] in shown, option


# Set by the plugin for processes it starts, not settings: the leak re-run's output file,
# and pytest's own current-test variable that a child process clears.
NOT_SETTINGS = {"PYTEST_CUDA_LEAK_RERUN_OUT", "PYTEST_CURRENT_TEST"}


def variables_the_code_reads() -> set[str]:
    """Environment variable names written as string literals in the modules that touch
    ``os.environ`` (names of the project's own constants left out)."""
    src = Path(__file__).resolve().parents[1] / "src"
    sources = [p.read_text() for p in src.rglob("*.py")]
    constants = {
        n for text in sources for n in re.findall(r"^\s*([A-Z][A-Z0-9_]*)\b.*=", text, re.M)
    }
    literals = {
        name
        for text in sources
        if "environ" in text
        for name in re.findall(r'"([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+)"', text)
    }
    return literals - constants - NOT_SETTINGS


def test_the_settings_table_holds_every_setting_with_its_default(
    ext: tuple[ModuleType, ModuleType],
) -> None:
    _, pytest_help = ext
    sys.path.insert(0, str(EXT))
    try:
        import settings_table
    finally:
        sys.path.remove(str(EXT))
    rows = settings_table.settings()
    entries = pytest_help.cuda_option_entries()
    assert [r.label for r in rows if r.kind != "env"] == [e.label for e in entries]
    defaults = settings_table.parser_defaults()
    by_label = {r.label: r for r in rows}
    for entry in entries:
        row = by_label[entry.label]
        assert row.default in (
            settings_table.help_default(entry.help),
            settings_table.shown_default(defaults[entry.name]),
        ), entry
        assert row.what, entry
        assert entry.help.startswith(row.what), entry
    assert by_label["option-cuda-on-poison"].default == "continue"
    assert by_label["ini-cuda-leak-holder-search"].default == "0.3"
    assert by_label["option-cuda-leak-check"].default == "off"
    listed = {r.name for r in rows if r.kind == "env"}
    missing = variables_the_code_reads() - listed
    assert not missing, f"add these to settings_table.ENVIRONMENT: {missing}"
    assert "CUDA_VISIBLE_DEVICES" in variables_the_code_reads()
    page = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    assert "```{settings-table}\n```" in page
    for label in {r.label for r in rows if r.kind == "env"}:
        assert f"({label})=" in page, label
