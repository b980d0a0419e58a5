#!/usr/bin/env bash
# Install Debian's HDF5 command-line tools (h5ls, h5dump) for tests/test_checkpoint.py,
# which checks that checkpoints read correctly with them.
# Idempotent; exits 0 without apt (or root) so those tests simply skip there.
set -euo pipefail

PKG=hdf5-tools

if command -v h5ls >/dev/null 2>&1 && command -v h5dump >/dev/null 2>&1; then
    echo "install_hdf5_tools: already installed ($(command -v h5dump))"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_hdf5_tools: apt-get not available; h5ls/h5dump tests will be skipped"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "install_hdf5_tools: not root and no passwordless sudo; h5ls/h5dump tests will be skipped"
        exit 0
    fi
fi

echo "install_hdf5_tools: installing $PKG"
$SUDO apt-get update -q
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$PKG"
echo "install_hdf5_tools: done ($(command -v h5dump))"
