#!/usr/bin/env bash
# Installs the library into a temporary prefix, then builds the README's
# example against it twice: with find_package(rewind) and with pkg-config.
# Usage: install_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" > /dev/null
test -f "$work/prefix/include/rewind/cache.h"
cmake -S "$src/tests/install/consumer" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build "$work/consumer" > /dev/null
"$work/consumer/consumer" > "$work/out.txt"
grep -q "after crop(-3): L = 2" "$work/out.txt"
libdir=$(ls -d "$work"/prefix/lib*/pkgconfig | head -n 1)
PKG_CONFIG_PATH="$libdir" c++ "$src/examples/quickstart.cc" $(PKG_CONFIG_PATH="$libdir" pkg-config --cflags --libs rewind) \
  -o "$work/pc_consumer"
"$work/pc_consumer" | grep -q "after crop(-3): L = 2"
echo "installed rewind works through find_package and pkg-config"
