#!/usr/bin/env bash
# Set up .venv and run the whole experiment matrix on the embedded local default (CPU, no cluster, no container),
# then write the HTML report. Extra arguments go to snakemake (e.g. -n for a dry run).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$repo/scripts/setup.sh"
export PATH="${SCALELM_VENV:-$repo/.venv}/bin:$PATH"
cd "$repo"
snakemake "$@"
snakemake --report results/local/report.html
echo
echo "summary: results/local/summary.md (and summary.csv, summary_by_experiment.csv, expectations.csv)"
echo "plots:   results/local/loss_vs_tokens.png, loss_vs_time.png, scaling.png"
echo "report:  results/local/report.html"
