#!/usr/bin/env bash
# Installs the library into a temporary prefix and checks what a user gets:
#   - librewind.so with a versioned SONAME (0.x: librewind.so.MAJOR.MINOR),
#     exporting the public API (rwd::*) and no rwd::detail symbol;
#   - no dependency on the test / benchmark / runtime libraries (GoogleTest,
#     Google Benchmark, OpenMP);
#   - the README's example and abi_check.cc, built with -std=c++23 (C++20 is
#     the minimum, not a pin) through find_package(rewind) and through
#     pkg-config, run against the installed library: an exception thrown in
#     the library is caught by type in the consumer;
#   - a plain install is the library alone (no rewind/redis_store.h, whose
#     library is not installed; no runtime), and in a build with the runtime
#     the optional component `runtime` adds bin/rewind and rewind::runtime
#     (librewind_runtime.so), which a find_package(rewind COMPONENTS runtime)
#     consumer links and runs.
# Works on any configured and built tree: `make install`'s library-only one
# or the full build (Release, tests on; ctest runs it as
# install_and_find_package).
# Usage: install_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() {
  echo "install_test: FAIL: $*" >&2
  exit 1
}
prefix=$work/prefix

cmake --install "$build" --prefix "$prefix" > "$work/install.log" || { cat "$work/install.log"; fail "cmake --install"; }
test -f "$prefix/include/rewind/cache.h" || fail "headers not installed"
# A plain install is the library alone: no header of something it does not
# ship (the Redis store is in-tree only), no runtime component.
test ! -e "$prefix/include/rewind/redis_store.h" || fail "rewind/redis_store.h installed without its library"
test ! -e "$prefix/include/rewind/open_store.h" || fail "rewind/open_store.h installed without its library"
for path in bin/rewind include/runtime; do
  test ! -e "$prefix/$path" || fail "$path installed by a plain install (it belongs to the runtime component)"
done

# ---- the shared library: SONAME, exports, dependencies -------------------
link=$(find "$prefix" -name librewind.so | head -n 1)
test -n "$link" || fail "no librewind.so under $prefix"
libdir=$(dirname "$link")
version=$(sed -n 's/^set(PACKAGE_VERSION "\(.*\)")$/\1/p' "$libdir/cmake/rewind/rewindConfigVersion.cmake")
IFS=. read -r major minor _ <<< "$version"
if [ "$major" = 0 ]; then soname=librewind.so.$major.$minor; else soname=librewind.so.$major; fi
test -f "$libdir/librewind.so.$version" && ! test -L "$libdir/librewind.so.$version" ||
  fail "librewind.so.$version is not a regular file"
test "$(readlink "$libdir/$soname")" = "librewind.so.$version" || fail "$soname does not point to librewind.so.$version"
test "$(readlink "$link")" = "$soname" || fail "librewind.so does not point to $soname"
got=$(readelf -d "$libdir/librewind.so.$version" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
test "$got" = "$soname" || fail "SONAME is '$got', expected '$soname'"

exports=$(nm -DC --defined-only "$libdir/librewind.so.$version")
detail=$(grep -cE 'rwd::detail|rwd::(Layer|Cache|SequenceCache)::Impl' <<< "$exports" || true)
test "$detail" = 0 || { grep -E 'rwd::detail|rwd::(Layer|Cache|SequenceCache)::Impl' <<< "$exports" | head >&2; fail "$detail rwd::detail / Impl symbols exported"; }
for symbol in 'rwd::Cache::crop(long)' 'rwd::Layer::crop(long)' 'typeinfo for rwd::RollbackError' \
              'vtable for rwd::Error'; do
  grep -qF " $symbol" <<< "$exports" || fail "'$symbol' is not exported"
done
# Outputs are captured before they are searched: with pipefail, `cmd | grep -q`
# fails whenever grep exits at the first match before cmd has written the rest
# (cmd gets SIGPIPE), which made this test fail at random on a fresh machine.
foreign=$(grep -v ' rwd::\| typeinfo for rwd::\| typeinfo name for rwd::\| vtable for rwd::' <<< "$exports" || true)
if test -n "$foreign"; then
  head <<< "$foreign" >&2
  fail "symbols outside rwd are exported"
fi

needed=$(readelf -d "$libdir/librewind.so.$version" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
for lib in $needed; do
  case $lib in
    libstdc++.so.* | libm.so.* | libgcc_s.so.* | libc.so.* | ld-linux*) ;;
    *) fail "librewind.so needs $lib (only the C++ runtime is expected)" ;;
  esac
done
if ldd "$libdir/librewind.so.$version" | grep -E 'libgomp|libomp|libbenchmark|libgtest|libgmock'; then
  fail "librewind.so pulls in a test, benchmark or OpenMP library"
fi

# ---- consumers: C++23, find_package and pkg-config -------------------------
std=c++23
echo 'int main() {}' | c++ -std=c++23 -x c++ -fsyntax-only - 2> /dev/null || std=c++2b  # GCC < 11

