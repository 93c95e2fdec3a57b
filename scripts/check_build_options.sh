#!/usr/bin/env bash
# Configures each CMake option combination that the README, the Makefile
# and docs/ name, each in its own scratch directory, and fails if one does
# not configure and generate (`make test` runs it; configuring is seconds,
# where building every combination would be an hour on 2 cores).
#
#   scripts/check_build_options.sh [--build]
#
# --build also builds each combination's default targets (slow; for a
# change to the build files). The fuzz combination needs clang and is left
# out, with a note, where clang++ is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
build=0
if [ "${1:-}" = --build ]; then build=1; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# name|compiler (gcc or clang)|cmake options
combinations=(
  "default|gcc|-DCMAKE_BUILD_TYPE=Release -DREWIND_WERROR=ON"
  "make-install|gcc|-DCMAKE_BUILD_TYPE=Release -DREWIND_BUILD_TESTS=OFF -DREWIND_BUILD_BENCH=OFF -DREWIND_BUILD_RUNTIME=OFF -DREWIND_BUILD_REDIS=OFF -DREWIND_BUILD_PYTHON=OFF"
  "readme-library-alone|gcc|-DCMAKE_BUILD_TYPE=Release -DREWIND_BUILD_TESTS=OFF -DREWIND_BUILD_BENCH=OFF -DREWIND_BUILD_RUNTIME=OFF"
  "library-tests-no-runtime|gcc|-DCMAKE_BUILD_TYPE=Release -DREWIND_BUILD_RUNTIME=OFF -DREWIND_BUILD_BENCH=OFF"
  "no-redis|gcc|-DCMAKE_BUILD_TYPE=Release -DREWIND_WERROR=ON -DREWIND_BUILD_REDIS=OFF"
  "no-server|gcc|-DCMAKE_BUILD_TYPE=Release -DREWIND_WERROR=ON -DREWIND_BUILD_SERVER=OFF"
  "make-demo|gcc|-DCMAKE_BUILD_TYPE=Release -DREWIND_BUILD_TESTS=OFF -DREWIND_BUILD_BENCH=OFF -DREWIND_BUILD_PYTHON=OFF -DREWIND_BUILD_REDIS=OFF"
  "make-python|gcc|-DCMAKE_BUILD_TYPE=Release -DREWIND_BUILD_TESTS=OFF -DREWIND_BUILD_BENCH=OFF -DREWIND_BUILD_PYTHON=ON"
  "bench-no-tests|gcc|-DCMAKE_BUILD_TYPE=Release -DREWIND_BUILD_TESTS=OFF"
  "runtime-no-tests-no-bench|gcc|-DCMAKE_BUILD_TYPE=Release -DREWIND_BUILD_TESTS=OFF -DREWIND_BUILD_BENCH=OFF"
  "debug-views|gcc|-DCMAKE_BUILD_TYPE=Debug -DREWIND_DEBUG_VIEWS=ON -DREWIND_BUILD_BENCH=OFF"
  "asan|gcc|-DCMAKE_BUILD_TYPE=Debug -DREWIND_SANITIZE=ON -DREWIND_WERROR=ON -DREWIND_BUILD_BENCH=OFF -DREWIND_BUILD_PYTHON=OFF"
  "tsan|gcc|-DCMAKE_BUILD_TYPE=Debug -DREWIND_TSAN=ON -DREWIND_BUILD_BENCH=OFF -DREWIND_BUILD_PYTHON=OFF"
  "test-guarded|gcc|-DCMAKE_BUILD_TYPE=Release -DREWIND_GUARDED_STORAGE=ON -DREWIND_BUILD_RUNTIME=OFF -DREWIND_BUILD_PYTHON=OFF -DREWIND_BUILD_BENCH=OFF -DREWIND_WERROR=ON"
  "no-cuda|gcc|-DCMAKE_BUILD_TYPE=Release -DREWIND_CUDA=OFF -DREWIND_WERROR=ON"
  "fuzz|clang|-DCMAKE_BUILD_TYPE=RelWithDebInfo -DREWIND_FUZZ=ON -DREWIND_BUILD_TESTS=OFF -DREWIND_BUILD_BENCH=OFF -DREWIND_BUILD_PYTHON=OFF"
)

failed=()
start=$SECONDS
for entry in "${combinations[@]}"; do
  IFS='|' read -r name compiler options <<< "$entry"
  env=()
  if [ "$compiler" = clang ]; then
    if ! command -v clang++ > /dev/null; then
      echo "build-options: $name skipped: no clang++ (apt-get install clang)"
      continue
    fi
    env=(CC=clang CXX=clang++)
  fi
  dir=$work/$name
  t=$SECONDS
  # shellcheck disable=SC2086  # the options are words
  if env "${env[@]}" cmake -S . -B "$dir" $options > "$dir.log" 2>&1 &&
     { [ $build = 0 ] || cmake --build "$dir" -j "${JOBS:-2}" >> "$dir.log" 2>&1; }; then
    echo "build-options: $name ok ($((SECONDS - t)) s): $options"
  else
    tail -n 30 "$dir.log"
    echo "build-options: $name FAILED: $options" >&2
    failed+=("$name")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "build-options: ${#failed[@]} combination(s) failed: ${failed[*]}" >&2
  exit 1
fi
echo "build-options: every combination $([ $build = 1 ] && echo builds || echo configures) ($((SECONDS - start)) s)"
