#!/usr/bin/env bash
# The one-call GPU check: on a GPU machine where torch is already installed, install the
# project and the carried wheels without network, run the whole suite with GPU tests
# required, then run the benchmarks. Logs go to $GPU_CHECK_LOGS (default: $OUT, else
# ./gpu-check-logs).
#
#   bash scripts/gpu-check.sh                     # everything
#   bash scripts/gpu-check.sh tests/gpumagic      # these tests (benchmarks off unless
#   GPU_CHECK_BENCH=timing bash scripts/gpu-check.sh tests/x.py   # named in GPU_CHECK_BENCH)
#   GPU_CHECK_BENCH=all bash scripts/gpu-check.sh --no-tests      # benchmarks only
#
# GPU_CHECK_BENCH: "all" (default with no test args), "none", or names of
# benchmarks/bench_NAME.py separated by commas. GPU_CHECK_NOTEBOOK=1 executes the demo
# notebook also when tests are named (default: only in the full run). Extra pytest
# options: GPU_CHECK_PYTEST_OPTS.
# Before calling it from a machine without a GPU, `bash scripts/fetch-gpu-wheels.sh` puts
# the wheels the GPU image lacks (IPython, line_profiler, build tools) in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
logs=${GPU_CHECK_LOGS:-${OUT:-$root/gpu-check-logs}}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1 GPUMAGIC_GPU_CHECK=1
py=${PYTHON:-python3}

site=/tmp/gpumagic-site
if [ -d .whl ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl || exit 1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The project itself, built from this tree with the carried setuptools (no network).
"$py" -m pip install -q --no-index --find-links .whl --no-deps --no-compile --no-cache-dir \
  --upgrade --target "$site" . || exit 1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

{
  echo "== $(date -u +%FT%TZ)"
  nvidia-smi -L 2>&1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$py" - <<'PY'
import platform, sys
import torch, pytest
from importlib.metadata import version
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| pytest", pytest.__version__)
for name in ("ipython", "line_profiler", "pytest-xdist", "nvidia-ml-py", "triton", "gpumagic"):
    try:
        print(f"  {name} {version(name)}")
    except Exception as exc:
        print(f"  {name}: {exc}")
PY
} 2>&1 | tee "$logs/environment.txt"

status=0
run_tests=1
if [ "${1:-}" = --no-tests ]; then run_tests=0; shift; fi
if [ $# -gt 0 ]; then tests=("$@"); bench_default=none; else tests=(tests); bench_default=all; fi
# Tests written for two GPUs fail under --cuda-require on one: leave them out there, and
# say so (run them on a machine with two GPUs).
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ "${gpus:-0}" -lt 2 ]; then
  echo "gpu-check: $gpus GPU(s): tests/pytest_cuda/test_plugin_two_gpus.py needs 2 and is left out"
  tests+=(--ignore=tests/pytest_cuda/test_plugin_two_gpus.py)
fi
if [ "$run_tests" = 1 ]; then
  # shellcheck disable=SC2086
  "$py" -m pytest "${tests[@]}" --cuda-require -rfEs -p no:cacheprovider \
    --junitxml="$logs/junit.xml" ${GPU_CHECK_PYTEST_OPTS:-} 2>&1 | tee "$logs/pytest.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

# The demo notebook, executed by a real Jupyter kernel on this GPU; its outputs go to the
# docs (docs/demo-gpu.ipynb).
if [ "${GPU_CHECK_NOTEBOOK:-$bench_default}" != none ]; then
  "$py" scripts/run-notebook.py examples/demo.ipynb "$logs/demo-gpu.ipynb" 2>&1 \
    | tee -a "$logs/notebook.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

bench=${GPU_CHECK_BENCH:-$bench_default}
if [ "$bench" != none ]; then
  if [ "$bench" = all ]; then
    scripts=(benchmarks/bench_*.py)
  else
    IFS=, read -ra names <<<"$bench"
    scripts=()
    for n in "${names[@]}"; do scripts+=("benchmarks/bench_$n.py"); done
  fi
  for script in "${scripts[@]}"; do
    [ -f "$script" ] || continue
    echo "== $script" | tee -a "$logs/benchmarks.log"
    "$py" "$script" --json "$logs/benchmarks.jsonl" 2>&1 | tee -a "$logs/benchmarks.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
fi
echo "gpu-check: exit $status (logs in $logs)"
exit $status
