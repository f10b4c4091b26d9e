#!/usr/bin/env bash
# Installs Debian's `prometheus` package (the server and promtool) for the metrics tests, unless
# both are already on PATH. Idempotent; needs root or sudo. `make test` runs it.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "apt-get not found: put a prometheus server and promtool (2.x) on PATH" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
# The package's post-install starts no server here (no init system); the tests start their own.
$SUDO apt-get install -y -q --no-install-recommends prometheus
command -v prometheus >/dev/null && command -v promtool >/dev/null
