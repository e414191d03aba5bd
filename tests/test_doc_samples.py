"""Every sample of the docs runs as written: pasted into a real IPython shell, or saved
as a test file and run by pytest.

Each fenced block of ``docs/**/*.md`` is one of:

* an IPython or Python sample (```` ```ipython ````, ```` ```python ````): the page's
  samples run in order, each block one cell, in one fresh ``InteractiveShell`` (with
  ``%load_ext gpumagic`` first, as the reader did on the getting-started page, unless
  the page's first sample loads it);
* a test file (a ```` ```python ```` block that defines ``test_`` functions): saved and
  run by pytest (``pytester``), with the plugin; no test may fail or error, except the
  ones the page says fail on a GPU (:data:`FAILS_ON_GPU`);
* a pytest configuration (```` ```ini ````): saved as ``pytest.ini``; the markers it
  registers are known to ``--strict-markers`` with the plugin off (``-p no:cuda``);
* on a how-to page (``docs/howto/``), a file, command or cell that ``test_howto.py``
  runs (this test checks that it reads each of them);
* anything else (```` ```text ````, ```` ```console ```` transcripts, ```` ```ini ````,
  directives): not a sample.

An HTML comment right before a block, which the reader does not see, says more:
``<!-- sample: gpu -->`` for a sample that needs a GPU (skipped here without one, with
the reason; run in the GPU check, marked ``cuda``), ``<!-- sample: fragment -->`` for a
block that is deliberately incomplete (not run; see :data:`FRAGMENTS`).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import pytest

import test_howto
from gpumagic import cuda
from ipython_shell import fresh_shell

if TYPE_CHECKING:
    from collections.abc import Iterator

DOCS = Path(__file__).resolve().parents[1] / "docs"
FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
MARK = re.compile(r"<!-- sample: (?P<mark>[\w-]+) -->\s*\Z")
MARKS = {"gpu", "fragment"}
HAVE_GPU = cuda.status().available
NEEDS_GPU = [pytest.mark.cuda, pytest.mark.skipif(not HAVE_GPU, reason="needs a GPU")]

# Blocks marked ``<!-- sample: fragment -->``, and why each cannot be made complete.
FRAGMENTS: dict[str, str] = {
    "configuration.md:185": "a line of an IPython profile file, where IPython defines `c`",
}

# Tests of the test-file samples that fail on a GPU by design (the page says so): the
# fragment their failure must show. Without a GPU they pass or skip like the rest.
FAILS_ON_GPU = {
    "test_step_logs_its_loss": "cuda_no_sync: implicit host-device synchronization: Tensor.item()",
    "test_fixture_block": "cuda_no_sync: implicit host-device synchronization: Tensor.item()",
}

# %cudatime's time budget while the samples run here (1 s as written): they are
# checked for running as written, not for their numbers.
CUDATIME_BUDGET = 0.1


class Block(NamedTuple):
    page: str  # relative to docs/
    line: int
    info: str  # the fence's info string: "python", "ipython", "{code-block} python", ...
    body: str
    mark: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def kind(self) -> str:
        """``shell``, ``test-file``, ``ini``, ``howto``, ``fragment`` or ``none``."""
        lang = self.info.strip()
        if self.page.startswith("howto/"):
            runnable = lang in ("ipython", "console") or lang.startswith("{code-block}")
            return "howto" if runnable else "none"
        if lang == "ini":
            return "ini"
        if lang not in ("python", "ipython"):
            return "none"
        if self.mark == "fragment":
            return "fragment"
        if lang == "python" and re.search(r"^def test_", self.body, re.MULTILINE):
            return "test-file"
        return "shell"


def read_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        mark = MARK.search(text[max(0, match.start() - 200) : match.start()])
        blocks.append(
            Block(
                page=path.relative_to(DOCS).as_posix(),
                line=text.count("\n", 0, match.start()) + 1,
                info=match.group("info"),
                body=match.group("body"),
                mark=mark.group("mark") if mark else None,
            )
        )
    return blocks


BLOCKS = [
    block
    for path in sorted(DOCS.rglob("*.md"))
    if "_build" not in path.parts
    for block in read_blocks(path)
]
SHELL_PAGES = sorted({b.page for b in BLOCKS if b.kind == "shell"})
TEST_FILES = [b for b in BLOCKS if b.kind == "test-file"]
INI_FILES = [b for b in BLOCKS if b.kind == "ini"]


def shell_sessions() -> Iterator[object]:
    """Per page: its samples that run anywhere; and, where it has GPU samples, all of them."""
    for page in SHELL_PAGES:
        blocks = [b for b in BLOCKS if b.page == page and b.kind == "shell"]
        if any(b.mark is None for b in blocks):
            yield pytest.param(page, False, id=page)
        if any(b.mark == "gpu" for b in blocks):
            yield pytest.param(page, True, id=f"{page}[gpu]", marks=NEEDS_GPU)


def test_every_block_is_classified() -> None:
    kinds = Counter(b.kind for b in BLOCKS)
    assert kinds["shell"] >= 10, kinds
    assert kinds["test-file"] >= 5, kinds
    for block in BLOCKS:
        assert block.mark in MARKS | {None}, (block.id, block.mark)
        if block.mark == "fragment":
            assert block.id in FRAGMENTS, f"{block.id}: say in FRAGMENTS why it is a fragment"
        if block.mark is not None:
            assert block.kind != "none", f"{block.id}: marked {block.mark}, but not a sample"
        if block.info.strip() == "python":
            # A ``python`` block is plain Python (magics go in ``ipython`` blocks).
            ast.parse(block.body, filename=block.id)
        if block.kind == "shell" and block.mark is None:
            assert not re.search(r"device=[\"']cuda", block.body), f"{block.id}: mark it gpu"
    assert set(FRAGMENTS) == {b.id for b in BLOCKS if b.mark == "fragment"}


def test_the_howto_guides_run_every_sample() -> None:
    """``test_howto.py`` runs the how-to pages: it reads each of their samples."""
    for block in BLOCKS:
        if block.kind != "howto":
            continue
        page = test_howto.PAGES[Path(block.page).stem]
        lang = block.info.strip()
        if lang == "ipython":
            # test_howto runs the cells on a GPU only.
            assert block.mark == "gpu", f"{block.id}: mark it <!-- sample: gpu -->"
            assert block.body in page.cells, block.id
        elif lang == "console":
            commands = [s[2:] for s in block.body.splitlines() if s.startswith("$ ")]
            assert commands, f"{block.id}: a console block on a how-to page runs its $ lines"
            assert set(commands) <= set(page.commands), block.id
        elif ":caption:" in block.body:
            assert block.body.split("\n\n", 1)[1] in page.files.values(), block.id


@pytest.fixture(scope="module", autouse=True)
def _torch_first() -> None:
    """torch imported before ``pytester`` snapshots ``sys.modules``: pytester drops the
    modules a test imported, and torch's C extension crashes when imported twice."""
    cuda.torch_module()


