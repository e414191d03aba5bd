#!/usr/bin/env bash
# Run here (network, no GPU) before a GPU check: the wheels the GPU image lacks, for
# its Python 3.12 on x86-64, go to .whl/ (git-ignored), to be carried with the call:
# IPython and line_profiler (the shared script), setuptools to build the project, and
# the Jupyter stack that executes the demo notebook there, and expecttest, which
# PyTorch's own leak checker (compared with ours in benchmarks/bench_leaks.py) imports.
set -euo pipefail
cd "$(dirname "$0")/.."
shared=../shared/device/fetch-wheels.sh
[ -f "$shared" ] || shared=../../shared/device/fetch-wheels.sh
bash "$shared" setuptools wheel nbclient nbformat jupyter_client jupyter_core ipykernel \
  pyzmq tornado comm debugpy psutil nest_asyncio fastjsonschema jsonschema \
  jsonschema-specifications referencing rpds-py attrs platformdirs python-dateutil \
  expecttest
