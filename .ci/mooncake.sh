#!/usr/bin/env bash
# Install what the Mooncake Store tests need, idempotently: the RDMA user-space libraries the
# transfer engine links against (even for TCP) and the CPU-only build of the Mooncake wheel.
set -euo pipefail

bash "$(dirname "$0")/apt.sh" libibverbs1 ibverbs-providers

PY="${PYTHON:-python}"
if ! "$PY" -c "import mooncake.store" 2>/dev/null || ! command -v mooncake_master >/dev/null; then
  # the plain mooncake-transfer-engine wheel is a CUDA build that does not import without a GPU
  "$PY" -m pip install -q "mooncake-transfer-engine-non-cuda>=0.3.13"
fi
"$PY" -c "import mooncake.store" && command -v mooncake_master >/dev/null
echo "mooncake: ready ($(command -v mooncake_master))"
