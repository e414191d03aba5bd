#!/usr/bin/env bash
# Run here (network, no GPU) before a GPU check: the wheels the GPU image lacks, for
# its Python 3.12 on x86-64, go to .whl/ (git-ignored), to be carried with the call.
set -euo pipefail
cd "$(dirname "$0")/.."
shared=../shared/device/fetch-wheels.sh
[ -f "$shared" ] || shared=../../shared/device/fetch-wheels.sh
bash "$shared" setuptools wheel