@pytest.fixture
def fast_cudatime() -> Iterator[None]:
    from gpumagic.timing_magics import CudaTimeMagics

    parser = CudaTimeMagics.cudatime.parser  # type: ignore[attr-defined]
    budget = parser.get_default("budget")
    parser.set_defaults(budget=CUDATIME_BUDGET)
    try:
        yield
    finally:
        parser.set_defaults(budget=budget)


@pytest.mark.usefixtures("fast_cudatime")
@pytest.mark.parametrize(("page", "gpu"), list(shell_sessions()))
def test_samples_run_in_a_shell(page: str, gpu: bool) -> None:
    blocks = [b for b in BLOCKS if b.page == page and b.kind == "shell"]
    if not gpu:
        blocks = [b for b in blocks if b.mark is None]
    with fresh_shell() as shell:
        try:
            if "%load_ext gpumagic" not in blocks[0].body:
                shell.run_line_magic("load_ext", "gpumagic")
            for block in blocks:
                result = shell.run_cell(block.body, store_history=True)
                assert result.success, (block.id, result.error_before_exec, result.error_in_exec)
        finally:
            shell.run_line_magic("unload_ext", "gpumagic")


@pytest.mark.parametrize("block", TEST_FILES, ids=[b.id for b in TEST_FILES])
def test_test_file_samples_pass(block: Block, pytester: pytest.Pytester) -> None:
    # A sample whose first line is ``# test_name.py`` is saved under that name, as the
    # page tells the reader to (its output names that file).
    named = re.match(r"# (test_\w+)\.py\n", block.body)
    name = named.group(1) if named else "test_" + re.sub(r"\W", "_", block.id.replace(".md", ""))
    pytester.makepyfile(**{name: block.body})
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rA")
    output = result.stdout.str()
    test_howto.keep_transcript(re.sub(r"[/:]", "_", block.id), f"$ pytest {name}.py\n{output}\n")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) + outcomes.get("skipped", 0) + outcomes.get("failed", 0)
    assert "error" not in outcomes, output
    assert "errors" not in outcomes, output
    failed = set(re.findall(r"^FAILED \S+::(\w+)", output, re.MULTILINE))
    expected = {t for t in FAILS_ON_GPU if re.search(rf"^def {t}\(", block.body, re.M)}
    if HAVE_GPU:
        assert failed == expected, output
        for test in expected:
            assert FAILS_ON_GPU[test] in output, output
    else:
        assert not failed, output
        skips = re.findall(r"^SKIPPED .*", output, re.MULTILINE)
        assert all("CUDA unavailable" in s for s in skips), skips


@pytest.mark.parametrize("block", INI_FILES, ids=[b.id for b in INI_FILES])
def test_ini_samples_register_the_markers(block: Block, pytester: pytest.Pytester) -> None:
    # Every marker of the plugin, as ``pytest --markers`` lists them with it on.
    listed = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--markers").stdout.str()
    plugin = re.findall(r"^@pytest\.mark\.(cuda\w*)", listed, re.MULTILINE)
    pytester.makeini(block.body)
    markers = re.findall(r"^\s+(\w+):", block.body, re.MULTILINE)
    assert sorted(markers) == sorted(plugin), (block.id, markers, plugin)
    # ... and known with the plugin off.
    marks = "".join(f"@pytest.mark.{name}\n" for name in markers)
    pytester.makepyfile(f"import pytest\n\n\n{marks}def test_marked():\n    pass\n")
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "-p", "no:cuda", "--strict-markers"
    )
    result.assert_outcomes(passed=1)
