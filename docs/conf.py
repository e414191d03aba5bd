"""Sphinx configuration for gpumagic's docs (furo + MyST, notebooks through MyST-NB)."""

from __future__ import annotations

import sys
from pathlib import Path

# Local extensions: magic_help (``%magic?`` text) and pytest_help (pytest_cuda's part of
# ``pytest --help``, ``--markers`` and ``--fixtures``), generated at build time.
sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "gpumagic"
author = "gpumagic developers"
copyright = "2026, gpumagic developers"
release = "0.1.0.dev0"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.intersphinx",
    "magic_help",
    "pytest_help",
    "bench_results",
    "python_refs",
    "settings_table",
]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
# Notebooks are shown with the outputs they were saved with (the GPU run's, for
# demo-gpu.ipynb); the docs build never executes them.
nb_execution_mode = "off"
html_theme = "furo"
html_title = "gpumagic"
html_static_path = ["_static"]
# wrap: long transcript lines wrap at the content width (``:class: wrap``).
html_css_files = ["gpumagic.css"]
exclude_patterns = ["_build"]
autodoc_typehints = "description"
autodoc_mock_imports = ["torch", "pynvml", "line_profiler"]
# The API page's "What you use" part asks for every field (``:undoc-members:``, and a
# test keeps each of them described); its internals list what has a description.
autodoc_default_options: dict[str, bool] = {}
intersphinx_mapping: dict[str, tuple[str, None]] = {}
# Every cross-reference must resolve (the build runs with -n -W): python_refs links or
# shows as code the names of objects these pages do not document.
nitpicky = True
