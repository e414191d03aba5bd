"""The modules of ``src/`` import each other without a cycle.

Every import counts: at module level, inside functions (the lazy ones), under ``if
TYPE_CHECKING:`` (an annotation that names a module's type needs that module to be
read, by the reader and by mypy), and every string that names a project module by its
dotted name (for ``importlib.import_module``, pytest's ``import_plugin`` or a table of
lazy names). A cycle means two modules each need the other to be read: one of them
holds something that belongs lower down.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGES = ("gpumagic", "pytest_cuda")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for package in PACKAGES for p in (SRC / package).rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The project module ``name`` refers to (a module, or a name inside one)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str) -> set[str]:
    """The project modules that ``module`` imports, for running or for its types."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names = [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and "." in str(node.value) and node.value in MODULES:
            # A module named in a string, to be imported by name (a bare package name
            # in a string is a list of library roots, not an import).
            names = [node.value]
        else:
            names = []
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                found.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One path around each cycle (strongly connected components of two or more)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return cycles


def test_the_walk_sees_lazy_and_string_imports() -> None:
    graph = {m: imports_of(m) for m in MODULES}
    assert "pytest_cuda.leaks.checker" in graph["pytest_cuda.leaks.plugin"]  # in a function
    assert "pytest_cuda.leaks.block" in graph["pytest_cuda"]  # a name in a string
    assert "gpumagic.memory_cell" in graph["gpumagic.memory_text"]  # under TYPE_CHECKING
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_in_src() -> None:
    graph = {m: imports_of(m) for m in MODULES}
    assert find_cycles(graph) == []


#: What the seam may import from the rest of the project: facts about devices and a
#: garbage-collector pause, no policy (what counts as the user's code, a tool's text).
SEAM_MAY_IMPORT = {"gpumagic", "gpumagic.devices", "gpumagic.units", "gpumagic.gc_pause"}


def test_the_seam_imports_no_policy() -> None:
    seam = [m for m in MODULES if m == "gpumagic.cuda" or m.startswith("gpumagic.cuda.")]
    found = {
        (m, target)
        for m in seam
        for target in imports_of(m)
        if target not in SEAM_MAY_IMPORT and not target.startswith("gpumagic.cuda")
    }
    assert found == set()
    # The plugin's messages ("pytest_cuda: ...") are the plugin's, passed in where needed.
    assert [m for m in seam if "pytest_cuda: " in MODULES[m].read_text()] == []
