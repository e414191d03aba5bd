"""The API page shows what users touch first, each field with its description.

``docs/api.md`` has two parts: "What you use" (the results the magics return,
``gpumagic.compare``, markers, fixtures, the leak hooks, the settings) and "Internals"
(the engines). Every member of a class in the first part is described: a field by the
``#:`` comment above it (read by the analyzer autodoc uses), a method or property by its
docstring. A field's description must render as its description, never as its type.
No Sphinx build: the docs build itself (``make docs``, ``-n -W``) checks the references.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

pytest.importorskip("sphinx.pycode")  # a bare "sphinx" may lack it
from sphinx.pycode import ModuleAnalyzer

ROOT = Path(__file__).resolve().parents[1]
API = (ROOT / "docs" / "api.md").read_text()
USER, _, INTERNALS = API.partition("\n## Internals\n")
AUTOCLASS = re.compile(r"^\.\. autoclass:: ([\w.]+)", re.MULTILINE)


def user_classes() -> list[str]:
    return AUTOCLASS.findall(USER)


def undescribed(dotted: str) -> list[str]:
    module_name, _, name = dotted.rpartition(".")
    cls = getattr(importlib.import_module(module_name), name)
    described = ModuleAnalyzer.for_module(cls.__module__).find_attr_docs()
    missing = []
    if dataclasses.is_dataclass(cls):
        missing += [
            f.name
            for f in dataclasses.fields(cls)
            if not f.name.startswith("_") and (cls.__qualname__, f.name) not in described
        ]
    for member, value in vars(cls).items():
        if member.startswith("_") or not (inspect.isfunction(value) or isinstance(value, property)):
            continue
        if not (inspect.getdoc(value) or "").strip():
            missing.append(member)
    return missing


def test_the_user_part_comes_first_and_holds_the_results() -> None:
    assert INTERNALS, "docs/api.md has no '## Internals' section"
    assert API.index("## What you use") < API.index("## Internals")
    for shown in (
        "gpumagic.timing_result.CudaTimeResult",
        "gpumagic.timing_compare.ComparisonRow",
        "gpumagic.memory_result.GpuMemResult",
        "gpumagic.memory_result.CellMemResult",
        "pytest_cuda.leaks.report.LeakReport",
        "pytest_cuda.distributed.ranks.RankInfo",
        "pytest_cuda.settings.Settings",
    ):
        assert shown in user_classes(), shown
    for engine in ("gpumagic.timing_plan", "gpumagic.timing", "pytest_cuda.leaks.engine"):
        assert f"automodule:: {engine}\n" in INTERNALS, engine
        assert f"automodule:: {engine}\n" not in USER, engine
    assert "{pytest-markers}" in USER
    assert "{pytest-fixtures}" in USER


def test_compare_and_the_packages_names_are_on_the_page() -> None:
    import gpumagic
    import pytest_cuda

    # compare is loaded on first use (module __getattr__): automodule does not see it.
    assert ".. autofunction:: gpumagic.compare" in USER
    assert ".. automodule:: gpumagic\n" in USER
    assert ".. automodule:: pytest_cuda\n" in USER
    assert "compare" in gpumagic.__all__
    assert pytest_cuda.__all__


@pytest.mark.parametrize("dotted", user_classes())
def test_every_member_of_a_user_facing_class_is_described(dotted: str) -> None:
    missing = undescribed(dotted)
    assert not missing, (
        f"{dotted}: describe these ('#:' above a field, else a docstring): {missing}"
    )


def test_a_field_description_is_not_read_as_its_type() -> None:
    """napoleon reads an attribute docstring's first words before a colon as its type
    (``CudaTimeResult.median``: "Type: Median per-loop time over the runs"); the
    docstrings here are reStructuredText, not Google or NumPy style."""
    namespace: dict[str, object] = {"__file__": str(ROOT / "docs" / "conf.py")}
    exec(compile((ROOT / "docs" / "conf.py").read_text(), "conf.py", "exec"), namespace)
    extensions = namespace["extensions"]
    assert isinstance(extensions, list)
    assert "sphinx.ext.napoleon" not in extensions
    assert namespace["nitpicky"] is True


def test_make_docs_is_nitpicky() -> None:
    docs = re.search(r"^docs:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert docs is not None
    assert " -n " in docs.group(1)
    assert " -W " in docs.group(1)
