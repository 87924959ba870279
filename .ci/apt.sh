#!/usr/bin/env bash
# Install Debian packages that are not installed yet (no apt-get at all when every one is): the
# one place .ci/run, .ci/mooncake.sh and .ci/vllm.sh ensure system libraries.
#
# Usage: bash .ci/apt.sh PACKAGE...
set -euo pipefail

missing=()
for pkg in "$@"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ "${#missing[@]}" = 0 ] && exit 0
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
