#!/usr/bin/env bash
# Start a throw-away real Slurm cluster on this machine for scalelm's test tier.
#
# Usage: .ci/slurm/start.sh [--nodes 1|2] [--gpus-per-node N] [--cpus-per-node N]
#                               [--mem-per-node MB] [--state-dir DIR] [--no-accounting]
#
# Each node n1[,n2] runs its own slurmd in a network namespace (own hostname via a UTS
# namespace, own IP 10.77.0.1X on bridge slmbr0 = 10.77.0.1, no default route). Controller,
# slurmdbd and MariaDB (loopback only) run on the host. Fake GPUs: gres gpu backed by empty
# files. Writes STATE_DIR/cluster.env (KEY=VALUE) for tests. Run .ci/slurm/install.sh first
# and .ci/slurm/stop.sh to tear everything down. Needs root.
set -euo pipefail

SLM_SCRIPT=start.sh
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$HERE/lib.sh"

usage() { sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

NODES=2
GPUS=2
CPUS=4
MEM=8192
STATE=$SLM_DEFAULT_STATE_DIR
ACCOUNTING=1
while [[ $# -gt 0 ]]; do
    case $1 in
        --nodes) NODES=${2:?--nodes needs a value}; shift 2 ;;
        --gpus-per-node) GPUS=${2:?--gpus-per-node needs a value}; shift 2 ;;
        --cpus-per-node) CPUS=${2:?--cpus-per-node needs a value}; shift 2 ;;
        --mem-per-node) MEM=${2:?--mem-per-node needs a value}; shift 2 ;;
        --state-dir) STATE=${2:?--state-dir needs a value}; shift 2 ;;
        --no-accounting) ACCOUNTING=0; shift ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; slm_die "unknown argument: $1" ;;
    esac
done
[[ $NODES == 1 || $NODES == 2 ]] || slm_die "--nodes must be 1 or 2 (got '$NODES')"
[[ $GPUS =~ ^[0-9]+$ && $GPUS -le 16 ]] || slm_die "--gpus-per-node must be 0..16 (got '$GPUS')"
[[ $CPUS =~ ^[1-9][0-9]*$ ]] || slm_die "--cpus-per-node must be a positive integer (got '$CPUS')"
[[ $MEM =~ ^[1-9][0-9]*$ ]] || slm_die "--mem-per-node must be a positive integer in MB (got '$MEM')"
[[ $SLM_NET_PREFIX =~ ^(10\.(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])|192\.168|172\.(1[6-9]|2[0-9]|3[01]))\.(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])$ ]] \
    || slm_die "SCALELM_SLURM_NET_PREFIX must be the first three octets of a private /24 (e.g. 10.77.0), got '$SLM_NET_PREFIX'"
