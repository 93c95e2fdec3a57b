#!/bin/sh
# Installs what scripts/train/ needs, from Debian's archive only (no pip):
#   python3-torch        PyTorch 1.13 (CPU)
#   libopenblas0-pthread a fast BLAS for torch (without it torch falls back to
#                        the reference BLAS, ~15x slower matmuls)
#   python3-numpy        array conversion in the exporter
#   bible-kjv            the training corpus (`bible` prints the KJV text)
# Idempotent: installs only what is missing; skips apt when nothing is.
set -eu
PACKAGES="python3-torch libopenblas0-pthread python3-numpy bible-kjv"
missing=""
for p in $PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -z "$missing" ]; then
  echo "setup: all of $PACKAGES already installed"
  exit 0
fi
echo "setup: installing:$missing"
if [ "$(id -u)" != 0 ]; then
  echo "setup: run as root (or install:$missing)" >&2
  exit 1
fi
apt-get update
DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing
