#!/usr/bin/env bash
# Set up .venv and run every test. As root (and always under CI) this also installs and runs the tiers that
# need a real Slurm cluster and a real Apptainer (scripts/slurm, scripts/apptainer); elsewhere they skip, saying why.
# Extra arguments go to pytest (e.g. -k parity, -m "not slurm").
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$repo/scripts/setup.sh"
export PATH="${SCALELM_VENV:-$repo/.venv}/bin:$PATH"
cd "$repo"
if [ "$(id -u)" = 0 ] && [ -d scripts/slurm ]; then
    bash scripts/slurm/install.sh
fi
exec python -m pytest -ra "$@"
