#!/usr/bin/env bash
# Install Debian packages the tests use (real Slurm + munge; h5ls/h5dump from hdf5-tools):
#   bash .ci/install_debian.sh PKG...
# Idempotent: installs only what is missing. Exits 0 without apt-get, or without root or
# passwordless sudo: the tests that need these packages then skip with a reason.
set -euo pipefail

if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-query >/dev/null 2>&1; then
    echo "install_debian: apt-get not available; tests needing $* will be skipped"
    exit 0
fi

missing=()
for p in "$@"; do
    # "install ok installed" is the only state that means the package is usable.
    if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]; then
        missing+=("$p")
    fi
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "install_debian: already installed: $*"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "install_debian: not root and no passwordless sudo; tests needing ${missing[*]} will be skipped"
        exit 0
    fi
fi

echo "install_debian: installing ${missing[*]}"
$SUDO apt-get update -q
# Post-install scripts may try to start services; without systemd that is a no-op, and the
# Slurm tests start their own daemons with private configs anyway.
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "install_debian: done"
