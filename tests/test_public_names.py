"""Every module's ``__all__`` is its true public surface, and every module is short.

``__all__`` is what ``docs/api.md`` documents (autodoc's ``automodule :members:``
follows it), so it must list exactly the names other modules take from the module:
every name in it exists, and every name another module of ``src/`` imports from a
module, defined there, is in it. A module over 600 lines holds more than one thing.
"""

from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGES = ("gpumagic", "pytest_cuda")
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for package in PACKAGES for p in (SRC / package).rglob("*.py")}


def _declared_all(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            return [str(v) for v in value]
    return None


def _defined(tree: ast.Module) -> set[str]:
    """Names a module binds itself (not those it imports)."""
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.Assign):
            found.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)
    return found


@functools.cache
def _tree(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text(encoding="utf-8"))


@functools.cache
def _imported_from_others() -> dict[str, set[str]]:
    """``{module: names other src modules import from it}``, annotations included."""
    taken: dict[str, set[str]] = {name: set() for name in MODULES}
    for module, path in MODULES.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(_tree(module)):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            if base in taken and base != module:
                taken[base].update(alias.name for alias in node.names)
    return taken


@pytest.mark.parametrize("module", sorted(MODULES))
def test_all_lists_the_names_others_use(module: str) -> None:
    tree = _tree(module)
    declared = _declared_all(tree)
    assert declared is not None, f"{module} has no __all__"
    loaded = importlib.import_module(module)
    missing = [name for name in declared if not hasattr(loaded, name)]
    assert not missing, f"{module}.__all__ names what it does not have: {missing}"
    used = _imported_from_others()[module] & _defined(tree)
    unlisted = sorted(used - set(declared) - {name for name in used if name.startswith("_")})
    assert not unlisted, f"other modules import {unlisted} from {module}: add them to __all__"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_fits_in_one_sitting(module: str) -> None:
    lines = len(MODULES[module].read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines (at most {MAX_LINES})"
