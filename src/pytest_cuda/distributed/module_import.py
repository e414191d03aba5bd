"""The test's module, imported in a rank process as pytest imported it: under the name
pytest gave it (so the pickled test function and fixture values resolve), with
pytest's assertion rewriting where pytest offers it (a failed ``assert`` explains
itself as it does in pytest). Used by :mod:`pytest_cuda.distributed.rank_main`.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType

__all__ = ["import_test_module"]


def import_test_module(name: str, path: str) -> ModuleType:
    """The test module under the name pytest gave it, so pickled references resolve."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    package = name.rpartition(".")[0]
    if package:
        importlib.import_module(package)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the test module {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    run = _rewritten(path) or spec.loader.exec_module
    try:
        run(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _rewritten(path: str) -> Callable[[ModuleType], None] | None:
    """Running the module with pytest's assertion rewriting, where pytest offers it."""
    try:
        from _pytest.assertion.rewrite import rewrite_asserts

        source = Path(path).read_bytes()
        tree = ast.parse(source, filename=path)
        rewrite_asserts(tree, source, path)
        code = compile(tree, path, "exec", dont_inherit=True)
    except Exception:
        return None

    def run(module: ModuleType) -> None:
        exec(code, module.__dict__)

    return run
