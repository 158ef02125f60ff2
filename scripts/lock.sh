#!/usr/bin/env bash
# Refresh the lock of every Python dependency but torch: uv.lock (one resolution for Python >= 3.11 on every
# platform, with hashes) and its exports in requirements/, which pip installs with --require-hashes:
#   image.txt     what training needs, Lightning's engine included (the container build)
#   workflow.txt  + the workflow, prefetch and summary (the workflow's conda env, which trains too; no hashes, see below)
#   dev.txt       + the tests and tools (scripts/setup.sh: the README's commands)
# Without arguments pins stay and only what pyproject.toml changed is resolved; --upgrade moves every pin to the
# newest release. Run after editing the dependencies in pyproject.toml and commit the five files together.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
uv=${UV:-$repo/.venv/bin/uv}
[ -x "$uv" ] || uv=$(command -v uv) || { echo "no uv: run scripts/setup.sh, or pip install uv" >&2; exit 1; }
cd "$repo"
"$uv" lock "$@"
export_set() {  # NAME, then uv export's options
    local name=$1
    shift
    "$uv" export --frozen --no-emit-project --prune torch --no-header "$@" --output-file "requirements/$name.txt" >/dev/null
}
export_set image --extra lightning  # the matrix's ddp_lightning trains with train.engine: lightning
# conda's pip step installs scalelm itself (editable) in the same call, which pip's hash checking refuses
export_set workflow --extra data --extra workflow --extra lightning --no-hashes
export_set dev --all-extras
echo "uv.lock and requirements/{image,workflow,dev}.txt refreshed: commit them together"
