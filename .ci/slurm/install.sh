#!/usr/bin/env bash
# Install the Debian (bookworm) packages needed for the throw-away Slurm test cluster.
# Idempotent: returns immediately when everything is already installed.
# Usage: .ci/slurm/install.sh
set -euo pipefail

PKGS=(slurm-wlm slurmdbd munge mariadb-server mariadb-client iproute2 util-linux procps bridge-utils)

die() { echo "install.sh: ERROR: $*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "must run as root (apt-get, network namespaces)"
command -v apt-get >/dev/null || die "apt-get not found: this script supports Debian bookworm only"

missing=()
for p in "${PKGS[@]}"; do
    st=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
    [[ $st == installed ]] || missing+=("$p")
done

if [[ ${#missing[@]} -eq 0 ]]; then
    echo "install.sh: all packages already installed (${PKGS[*]})"
    exit 0
fi

echo "install.sh: installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d=101 keeps package scripts from starting services (we start daemons by hand).
policy=/usr/sbin/policy-rc.d
added_policy=0
if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"; added_policy=1
fi
cleanup() { [[ $added_policy -eq 1 ]] && rm -f "$policy"; true; }
trap cleanup EXIT

apt-get -o DPkg::Lock::Timeout=600 update -q || die "apt-get update failed"
apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends -t bookworm "${missing[@]}" \
    || die "apt-get install failed for: ${missing[*]}"

[[ -s /etc/munge/munge.key ]] || {
    echo "install.sh: creating /etc/munge/munge.key"
    if command -v mungekey >/dev/null; then mungekey -c -f -k /etc/munge/munge.key
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
    chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
}
for b in slurmctld slurmd slurmdbd munged mariadbd mariadb-install-db sacctmgr sbatch; do
    command -v "$b" >/dev/null || die "$b not found after install"
done
echo "install.sh: done ($(slurmctld -V))"
