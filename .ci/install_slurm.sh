#!/usr/bin/env bash
# Install the Slurm and munge binaries that tests/slurm/ needs to stand up a throwaway
# 2-node cluster on this machine (see tests/slurm/conftest.py and docs/slurm.md).
# Debian/Ubuntu only, as root. Safe to run twice. CI calls it before `pytest tests/slurm`.
set -euo pipefail

have_all() {
    command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged \
        && command -v mungekey && command -v unshare
} >/dev/null 2>&1

if have_all; then
    echo "slurm and munge already installed: $(slurmd -V)"
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "install_slurm.sh: needs root (apt-get); re-run with sudo" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null; then
    echo "install_slurm.sh: no apt-get; install slurm-wlm and munge with your package manager" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# --no-install-recommends: no MariaDB/slurmdbd and friends; the test cluster needs none of them.
# util-linux provides unshare/nsenter (normally present already).
apt-get install -y -q --no-install-recommends slurm-wlm munge util-linux
echo "installed: $(slurmd -V)"