[[ $(id -u) -eq 0 ]] || slm_die "must run as root (network namespaces, /etc/slurm, /etc/hosts)"
mkdir -p "$STATE" || slm_die "cannot create state dir $STATE"
STATE=$(cd "$STATE" && pwd)
# MariaDB's unix socket lives under the state dir: sun_path is limited to 107 bytes.
[[ ${#STATE} -le 80 ]] || slm_die "state dir path too long (${#STATE} > 80 chars): $STATE"

need=(slurmctld slurmd sinfo sbatch munged munge unmunge ip nsenter unshare setsid setpriv)
[[ $ACCOUNTING -eq 1 ]] && need+=(slurmdbd sacctmgr mariadbd mariadb-install-db mariadb mariadb-admin)
for b in "${need[@]}"; do
    command -v "$b" >/dev/null || slm_die "'$b' not found: run .ci/slurm/install.sh first"
done

T0=$(date +%s.%N)
HEAD_HOST=$(hostname -s)
NODE_NAMES=()
for ((i = 1; i <= NODES; i++)); do NODE_NAMES+=("n$i"); done
NODE_LIST=$(IFS=,; echo "${NODE_NAMES[*]}")

on_exit() {
    local rc=$?
    [[ $rc -ne 0 && $ARMED -eq 1 ]] || return 0
    echo "[$SLM_SCRIPT] FAILED (exit $rc) at line ${FAIL_LINE:-?}: ${FAIL_CMD:-?}" >&2
    echo "[$SLM_SCRIPT] logs are in $STATE/log; tearing down what was started" >&2
    for f in "$STATE"/log/*.log "$STATE"/log/*.out; do
        [[ -s $f ]] || continue
        echo "----- tail $f -----" >&2; tail -n 8 "$f" >&2
    done
    slm_teardown "$STATE" >&2 || true
}
ARMED=0
trap on_exit EXIT
trap 'FAIL_LINE=$LINENO FAIL_CMD=$BASH_COMMAND' ERR

# ---------------------------------------------------------------- clean up earlier runs
if [[ -f /etc/slurm/slurm.conf ]]; then
    if grep -qF "$SLM_CONF_MARK" /etc/slurm/slurm.conf; then
        prev=$(sed -n 's/^# scalelm-state-dir: //p' /etc/slurm/slurm.conf | head -n1)
        if [[ -n $prev && $prev != "$STATE" && -d $prev ]]; then
            slm_log "stopping the cluster of an earlier run (state dir $prev)"
            slm_teardown "$prev"
        fi
    else
        slm_die "/etc/slurm/slurm.conf exists and was not written by this script; refusing to overwrite it"
    fi
fi
slm_teardown "$STATE"    # leftovers of a crashed or still running run with this state dir

# Ports must be free now (a daemon from a run whose state dir was deleted would hold them).
busy=()
for p in $SLM_CTLD_PORT $SLM_SLURMD_PORT $SLM_DBD_PORT $SLM_MYSQL_PORT; do
    if ss -Hltn "sport = :$p" 2>/dev/null | grep -q .; then busy+=("$p"); fi
done
[[ ${#busy[@]} -eq 0 ]] || slm_die "TCP port(s) ${busy[*]} already in use (stale daemons from a run whose state dir is gone?); see: ss -ltnp"
if ip -o addr show 2>/dev/null | grep -q " ${SLM_NET_PREFIX}\."; then
    slm_die "subnet ${SLM_NET_PREFIX}.0/24 is already used on this machine (set SCALELM_SLURM_NET_PREFIX)"
fi

ARMED=1
rm -rf "${STATE:?}"/{pids,log,ctld,spool,run,gres,mysql,tmp,cache/mysql-template.tmp} "$STATE/cluster.env"
mkdir -p "$STATE"/{pids,log,ctld,spool,run,gres,tmp}
SEQ=0
record_pid() {  # record_pid PID NAME_PATTERN LABEL
    SEQ=$((SEQ + 1))
    printf '%s %s\n' "$1" "$2" > "$STATE/pids/$(printf '%02d' "$SEQ")-$3.pid"
}
# Start "$@" detached in its own session, log to $STATE/log/LABEL.log, record its PID.
spawn() {  # spawn LABEL NAME_PATTERN cmd...
    local label=$1 pat=$2; shift 2
    setsid "$@" < /dev/null >> "$STATE/log/$label.out" 2>&1 &
    local pid=$!
    record_pid "$pid" "$pat" "$label"
    SPAWNED_PID=$pid
}
wait_for() {  # wait_for SECONDS DESCRIPTION cmd...
    local secs=$1 what=$2 i; shift 2
    for ((i = 0; i < secs * 10; i++)); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.1
    done
    slm_log "timed out after ${secs}s waiting for $what"
    return 1
}
alive() { slm_pid_dead "$1" && { slm_log "$2 exited right after start (see $STATE/log/)"; return 1; }; return 0; }

# ---------------------------------------------------------------- network: bridge + namespaces
slm_log "network: bridge $SLM_BRIDGE ${SLM_HEAD_IP}/24, nodes ${NODE_LIST}"
ip link add "$SLM_BRIDGE" type bridge
ip addr add "${SLM_HEAD_IP}/24" dev "$SLM_BRIDGE"
ip link set "$SLM_BRIDGE" up
hosts_lines=""
for ((i = 1; i <= NODES; i++)); do
    n=n$i ns=${SLM_NS_PREFIX}n$i veth=${SLM_VETH_PREFIX}n$i ipaddr=${SLM_NET_PREFIX}.1$i
    ip netns add "$ns"
    ip link add "$veth" type veth peer name eth0 netns "$ns"
    ip link set "$veth" master "$SLM_BRIDGE" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "${ipaddr}/24" dev eth0
    ip -n "$ns" link set eth0 up
    # deliberately no default route: nothing from inside can leave the private subnet
    hosts_lines+="${ipaddr} ${n} ${SLM_HOSTS_MARK}"$'\n'
done
printf '%s' "$hosts_lines" >> /etc/hosts

# ---------------------------------------------------------------- munge
if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    slm_log "munge: reusing the running munged"
else
    [[ -s /etc/munge/munge.key ]] || slm_die "/etc/munge/munge.key missing: run .ci/slurm/install.sh"
    if [[ ! -d /run/munge ]]; then
        install -d -o munge -g munge -m 0755 /run/munge
        touch "$STATE/created-run-munge"    # stop.sh removes it again
    fi
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
    spawn munged munged setpriv --reuid=munge --regid=munge --init-groups munged -F --force
    wait_for 10 "munged" sh -c 'munge -n | unmunge' || { alive "$SPAWNED_PID" munged; false; }
fi

# ---------------------------------------------------------------- configuration
mkdir -p /etc/slurm
for ((i = 1; i <= NODES; i++)); do
    for ((g = 0; g < GPUS; g++)); do : > "$STATE/gres/n$i-nvidia$g"; done
done
{
    echo "$SLM_CONF_MARK"
    echo "# scalelm-state-dir: $STATE"
    cat <<EOF
ClusterName=$SLM_CLUSTER
SlurmctldHost=${HEAD_HOST}(${SLM_HEAD_IP})
SlurmctldPort=$SLM_CTLD_PORT
SlurmdPort=$SLM_SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job (node failure, preemption) waits the credential lifetime before it starts again: 120 s by default
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/slurmd-%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
TmpFS=$STATE/tmp
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
DefMemPerCPU=256
GresTypes=gpu
ReturnToService=2
MinJobAge=300
KillWait=5
Waittime=0
InactiveLimit=0
SlurmdTimeout=120
MessageTimeout=10
SchedulerType=sched/backfill
# a job that waits behind a larger pending one is started by the backfill scheduler, which runs every 30 s by default;
# every second here, where a cycle over a handful of jobs costs nothing
SchedulerParameters=bf_interval=1
JobCompType=jobcomp/none
EOF
    if [[ $ACCOUNTING -eq 1 ]]; then
        cat <<EOF
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$SLM_HEAD_IP
AccountingStoragePort=$SLM_DBD_PORT
AccountingStorageEnforce=associations
AccountingStorageTRES=gres/gpu
AccountingStoreFlags=job_comment
EOF
    else
        echo "AccountingStorageType=accounting_storage/none"
    fi
    for ((i = 1; i <= NODES; i++)); do
        gres=""; [[ $GPUS -gt 0 ]] && gres=" Gres=gpu:$GPUS"
        echo "NodeName=n$i NodeHostname=n$i NodeAddr=${SLM_NET_PREFIX}.1$i CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM${gres} State=UNKNOWN"
    done
    echo "PartitionName=$SLM_PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
} > /etc/slurm/slurm.conf
{
    echo "$SLM_CONF_MARK"
    echo "AutoDetect=off"
    if [[ $GPUS -gt 0 ]]; then
        for ((i = 1; i <= NODES; i++)); do
            echo "NodeName=n$i Name=gpu File=$STATE/gres/n$i-nvidia[0-$((GPUS - 1))]"
        done
    fi
} > /etc/slurm/gres.conf
[[ $GPUS -eq 1 ]] && sed -i "s|nvidia\[0-0\]|nvidia0|" /etc/slurm/gres.conf

# ---------------------------------------------------------------- MariaDB + slurmdbd
# The first start with a given state dir builds the accounting database (mariadb-install-db,
# slurmdbd schema, cluster/account/user: ~5 s) and keeps a cleanly shut down copy in
# STATE_DIR/cache/mysql-template; later starts copy that template (~0.1 s) instead.
MYSQL_OPTS=(--no-defaults --user=root --skip-log-bin --innodb-buffer-pool-size=32M --innodb-log-file-size=8M
            --innodb-flush-method=nosync --innodb-flush-log-at-trx-commit=0 --innodb-doublewrite=0)
start_mariadb() {
    spawn mariadbd mariadbd mariadbd "${MYSQL_OPTS[@]}" --datadir="$STATE/mysql/data" --socket="$SOCK" \
        --port="$SLM_MYSQL_PORT" --bind-address=127.0.0.1 --skip-name-resolve --pid-file="$STATE/run/mariadbd.pid" \
        --log-error="$STATE/log/mariadbd.log"
    MARIADB_PID=$SPAWNED_PID
    wait_for 30 "mariadbd" mariadb-admin --no-defaults --socket="$SOCK" -u root ping || { alive "$MARIADB_PID" mariadbd; false; }
}
start_slurmdbd() {
    spawn slurmdbd slurmdbd slurmdbd -D
    SLURMDBD_PID=$SPAWNED_PID
    wait_for 60 "slurmdbd" sacctmgr -n list cluster || { alive "$SLURMDBD_PID" slurmdbd; false; }
}
sacct_has() { [[ -n $(sacctmgr -n -P "$@" 2>/dev/null) ]]; }
if [[ $ACCOUNTING -eq 1 ]]; then
    SOCK=$STATE/mysql/mysqld.sock
    TPL=$STATE/cache/mysql-template
    TPL_KEY="$(dpkg-query -W -f='${Version}' mariadb-server slurmdbd 2>/dev/null || true) | $SLM_CLUSTER $SLM_ACCOUNT $SLM_MYSQL_PORT v1"
    mkdir -p "$STATE/mysql"
    if [[ -f $TPL/key && $(cat "$TPL/key") == "$TPL_KEY" && -d $TPL/data && -s $TPL/pass ]]; then
        FRESH_DB=0
        cp -a "$TPL/data" "$STATE/mysql/data"
        DBPASS=$(cat "$TPL/pass")
    else
        FRESH_DB=1
        rm -rf "$TPL"
        slm_log "mariadb: first start with this state dir, building the accounting database"
        DBPASS=$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')
        mariadb-install-db "${MYSQL_OPTS[@]}" --datadir="$STATE/mysql/data" --auth-root-authentication-method=socket \
            --skip-test-db > "$STATE/log/mariadb-install.log" 2>&1 \
            || slm_die "mariadb-install-db failed, see $STATE/log/mariadb-install.log"
    fi
    start_mariadb
    if [[ $FRESH_DB -eq 1 ]]; then
        mariadb --no-defaults --socket="$SOCK" -u root <<EOF
CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$DBPASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
EOF
    fi
    (
        umask 077
        cat > /etc/slurm/slurmdbd.conf <<EOF
$SLM_CONF_MARK
AuthType=auth/munge
DbdHost=$HEAD_HOST
DbdAddr=$SLM_HEAD_IP
DbdPort=$SLM_DBD_PORT
SlurmUser=root
LogFile=$STATE/log/slurmdbd.log
PidFile=$STATE/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$SLM_MYSQL_PORT
StorageUser=slurm
StoragePass=$DBPASS
StorageLoc=slurm_acct_db
EOF
    )
    chmod 600 /etc/slurm/slurmdbd.conf
    start_slurmdbd
    sacct_has list cluster "$SLM_CLUSTER" format=cluster || sacctmgr -i -Q add cluster "$SLM_CLUSTER" > /dev/null
    sacct_has list account "$SLM_ACCOUNT" format=account \
        || sacctmgr -i -Q add account "$SLM_ACCOUNT" cluster="$SLM_CLUSTER" description="scalelm tests" organization=scalelm > /dev/null
    sacct_has list assoc cluster="$SLM_CLUSTER" user=root account="$SLM_ACCOUNT" format=account \
        || sacctmgr -i -Q add user root account="$SLM_ACCOUNT" cluster="$SLM_CLUSTER" > /dev/null
    sacct_has list assoc cluster="$SLM_CLUSTER" user=root account="$SLM_ACCOUNT" format=account \
        || slm_die "sacctmgr: association root/$SLM_ACCOUNT on cluster $SLM_CLUSTER was not created"
    if [[ $FRESH_DB -eq 1 ]]; then
        # Snapshot the initialised database for the next start (needs a clean shutdown).
        slm_log "mariadb: saving database template to $TPL"
        SLM_KILL_WAIT=20 slm_kill_pids "$SLURMDBD_PID"
        mariadb-admin --no-defaults --socket="$SOCK" -u root shutdown
        SLM_KILL_WAIT=30 slm_kill_pids "$MARIADB_PID"
        rm -rf "$TPL.tmp"; mkdir -p "$TPL.tmp"
        cp -a "$STATE/mysql/data" "$TPL.tmp/data"
        ( umask 077; printf '%s\n' "$DBPASS" > "$TPL.tmp/pass" )
        printf '%s\n' "$TPL_KEY" > "$TPL.tmp/key"
        mv "$TPL.tmp" "$TPL"
        start_mariadb
        start_slurmdbd
    fi
fi

# ---------------------------------------------------------------- slurmctld + slurmd
slm_log "starting slurmctld on ${HEAD_HOST} (${SLM_HEAD_IP}:${SLM_CTLD_PORT})"
spawn slurmctld slurmctld slurmctld -D -i
CTLD_PID=$SPAWNED_PID
for ((i = 1; i <= NODES; i++)); do
    n=n$i
    mkdir -p "$STATE/spool/slurmd-$n"
    # own UTS namespace (hostname n$i) + our network namespace; nsenter (not `ip netns exec`,
    # which remounts /sys) keeps the mount namespace untouched. Each exec keeps the PID.
    spawn "slurmd-$n" "slurmd" unshare --uts sh -c \
        "hostname $n && exec nsenter --net=/run/netns/${SLM_NS_PREFIX}$n slurmd -D -N $n"
done
wait_for 30 "slurmctld" scontrol ping || { alive "$CTLD_PID" slurmctld; false; }

all_idle() {
    local out
    out=$(sinfo -h -N -p "$SLM_PARTITION" -o '%N %t' 2>/dev/null) || return 1
    [[ $(grep -c ' idle$' <<< "$out") -eq $NODES ]]
}
if ! wait_for 30 "nodes ${NODE_LIST} to become idle" all_idle; then
    sinfo -N -l >&2 || true
    false
fi

# ---------------------------------------------------------------- env file + summary
cat > "$STATE/cluster.env" <<EOF
SCALELM_SLURM_STATE_DIR=$STATE
SCALELM_SLURM_CONF=/etc/slurm/slurm.conf
SCALELM_SLURM_CLUSTER=$SLM_CLUSTER
SCALELM_SLURM_PARTITION=$SLM_PARTITION
SCALELM_SLURM_ACCOUNT=$SLM_ACCOUNT
SCALELM_SLURM_ACCOUNTING=$ACCOUNTING
SCALELM_SLURM_NUM_NODES=$NODES
SCALELM_SLURM_NODES=$NODE_LIST
SCALELM_SLURM_HEAD_NODE=n1
SCALELM_SLURM_CONTROLLER=$HEAD_HOST
SCALELM_SLURM_CONTROLLER_ADDR=$SLM_HEAD_IP
SCALELM_SLURM_CPUS_PER_NODE=$CPUS
SCALELM_SLURM_MEM_PER_NODE_MB=$MEM
SCALELM_SLURM_GPUS_PER_NODE=$GPUS
EOF
ARMED=0
T1=$(date +%s.%N)
slm_log "cluster '$SLM_CLUSTER' up in $(awk -v a="$T0" -v b="$T1" 'BEGIN{printf "%.1f", b-a}') s"
sinfo -N -o '  %N %P %t cpus=%c mem=%m gres=%G'
echo "  partition=$SLM_PARTITION account=$SLM_ACCOUNT accounting=$([[ $ACCOUNTING -eq 1 ]] && echo on || echo off) env=$STATE/cluster.env"
echo "  stop with: $HERE/stop.sh --state-dir $STATE"
