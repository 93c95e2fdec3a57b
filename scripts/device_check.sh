#!/usr/bin/env bash
# The device check of issue 32, for a machine with a GPU (the project's GPU
# machines: one H100 or H200, CUDA 13, PyTorch 2.11 with CUDA, transformers
# 5.17, no network). In under 8 minutes it
#   1. builds the library, the cache and store suites and the Python module
#      with the CUDA backend and REWIND_CUDA_DEFAULT_STORAGE=ON (every cache
#      the suites make lives on CUDA device 0),
#   2. runs the conformance, sequence and store suites on it,
#   3. runs the Python tests with the `device` fixture on cpu and cuda,
#   4. runs the transformers integration on CUDA (scripts/transformers_check.py),
#   5. benchmarks update / crop / fork on the GPU against transformers'
#      DynamicCache on the same tensors (scripts/gpu_cache_bench.py),
# and writes everything to one file: $1, or $OUT/device_check.txt, or
# ./device_check.txt. A step that fails is reported and the next one runs.
#
#   scripts/device_check.sh [result-file]
# Environment: PYTHON (default python3: the interpreter with torch + CUDA),
# JOBS (default nproc), BUILD (default build-device), STEP_TIMEOUT (s, 240).
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
RESULT=${1:-${OUT:-.}/device_check.txt}
mkdir -p "$(dirname "$RESULT")"
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
BUILD=${BUILD:-build-device}
case "$BUILD" in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
STEP_TIMEOUT=${STEP_TIMEOUT:-240}
START=$(date +%s)
: > "$RESULT"

say() { echo "$*" | tee -a "$RESULT"; }
# step NAME COMMAND...: runs it with a time limit; its output goes to the
# result file (the last 60 lines when it fails, the last 15 otherwise).
step() {
  local name=$1 t0 rc log
  shift
  log=$(mktemp)
  say ""
  say "== $name"
  t0=$(date +%s)
  timeout "$STEP_TIMEOUT" "$@" > "$log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    tail -n 15 "$log" >> "$RESULT"
    say "-- $name: ok in $(( $(date +%s) - t0 )) s"
  else
    tail -n 60 "$log" >> "$RESULT"
    say "-- $name: FAILED (exit $rc) in $(( $(date +%s) - t0 )) s"
  fi
  rm -f "$log"
  return 0
}

say "rewind device check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
GPU=$(nvidia-smi -L 2>/dev/null | head -n 1)
say "GPU: ${GPU:-none found (nvidia-smi -L printed nothing)}"
say "nvcc: $( (nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>/dev/null) | tail -n 1)"
say "python: $($PYTHON -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1 | tail -n 1)"
say "transformers: $($PYTHON -c 'import transformers; print(transformers.__version__)' 2>&1 | tail -n 1)"
say "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores"

GENERATOR=()
command -v ninja > /dev/null && GENERATOR=(-G Ninja)
step "configure (CUDA backend, caches on cuda:0)" \
  cmake -S . -B "$BUILD" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release -DREWIND_CUDA_DEFAULT_STORAGE=ON \
  -DREWIND_BUILD_BENCH=OFF -DREWIND_BUILD_REDIS=OFF -DPYTHON_EXECUTABLE="$(command -v "$PYTHON")"
step "build" cmake --build "$BUILD" -j "$JOBS" --target rewind_cache_tests rewind_store_tests rewind_python
step "conformance and sequence suites on cuda:0" "$BUILD/tests/rewind_cache_tests" --gtest_brief=1
step "store suite on cuda:0" "$BUILD/tests/rewind_store_tests" --gtest_brief=1
step "Python tests (cpu and cuda)" env PYTHONPATH="$BUILD/python" REWIND_REQUIRE_DEVICE=cuda \
  "$PYTHON" -m pytest -q -p no:cacheprovider "$ROOT/tests/python"
step "transformers integration on cuda" env PYTHONPATH="$BUILD/python" \
  "$PYTHON" scripts/transformers_check.py --device cuda
step "GPU benchmark: update / crop / fork against transformers' DynamicCache" env PYTHONPATH="$BUILD/python" \
  "$PYTHON" scripts/gpu_cache_bench.py --device cuda

say ""
say "device check finished in $(( $(date +%s) - START )) s; results in $RESULT"
