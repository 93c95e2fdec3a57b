#!/usr/bin/env bash
# Checks the one-way include rules of docs/architecture.md ("What each
# folder may include"): the library includes nothing of the runtime, the
# front ends or the tests; the cache room nothing of the store room; the
# base headers only lower base headers; public headers no private ones; the
# runtime only the library's public headers; the kernels nothing of the
# model or the cache; the examples only public headers. The exceptions the
# document lists are allowed by name below, so that a new one fails.
#
#   scripts/check_includes.sh        # exit 1 and one line per violation
set -euo pipefail
cd "$(dirname "$0")/.."

# "file|included header" pairs that docs/architecture.md names as exceptions.
allowed=(
  "src/store/snapshot_format.cc|cache/layer_kinds.h"
  "src/store/prefix_cache.cc|cache/warnings.h"
)

violations=0
is_allowed() {
  local pair
  for pair in "${allowed[@]}"; do
    [ "$pair" = "$1|$2" ] && return 0
  done
  return 1
}

# check RULE PATTERN FILES...: each quoted or angle include of FILES that
# matches the extended regex PATTERN (on the header name) is a violation.
check() {
  local rule=$1 pattern=$2
  shift 2
  local f line header
  for f in "$@"; do
    [ -f "$f" ] || continue
    while IFS=: read -r line header; do
      if is_allowed "$f" "$header"; then continue; fi
      echo "$f:$line: includes $header ($rule)"
      violations=1
    done < <(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*["<]' "$f" |
             sed -E 's/^([0-9]+):[^"<]*["<]([^">]*)[">].*/\1:\2/' | grep -E ":($pattern)\$" || true)
  done
}

shopt -s nullglob globstar
library=(include/rewind/*.h src/**/*.h src/**/*.cc)
third_party='nlohmann/.*|CLI/.*|pybind11/.*|gtest/.*|gmock/.*|benchmark/.*|omp\.h|pcre2\.h|unicode/.*'

check "the library reaches up into the runtime, a front end or the tests" \
  'runtime/.*|tools/.*|pinning\.h|conformance/.*|.*_test\.h|fuzz_.*\.h|bench_common\.h' "${library[@]}"
check "the library depends on the standard library alone" "$third_party" "${library[@]}"
check "hiredis belongs to src/store/redis/ alone" 'hiredis/.*' include/rewind/*.h src/*.cc src/cache/* src/store/*.cc src/store/*.h
check "a public header includes a private one" 'cache/.*|store/.*|aligned_memory\.h|tensor_copy\.h' include/rewind/*.h
check "the cache room reaches up into the store room" \
  'store/.*|rewind/store\.h|rewind/prefix_cache\.h|rewind/redis_store\.h' src/cache/*
check "the store room includes the cache room's private headers" 'cache/.*' src/store/**/*.h src/store/**/*.cc
check "error.h is the bottom of the stack" 'rewind/.*' include/rewind/error.h
check "dtype sits on error alone" 'rewind/(tensor|layer|cache|sequences|tree|snapshot|store|prefix_cache|redis_store|checksum|warnings|encoder_decoder_cache)\.h' \
  include/rewind/dtype.h src/dtype.cc
check "tensor sits on dtype and error alone" 'rewind/(layer|cache|sequences|tree|snapshot|store|prefix_cache|redis_store|checksum|warnings|encoder_decoder_cache)\.h' \
  include/rewind/tensor.h src/tensor.cc src/tensor_copy.h src/aligned_memory.h src/aligned_memory.cc
runtime=(runtime/**/*.h runtime/**/*.cc runtime/**/*.inc)
check "the runtime uses only the library's public headers" \
  'cache/.*|store/.*|aligned_memory\.h|tensor_copy\.h' "${runtime[@]}"
check "the runtime reaches up into a front end or the tests" \
  'tools/.*|pinning\.h|CLI/.*|pybind11/.*|conformance/.*|gtest/.*|benchmark/.*|.*_test\.h' "${runtime[@]}"
check "the kernels take pointers and shapes, nothing of the model or the cache" \
  'runtime/(model|model_config|weights_io|generate|eval|decode_bench|tokenizer)\.h|rewind/(cache|sequences|layer|tree|snapshot)\.h' \
  runtime/kernels*.cc runtime/kernels*.h runtime/include/runtime/kernels*.h runtime/kernels/**/*.h runtime/kernels/**/*.cc
check "an example uses the library's public headers alone (it is built against an installed copy)" \
  'runtime/.*|cache/.*|store/.*|aligned_memory\.h|tensor_copy\.h|conformance/.*|.*_test\.h|bench_common\.h|nlohmann/.*|CLI/.*' \
  examples/*.cc examples/*.h

if [ "$violations" = 0 ]; then
  echo "check_includes: the include rules of docs/architecture.md hold (${#allowed[@]} named exceptions)"
fi
exit "$violations"
