#!/usr/bin/env bash
# Stop the throw-away Slurm cluster started by .ci/slurm/start.sh.
#
# Usage: .ci/slurm/stop.sh [--state-dir DIR] [--purge]
#
# Kills only the daemons start.sh recorded in DIR/pids (checking each PID still runs the
# recorded program) plus any process left inside the cluster's own network namespaces,
# deletes those namespaces, the bridge, the /etc/hosts lines and the generated /etc/slurm
# files. Installed packages stay. Logs stay in DIR/log unless --purge removes DIR.
set -euo pipefail

SLM_SCRIPT=stop.sh
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$HERE/lib.sh"

STATE=$SLM_DEFAULT_STATE_DIR
PURGE=0
while [[ $# -gt 0 ]]; do
    case $1 in
        --state-dir) STATE=${2:?--state-dir needs a value}; shift 2 ;;
        --purge) PURGE=1; shift ;;
        -h|--help) sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) slm_die "unknown argument: $1 (usage: stop.sh [--state-dir DIR] [--purge])" ;;
    esac
done
[[ $(id -u) -eq 0 ]] || slm_die "must run as root"
[[ -d $STATE ]] || slm_log "state dir $STATE does not exist; only removing namespaces/bridge/hosts lines/configs"

slm_teardown "$STATE"
rm -f "$STATE/cluster.env" 2>/dev/null || true
if [[ $PURGE -eq 1 && -d $STATE ]]; then
    rm -rf "${STATE:?}"
    slm_log "removed $STATE"
fi
slm_log "stopped"
