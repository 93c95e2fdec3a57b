#!/usr/bin/env bash
# Checks that every tracked C++ source is as .clang-format writes it
# (clang-format 14, Debian's clang-format-14: another version may break
# lines differently, so only that one is used).
#
#   scripts/check_format.sh          # exit 1 and the files that differ
#   scripts/check_format.sh --fix    # rewrites them in place
set -euo pipefail
cd "$(dirname "$0")/.."

formatter=clang-format-14
if ! command -v "$formatter" > /dev/null; then
  echo "check_format: $formatter not found (apt-get install clang-format-14)" >&2
  exit 1
fi

mapfile -t files < <(git ls-files '*.cc' '*.h' '*.inc' ':!:tests/fixtures/**')
if [ "${1:-}" = "--fix" ]; then
  "$formatter" -i --style=file "${files[@]}"
  exit 0
fi

bad=()
for f in "${files[@]}"; do
  if ! "$formatter" --style=file --dry-run --Werror "$f" > /dev/null 2>&1; then
    bad+=("$f")
  fi
done
if [ "${#bad[@]}" -gt 0 ]; then
  echo "check_format: ${#bad[@]} file(s) differ from .clang-format (scripts/check_format.sh --fix rewrites them):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "check_format: ${#files[@]} C++ files match .clang-format"
