#!/usr/bin/env bash
# Installs Debian's `prometheus` package (the server and promtool) for the metrics tests, unless
# both are already on PATH. Idempotent; needs root or sudo. `make test` runs it. The package
# starts no server here (no init system); the tests start their own.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  exit 0
fi
bash "$(dirname "$0")/apt_install.sh" prometheus
command -v prometheus >/dev/null && command -v promtool >/dev/null
