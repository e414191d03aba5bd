"""The fields of the timing results are documented where the API reference shows them.

``%cudatime``'s page points readers at :class:`~gpumagic.timing_result.CudaTimeResult`'s
fields (``first_call``, ``kernel_time``, ``verdict``...); autodoc shows a dataclass field
with the ``#:`` comment above it, read by the same analyzer as here. (Every other public
field is listed too, name and type: ``autodoc_default_options`` in ``docs/conf.py``.)
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest

pytest.importorskip("sphinx.pycode")  # a bare "sphinx" may lack it
from sphinx.pycode import ModuleAnalyzer

MODULES = ("gpumagic.timing_result", "gpumagic.timing_plan", "gpumagic.roofline")


@pytest.mark.parametrize("name", MODULES)
def test_every_field_of_the_timing_dataclasses_has_a_doc_comment(name: str) -> None:
    module = importlib.import_module(name)
    documented = ModuleAnalyzer.for_module(name).find_attr_docs()
    missing = [
        f"{cls.__name__}.{f.name}"
        for public in module.__all__
        if isinstance(cls := getattr(module, public), type) and dataclasses.is_dataclass(cls)
        for f in dataclasses.fields(cls)
        if (cls.__qualname__, f.name) not in documented
    ]
    assert not missing, f"give these fields a #: comment: {missing}"
