#!/usr/bin/env bash
# Installs Debian packages without recommends (root, or through sudo). Used by the scripts that
# set up what the tests need; each checks first whether its tools are already there.
set -euo pipefail
if ! command -v apt-get >/dev/null 2>&1; then
  echo "apt-get not found: install $* by other means" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "$@"
