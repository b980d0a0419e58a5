#!/usr/bin/env bash
# Install a single-node Slurm (+ munge) for tests/test_slurm.py.
# Idempotent; exits 0 without apt so the Slurm tests simply skip there.
set -euo pipefail

PKGS=(slurmctld slurmd slurm-client munge)

if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-query >/dev/null 2>&1; then
    echo "install_slurm: apt-get not available; Slurm tests will be skipped"
    exit 0
fi

missing=()
for p in "${PKGS[@]}"; do
    # "install ok installed" is the only state that means the package is usable.
    if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]; then
        missing+=("$p")
    fi
done

if [ ${#missing[@]} -eq 0 ]; then
    echo "install_slurm: already installed: ${PKGS[*]}"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "install_slurm: not root and no passwordless sudo; Slurm tests will be skipped"
        exit 0
    fi
fi

export DEBIAN_FRONTEND=noninteractive
echo "install_slurm: installing ${missing[*]}"
$SUDO apt-get update -q
# Packages' postinst may try to start services; without systemd that is a no-op,
# and the tests start their own daemons with private configs anyway.
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "install_slurm: done"
