#!/usr/bin/env bash
# The step-time model against the two-node Slurm test cluster (docs/plan.md, "Its error on this machine"): the local
# default's matrix on nodes n1 and n2 (.ci/slurm/), the machine's baseline per node count, one job at a time
# (exclusive nodes, --jobs 1, the login node's wiring check before: no timed run shares the cores, which n1, n2 and
# the login node share), 60 steps a run. Prints the
# summary's "Step time" section. Needs root and scripts/setup.sh's environment.
#
# Usage: bash bench/steptime_slurm.sh [WORK_DIR]
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${1:-/tmp/scalelm-steptime}
STATE=${SCALELM_SLURM_STATE_DIR:-/tmp/scalelm-steptime-slurm}

bash "$REPO/.ci/slurm/install.sh"
bash "$REPO/.ci/slurm/start.sh" --nodes 2 --gpus-per-node 4 --cpus-per-node 4 --state-dir "$STATE"
trap 'bash "$REPO/.ci/slurm/stop.sh" --state-dir "$STATE"' EXIT
# shellcheck disable=SC1091
source "$STATE/cluster.env"

rm -rf "$WORK" && mkdir -p "$WORK"
for part in workflow config profiles resources; do cp -r "$REPO/$part" "$WORK/$part"; done
cat > "$WORK/test-site.yaml" <<EOF
account: $SCALELM_SLURM_ACCOUNT
partition: $SCALELM_SLURM_PARTITION
gpus_per_node: $SCALELM_SLURM_GPUS_PER_NODE
port_range: [29500, 29999]
modules: []
exclusive: true
EOF
python - "$WORK/config/local.yaml" <<'EOF'
import sys, yaml
path = sys.argv[1]
config = yaml.safe_load(open(path))
local = config["local"]
local["training"]["device"] = "cpu"  # the nodes' GPUs are gres entries only
local["experiments"]["pp"] = {"nodes": 2, "procs_per_node": 1}  # a stage on each node
yaml.safe_dump(config, open(path, "w"), sort_keys=False)
EOF
cd "$WORK"
run() {
    snakemake --profile profiles/slurm --configfile config/local.yaml --config site=test-site.yaml --jobs 1 \
        --slurm-init-seconds-before-status-checks 1 --latency-wait 5 "$@"
}
# the login node's work first: n1 and n2 are this machine, and the wiring check would share its cores with the jobs
run preflight
run
sed -n '/^## Step time/,/^## [^S]/p' results/local/summary.md
