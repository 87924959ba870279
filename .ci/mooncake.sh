#!/usr/bin/env bash
# Install what the Mooncake Store tests need, idempotently: the RDMA user-space libraries the
# transfer engine links against (even for TCP) and the CPU-only build of the Mooncake wheel.
set -euo pipefail

need_apt=0
for pkg in libibverbs1 ibverbs-providers; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt=1
done
if [ "$need_apt" = 1 ]; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 ibverbs-providers
fi

PY="${PYTHON:-python}"
if ! "$PY" -c "import mooncake.store" 2>/dev/null || ! command -v mooncake_master >/dev/null; then
  # the plain mooncake-transfer-engine wheel is a CUDA build that does not import without a GPU
  "$PY" -m pip install -q "mooncake-transfer-engine-non-cuda>=0.3.13"
fi
"$PY" -c "import mooncake.store" && command -v mooncake_master >/dev/null
echo "mooncake: ready ($(command -v mooncake_master))"
