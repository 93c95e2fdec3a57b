#!/usr/bin/env bash
# Checks `pip install` of the Python package as a user does it, offline:
# copies the checkout's files (tracked and untracked, not the ignored ones:
# what a fresh clone plus local edits holds) to a temporary directory, makes
# a venv there with the system's site packages (numpy, torch, pytest,
# setuptools, wheel, pybind11 from Debian), runs
#   pip install --no-build-isolation --no-index <copy>
# then, from outside the source tree and without PYTHONPATH, imports the
# installed module, checks it links no libtorch, and runs tests/python
# against it.
#
# usage: scripts/check_pip_install.sh [PYTHON]   (default /usr/bin/python3)
# Environment: CMAKE_ARGS, CMAKE_BUILD_PARALLEL_LEVEL (passed to setup.py);
# KEEP=1 leaves the temporary directory. Uses ccache when it is on PATH.
set -euo pipefail

PYTHON=${1:-/usr/bin/python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=$(mktemp -d /tmp/rewind-pip-check.XXXXXX)
if [ "${KEEP:-0}" = 1 ]; then
  echo "check_pip_install: keeping $WORK"
else
  trap 'rm -rf "$WORK"' EXIT
fi

mkdir "$WORK/src"
# Files deleted in the work tree but still in the index are left out.
git -C "$ROOT" ls-files -z --cached --others --exclude-standard |
  (cd "$ROOT" && while IFS= read -r -d '' f; do if [ -f "$f" ]; then printf '%s\0' "$f"; fi; done) |
  tar -C "$ROOT" --null -T - -cf - | tar -C "$WORK/src" -xf -

"$PYTHON" -m venv --system-site-packages "$WORK/venv"
VPY=$WORK/venv/bin/python

if [ -z "${CMAKE_ARGS:-}" ] && command -v ccache > /dev/null; then
  # Paths below the temporary directory hash as relative ones, so a later
  # run (another directory) reuses the objects.
  export CMAKE_ARGS="-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache"
  export CCACHE_BASEDIR=$WORK
fi
# --no-index: nothing may come from the network; numpy must already be there.
"$VPY" -m pip install --no-build-isolation --no-index --quiet "$WORK/src"

cd "$WORK"
env -u PYTHONPATH "$VPY" - "$WORK/venv" <<'EOF'
import glob, os, subprocess, sys
import rewind, rewind._rewind
venv = os.path.realpath(sys.argv[1])
for mod in (rewind, rewind._rewind):
    path = os.path.realpath(mod.__file__)
    assert path.startswith(venv + os.sep), f"{mod.__name__} imported from {path}, not from the venv {venv}"
ldd = subprocess.run(["ldd", rewind._rewind.__file__], capture_output=True, text=True, check=True).stdout
linked = [line.split()[0] for line in ldd.splitlines() if line.strip()]
assert not any(("torch" in lib or "c10" in lib) for lib in linked), f"the module links torch: {linked}"
import numpy as np
cache = rewind.DynamicCache()
k = np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4)
keys, _ = cache.update(k, k, 0)
assert cache.get_seq_length() == 3 and np.array_equal(np.asarray(keys), k), keys
cache.crop(-1)
assert cache.get_seq_length() == 2
print(f"check_pip_install: rewind {rewind.__version__} installed in {venv} "
      f"(python {sys.version.split()[0]}); the module links {len(linked)} libraries, no torch")
EOF

cd "$WORK/src/tests/python"
env -u PYTHONPATH OMP_NUM_THREADS=1 "$VPY" -m pytest -q -p no:cacheprovider .
