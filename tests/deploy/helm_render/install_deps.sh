#!/usr/bin/env bash
# Installs what tests/deploy/helm_render needs (Go, sprig and a YAML library, from Debian's packages),
# unless a helm binary is on PATH or the packages are already there. Idempotent; needs root or
# sudo. `make chart-deps` runs it, and tests/deploy/test_chart.py runs it when the renderer cannot be built.
set -euo pipefail
GOPATH_DIR=/usr/share/gocode/src/github.com
have() {
  command -v go >/dev/null 2>&1 \
    && [ -d "$GOPATH_DIR/Masterminds/sprig" ] && [ -d "$GOPATH_DIR/ghodss/yaml" ]
}
if command -v helm >/dev/null 2>&1; then
  echo "helm found on PATH: the chart tests render with it"
  exit 0
fi
if have; then
  exit 0
fi
bash "$(dirname "$0")/../../../scripts/apt_install.sh" \
  golang-go golang-github-masterminds-sprig-dev golang-github-ghodss-yaml-dev
have
