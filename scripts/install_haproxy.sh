#!/usr/bin/env bash
# Installs Debian's `haproxy` package (the load balancer that `make fleet CONTROLLERS=N` and the
# several-controllers tests put in front of the controllers), unless haproxy is already on PATH.
# Idempotent; needs root or sudo. `make test` and `make fleet` run it. The package's service is
# not used: the launcher and the tests start haproxy themselves, in the foreground.
set -euo pipefail
if command -v haproxy >/dev/null 2>&1; then
  exit 0
fi
bash "$(dirname "$0")/apt_install.sh" haproxy
command -v haproxy >/dev/null
