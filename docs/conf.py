"""Sphinx configuration for gpumagic's docs (furo + MyST)."""

from __future__ import annotations

project = "gpumagic"
author = "gpumagic developers"
copyright = "2026, gpumagic developers"
release = "0.1.0.dev0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
html_theme = "furo"
html_title = "gpumagic"
exclude_patterns = ["_build"]
autodoc_typehints = "description"
autodoc_mock_imports = ["torch", "pynvml", "line_profiler"]
intersphinx_mapping: dict[str, tuple[str, None]] = {}
nitpicky = False
