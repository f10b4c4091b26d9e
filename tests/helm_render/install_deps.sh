#!/usr/bin/env bash
# Installs what tests/helm_render needs (Go, sprig and a YAML library, from Debian's packages),
# unless a helm binary is on PATH or the packages are already there. Idempotent; needs root or
# sudo. `make chart-deps` runs it, and tests/test_chart.py runs it when the renderer cannot be built.
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
if ! command -v apt-get >/dev/null 2>&1; then
  echo "apt-get not found: install Go 1.19+, Masterminds/sprig v3 and ghodss/yaml in GOPATH mode" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends \
  golang-go golang-github-masterminds-sprig-dev golang-github-ghodss-yaml-dev
have
