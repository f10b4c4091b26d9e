#!/usr/bin/env bash
# A local base image for docker/*.Dockerfile where no image registry is reachable (the tests):
# Debian bookworm from Debian's package mirror (debootstrap), with Debian's Python 3.11 laid out
# as the official python:3.11-slim-bookworm image users build from lays it out (`python` on PATH,
# venv and ensurepip, Python's C headers, CA certificates, apt for the GPU image's compiler),
# imported into podman.
#
#   scripts/build_base_image.sh [IMAGE]     default IMAGE: localhost/tandem-base:bookworm-py3.11-v2
#
# Idempotent: an existing IMAGE is kept (delete it with `podman rmi IMAGE` to rebuild).
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian). Root, podman, debootstrap.
set -euo pipefail
IMAGE="${1:-localhost/tandem-base:bookworm-py3.11-v2}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if podman image exists "$IMAGE"; then
  echo "base image $IMAGE exists"
  exit 0
fi
ROOTFS="$(mktemp -d /var/tmp/tandem-base.XXXXXX)"
trap 'rm -rf "$ROOTFS"' EXIT

# minbase: dpkg, apt and essentials only; Python and what a venv needs on top. The official
# image ships Python's headers (Triton's launcher build includes Python.h); Debian splits them
# into libpython3.11-dev. The tag's -vN changes whenever this list does.
debootstrap --variant=minbase \
  --include=python3,python3-venv,python-is-python3,libpython3.11-dev,ca-certificates \
  bookworm "$ROOTFS" "$MIRROR"
# The official image's apt sources (the GPU image installs a compiler at build time), and no
# package lists or caches in the layer.
cat >"$ROOTFS/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
EOF
# This machine's extra CA certificates (an egress proxy's), so that pip reaches the package
# index from inside a build here as it does on the host: a test base, never a release base.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$ROOTFS/usr/local/share/ca-certificates/"
  chroot "$ROOTFS" update-ca-certificates >/dev/null
fi
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/cache/apt/archives/*.deb

tar -C "$ROOTFS" -c . | podman import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  - "$IMAGE"
echo "built base image $IMAGE"
