#!/usr/bin/env bash
# The one-call GPU check: on a GPU machine where torch is already installed, install the
# project and what it needs (below), run the whole suite with GPU tests required, execute
# the demo notebook, run the benchmarks asked for, and end with a one-screen summary (also
# written to the log folder as summary.txt). Logs go to $GPU_CHECK_LOGS (default: $OUT
# where a job runner sets it, else ./gpu-check-logs).
#
#   bash scripts/gpu-check.sh                     # the whole suite and the notebook
#   bash scripts/gpu-check.sh --quick             # the GPU-marked tests alone
#   bash scripts/gpu-check.sh tests/gpumagic      # these tests (no notebook)
#   GPU_CHECK_BENCH=all bash scripts/gpu-check.sh # ... and every benchmark
#   GPU_CHECK_BENCH=timing,lprun bash scripts/gpu-check.sh --no-tests   # benchmarks only
#
# The tests run in two phases: everything that does not time the GPU under pytest-xdist
# (GPU_CHECK_WORKERS processes, default half the cores, at most 8), then the tests marked
# `gpu_timing` alone, one at a time, so that no other process shares the GPU while they
# measure. GPU_CHECK_BENCH: "none" (default), "all", or names of benchmarks/bench_NAME.py
# separated by commas. GPU_CHECK_NOTEBOOK=1 executes the demo notebook also when tests are
# named or with --quick (default: only in the full run). Extra pytest options:
# GPU_CHECK_PYTEST_OPTS.
# It installs, into $GPU_CHECK_SITE (default /tmp/gpumagic-site; first on PYTHONPATH; torch
# is the one you have),
# the project built from this tree and what pyproject.toml's dependencies and test extra
# name besides torch, from the package index; or, on a machine without network, from the
# wheels in .whl/ (`bash scripts/fetch-gpu-wheels.sh` fetches them elsewhere).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
began=$(date +%s)
logs=${GPU_CHECK_LOGS:-${OUT:-$root/gpu-check-logs}}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1 GPUMAGIC_GPU_CHECK=1
py=${PYTHON:-python3}

run_tests=1 quick=0
case "${1:-}" in
  --no-tests) run_tests=0; shift ;;
  --quick) quick=1; shift ;;
esac
# Named tests in path order, so the files of one folder are next to each other: pytest 9.1
# loses a folder's conftest fixtures for its files named after a file of a parent folder
# ("fixture 'shell' not found"; pytest-dev/pytest#14971, fixed in 9.2).
if [ $# -gt 0 ]; then
  mapfile -t tests < <(printf '%s\n' "$@" | LC_ALL=C sort)
  notebook_default=0
else
  tests=(tests)
  notebook_default=1
fi
marker=""
if [ "$quick" = 1 ]; then marker="cuda and "; notebook_default=0; fi
[ "$run_tests" = 1 ] || notebook_default=0

# Everything is installed into $site, put first on PYTHONPATH; torch is the one you have.
site=${GPU_CHECK_SITE:-/tmp/gpumagic-site}
if [ -d .whl ]; then
  # Wheels fetched beforehand (scripts/fetch-gpu-wheels.sh), for a machine without network.
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl || exit 1
  index=(--no-index --find-links .whl)
else
  # From the package index: pyproject.toml's dependencies and test extra, torch aside.
  mapfile -t needs < <("$py" - <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for requirement in project["dependencies"] + project["optional-dependencies"]["test"]:
    if not requirement.startswith("torch"):
        print(requirement)
PY
  )
  "$py" -m pip install -q --no-compile --upgrade --target "$site" "${needs[@]}" || exit 1
  index=()
fi
# The project itself, built from this tree.
"$py" -m pip install -q "${index[@]}" --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$site" . || exit 1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

{
  echo "== $(date -u +%FT%TZ)"
  nvidia-smi -L 2>&1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$py" - <<'PY'
import platform
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
# Tests written for two GPUs fail under --cuda-require on one: leave them out there, and
# say so (run them on a machine with two GPUs).
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ "${gpus:-0}" -lt 2 ]; then
  echo "gpu-check: $gpus GPU(s): the two-GPU tests (test_plugin_two_gpus.py," \
    "test_distributed_gpu.py) need 2 and are left out" | tee -a "$logs/environment.txt"
  tests+=(--ignore=tests/pytest_cuda/test_plugin_two_gpus.py
    --ignore=tests/pytest_cuda/test_distributed_gpu.py)
fi
cores=$(nproc 2>/dev/null || echo 2)
workers=${GPU_CHECK_WORKERS:-$((cores / 2 > 8 ? 8 : (cores / 2 < 1 ? 1 : cores / 2)))}

# pytest_phase NAME MARKEXPR [PYTEST ARGS...]: one pytest run, logged to NAME.log and
# NAME.xml; exit code 5 (nothing selected) is not a failure.
pytest_phase() {
  local name=$1 expr=$2
  shift 2
  # shellcheck disable=SC2086
  "$py" -m pytest "${tests[@]}" -m "$expr" "$@" --cuda-require -rfEs -p no:cacheprovider \
    --durations=15 --junitxml="$logs/$name.xml" ${GPU_CHECK_PYTEST_OPTS:-} 2>&1 \
    | tee "$logs/$name.log" | grep -Ev '^(\.|s|F|E|x|X)*( *\[ *[0-9]+%\])?$'
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || status=1
}
if [ "$run_tests" = 1 ]; then
  # A worker that dies is a failure to read, not to retry: under --dist loadgroup,
  # pytest-xdist 3.8 can wait forever after replacing one (pytest-dev/pytest-xdist#1378).
  # A test that hangs writes every thread's stack to the log after 300 s.
  pytest_phase pytest-parallel "${marker}not gpu_timing" -n "$workers" --dist loadgroup -q \
    --max-worker-restart=0 -o faulthandler_timeout=300
  pytest_phase pytest-timing "${marker}gpu_timing" -q
fi

# The demo notebook, executed by a real Jupyter kernel on this GPU; its outputs go to the
# docs (docs/demo-gpu.ipynb).
if [ "${GPU_CHECK_NOTEBOOK:-$notebook_default}" = 1 ]; then
  "$py" scripts/run-notebook.py examples/demo.ipynb "$logs/demo-gpu.ipynb" >"$logs/notebook.log" 2>&1
  echo $? >"$logs/notebook.rc"
  [ "$(cat "$logs/notebook.rc")" -eq 0 ] || status=1
fi

bench=${GPU_CHECK_BENCH:-none}
if [ "$bench" != none ]; then
  if [ "$bench" = all ]; then
    scripts=(benchmarks/bench_*.py)
  else
    IFS=, read -ra names <<<"$bench"
    scripts=()
    for n in "${names[@]}"; do scripts+=("benchmarks/bench_$n.py"); done
  fi
  : >"$logs/benchmarks.rc"
  for script in "${scripts[@]}"; do
    if [ ! -f "$script" ]; then
      echo "$script 2" >>"$logs/benchmarks.rc"
      status=1
      continue
    fi
    echo "== $script" >>"$logs/benchmarks.log"
    "$py" "$script" --json "$logs/benchmarks.jsonl" >>"$logs/benchmarks.log" 2>&1
    rc=$?
    echo "$script $rc" >>"$logs/benchmarks.rc"
    [ "$rc" -eq 0 ] || status=1
  done
fi
"$py" scripts/gpu_check_summary.py "$logs" --seconds $(($(date +%s) - began)) --exit "$status" \
  | tee "$logs/summary.txt"
exit $status
