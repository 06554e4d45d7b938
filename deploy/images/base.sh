#!/usr/bin/env bash
# Builds the Python base image both Dockerfiles start FROM, without pulling anything from a registry:
# debootstrap a minimal Debian bookworm (python3.11, venv, python -> python3) from the Debian mirror this
# machine's apt already uses, bring it up to date with bookworm-security, and `docker import` it.
# Cached: an existing image of that name is kept unless REBUILD=1.
#   deploy/images/base.sh [IMAGE]        (default diloco/python:3.11-bookworm)
set -euo pipefail

IMAGE="${1:-diloco/python:3.11-bookworm}"
SUITE=bookworm
DOCKER="${DOCKER:-docker}"

if [[ "${REBUILD:-0}" != 1 ]] && "$DOCKER" image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "base image $IMAGE exists (REBUILD=1 to rebuild)"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install -y debootstrap" >&2; exit 1; }
[[ $(id -u) == 0 ]] || { echo "debootstrap needs root" >&2; exit 1; }

# The mirror apt is configured with (deb822 or one-line format); deb.debian.org otherwise.
mirror_of() {
  local pattern=$1
  cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk -v p="$pattern" '
    /^URIs:/ { uri = $2 } /^Suites:/ && $0 ~ p { print uri; exit }'
}
MIRROR="${DEBIAN_MIRROR:-$(mirror_of " $SUITE( |$)")}"
SECURITY_MIRROR="${DEBIAN_SECURITY_MIRROR:-$(mirror_of " $SUITE-security")}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
SECURITY_MIRROR="${SECURITY_MIRROR:-http://deb.debian.org/debian-security}"

ROOTFS="$(mktemp -d /var/tmp/diloco-base.XXXXXX)"
cleanup() {
  for fs in proc sys dev/pts dev; do umount "$ROOTFS/$fs" 2>/dev/null || true; done
  rm -rf --one-file-system "$ROOTFS" "$ROOTFS.log"
}
trap cleanup EXIT

echo "debootstrap $SUITE from $MIRROR into $ROOTFS"
debootstrap --variant=minbase --include=python3.11,python3.11-venv,python3-venv,python-is-python3 \
  "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 || { tail -30 "$ROOTFS.log" >&2; exit 1; }
rm -f "$ROOTFS.log"

cat >"$ROOTFS/etc/apt/sources.list" <<SOURCES
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY_MIRROR $SUITE-security main
SOURCES
echo "applying $SUITE-updates and $SUITE-security"
mount -t proc proc "$ROOTFS/proc"
chroot "$ROOTFS" /bin/sh -c 'export DEBIAN_FRONTEND=noninteractive
  apt="apt-get -q -o APT::Sandbox::User=root"
  $apt update && $apt -y --no-install-recommends dist-upgrade && $apt clean' >"$ROOTFS.log" 2>&1 \
  || { tail -30 "$ROOTFS.log" >&2; exit 1; }
rm -f "$ROOTFS.log"
umount "$ROOTFS/proc"
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/log/*.log \
  "$ROOTFS"/var/cache/debconf/*-old "$ROOTFS"/tmp/* "$ROOTFS"/root/.cache
chroot "$ROOTFS" python --version

tar --numeric-owner -C "$ROOTFS" -c . | "$DOCKER" import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["python"]' \
  --message "debootstrap $SUITE minbase + python3.11 from $MIRROR" \
  - "$IMAGE" >/dev/null
echo "built $IMAGE ($("$DOCKER" image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