# Both consumers must print the README's result, the refused crop (a
# RollbackError thrown inside librewind.so, caught by type in the example),
# and catch an IndexError as rwd::Error; and run on the installed .so.
check_consumer() {  # NAME QUICKSTART ABI_CHECK
  local name=$1 quickstart=$2 abi=$3
  "$quickstart" > "$work/$name.out" || { cat "$work/$name.out"; fail "$name: example failed"; }
  grep -q "after crop(-3): L = 2" "$work/$name.out" || { cat "$work/$name.out"; fail "$name: wrong example output"; }
  grep -q "^refused: " "$work/$name.out" || { cat "$work/$name.out"; fail "$name: RollbackError not caught"; }
  "$abi" > "$work/$name.abi" || { cat "$work/$name.abi"; fail "$name: abi_check failed"; }
  grep -q "^caught rwd::Error (IndexError)" "$work/$name.abi" || fail "$name: IndexError not caught as rwd::Error"
  local cplusplus
  cplusplus=$(sed -n 's/^__cplusplus //p' "$work/$name.abi")
  test "$cplusplus" -gt 202002 || fail "$name: compiled as __cplusplus $cplusplus, not the requested $std"
  for exe in "$quickstart" "$abi"; do
    local loaded
    loaded=$(ldd "$exe")
    grep -qF "$soname => $libdir/$soname" <<< "$loaded" || { echo "$loaded"; fail "$name: $exe does not load $libdir/$soname"; }
  done
}

cmake -S "$src/tests/install/consumer" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_STANDARD=${std#c++} -DCMAKE_CXX_STANDARD_REQUIRED=ON \
  > "$work/consumer.log" 2>&1 || { cat "$work/consumer.log"; fail "find_package consumer: configure"; }
cmake --build "$work/consumer" > "$work/consumer.log" 2>&1 || { cat "$work/consumer.log"; fail "find_package consumer: build"; }
check_consumer find_package "$work/consumer/consumer" "$work/consumer/abi_check"

export PKG_CONFIG_PATH=$libdir/pkgconfig
cflags=$(pkg-config --cflags rewind)
libs=$(pkg-config --libs rewind)
case " $cflags " in *" -std="*) fail "pkg-config --cflags forces a standard: $cflags" ;; esac
# shellcheck disable=SC2086  # the flags are words
c++ -std=$std "$src/examples/quickstart.cc" $cflags $libs -Wl,-rpath,"$libdir" -o "$work/pc_consumer"
# shellcheck disable=SC2086
c++ -std=$std "$src/tests/install/consumer/abi_check.cc" $cflags $libs -Wl,-rpath,"$libdir" -o "$work/pc_abi_check"
check_consumer pkg-config "$work/pc_consumer" "$work/pc_abi_check"

# ---- the optional runtime component (builds with the runtime) -------------
runtime_note="no runtime in this build"
if test -f "$build/runtime/librewind_runtime.so"; then
  cmake --install "$build" --prefix "$prefix" --component runtime > "$work/runtime.log" ||
    { cat "$work/runtime.log"; fail "cmake --install --component runtime"; }
  test -x "$prefix/bin/rewind" || fail "the runtime component has no bin/rewind"
  test -f "$prefix/include/runtime/model.h" || fail "the runtime component has no runtime headers"
  cmake -S "$src/tests/install/runtime_consumer" -B "$work/runtime_consumer" -DCMAKE_PREFIX_PATH="$prefix" \
    -DCMAKE_BUILD_TYPE=Release > "$work/runtime_consumer.log" 2>&1 ||
    { cat "$work/runtime_consumer.log"; fail "runtime consumer: configure"; }
  cmake --build "$work/runtime_consumer" > "$work/runtime_consumer.log" 2>&1 ||
    { cat "$work/runtime_consumer.log"; fail "runtime consumer: build"; }
  got=$("$work/runtime_consumer/runtime_consumer" "$src/models/kjv-draft/config.json") || fail "runtime consumer failed"
  layers=$(sed -n 's/.*"num_hidden_layers": *\([0-9]*\).*/\1/p' "$src/models/kjv-draft/config.json")
  test "$got" = "family rewind_hybrid, $layers layers" || fail "runtime consumer printed '$got', expected $layers layers"
  loaded=$(ldd "$work/runtime_consumer/runtime_consumer")
  grep -q "librewind_runtime.so.* => $libdir/" <<< "$loaded" || { echo "$loaded"; fail "runtime consumer does not load $libdir/librewind_runtime.so"; }
  "$prefix/bin/rewind" inspect --model "$src/models/kjv-draft" > "$work/inspect.out" 2>&1 ||
    { cat "$work/inspect.out"; fail "installed bin/rewind inspect failed"; }
  runtime_note="runtime component: bin/rewind and rewind::runtime (librewind_runtime.so) work"
fi

echo "installed rewind works: $soname ($(grep -c . <<< "$exports") exported symbols, none in rwd::detail;" \
  "needs ${needed//$'\n'/ }); find_package and pkg-config consumers built with -std=$std catch its exceptions by type;" \
  "$runtime_note"
