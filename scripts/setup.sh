#!/usr/bin/env bash
# Create .venv with scalelm and everything the workflow and the tests need. Idempotent; sourced by run-local.sh
# and test.sh. TORCH_SPEC picks the torch build (default: torch==2.13.0; on a GPU machine e.g. "torch==2.13.0"
# from the CUDA index you use).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${SCALELM_VENV:-$repo/.venv}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
# torch first and pinned: an unpinned torch requirement would resolve to a multi-GB CUDA build
"$venv/bin/python" -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
# everything else at the lock's versions, each file checked against its hash (scripts/lock.sh refreshes them)
"$venv/bin/python" -m pip install --quiet --require-hashes --requirement "$repo/requirements/dev.txt"
"$venv/bin/python" -m pip install --quiet --no-deps --editable "$repo"
echo "environment ready: $venv ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
