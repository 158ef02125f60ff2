#!/usr/bin/env bash
# Set up .venv and run every test. As root (and always under CI) this also installs and runs the tiers that
# need a real Slurm cluster and a real Apptainer (.ci/slurm, .ci/apptainer); elsewhere they skip, saying why.
# Extra arguments go to pytest (e.g. -k parity, -m "not slurm"). `--fast` first: a developer's inner loop, every test
# but those that train or start processes (marked `trains` by tests/conftest.py), the slow ones (marked `slow`: about
# 30 s or more) and the Slurm and Apptainer tiers; CI runs everything.
# The test files run on pytest-xdist workers, one more than the machine has cores, each file whole on one worker.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
selection=()
if [ "${1:-}" = "--fast" ]; then
    shift
    selection=(-m "not slow and not trains and not slurm and not apptainer")
fi
bash "$repo/scripts/setup.sh"
export PATH="${SCALELM_VENV:-$repo/.venv}/bin:$PATH"
cd "$repo"
if [ ${#selection[@]} = 0 ] && [ "$(id -u)" = 0 ] && [ -d .ci/slurm ]; then
    bash .ci/slurm/install.sh
fi
# one worker more than the machine has cores: the Slurm and Apptainer tiers and the fault drills spend much of their
# time waiting on a scheduler, a build or a timeout (a whole run kept 1.2 of 2 cores busy with one worker per core)
workers=$(( $(nproc) + 1 ))
exec python -m pytest -ra --numprocesses "$workers" --dist loadfile --no-loadscope-reorder "${selection[@]}" "$@"
