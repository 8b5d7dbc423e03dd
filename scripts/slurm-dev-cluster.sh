#!/usr/bin/env bash
# A dev Slurm cluster on this one machine for ddpq's tests and for people trying ddpq:
# munge, slurmdbd (accounting in the local MariaDB), slurmctld and two slurmd "nodes".
#
# Usage: scripts/slurm-dev-cluster.sh up|down|status [--purge]
#
#   up      install (apt-get) what is missing, write the configs, start what is not running,
#           wait until both nodes are idle and accounting answers. Idempotent; exits non-zero
#           with the daemons' log tails when something does not come up in time.
#   down    stop slurmctld, the slurmds, slurmdbd and munged (only those this script started,
#           found by their pid files). `down --purge` also drops the accounting database and
#           Slurm's saved state.
#   status  print the daemons, the nodes (sinfo) and the last jobs (sacct); exit 1 if down.
#
# Runs as root without systemd (Debian 12, slurm-wlm 22.05). Writes /etc/slurm/*.conf (so
# every client finds the cluster without SLURM_CONF) and keeps its state and logs under
# $DDPQ_SLURM_DEV_DIR (default /var/lib/ddpq-slurm-dev).
#
# Layout: cluster "ddpq-dev", partition "debug" (default) with nodes ddpq-n1 and ddpq-n2,
# both at 127.0.0.1 (slurmd ports 6821 and 6822), each declaring $DDPQ_SLURM_DEV_CPUS CPUs
# (default 4: oversubscribes a 2-core box on purpose) and 2 fake GPUs (gres gpu:2 backed by
# /dev/fakegpu0-1, character devices like /dev/null). The node names do not resolve: a job
# finds a node's address with `scontrol show node` (ddpq's Slurm launcher does).
# Tuned for fast tests: cred_expire=10 (requeue without the 120 s wait),
# scheduler every 1-2 s, finished jobs kept 300 s in slurmctld. KillWait stays Slurm's
# default (30 s): a stopping rank drains its metrics and uploads its stop checkpoint in that
# window, which a loaded box needs more than 5 s for.
set -euo pipefail

DEV_DIR="${DDPQ_SLURM_DEV_DIR:-/var/lib/ddpq-slurm-dev}"
CONF_DIR=/etc/slurm
CLUSTER=ddpq-dev
NODES=(ddpq-n1 ddpq-n2)
NODE_BASE_PORT=6821
CTLD_PORT=6817
DBD_PORT=6819
ACCT_DB=ddpq_slurm_acct
MYSQL_HOST="${DDPQ_SLURM_DEV_MYSQL_HOST:-127.0.0.1}"
MYSQL_PORT="${DDPQ_SLURM_DEV_MYSQL_PORT:-3306}"
CPUS="${DDPQ_SLURM_DEV_CPUS:-4}"
UP_TIMEOUT_S="${DDPQ_SLURM_DEV_TIMEOUT_S:-60}"
MUNGE_PID=/run/munge/munged.pid
DBD_PID=/run/ddpq-slurmdbd.pid
CTLD_PID=/run/ddpq-slurmctld.pid

log() { echo "slurm-dev-cluster: $*" >&2; }
die() {
    log "ERROR: $*"
    for f in "$DEV_DIR"/log/*.log; do
        [[ -f "$f" ]] || continue
        echo "---- tail $f" >&2
        tail -n 15 "$f" >&2 || true
    done
    exit 1
}

# pid_alive PIDFILE NAME: the pid in PIDFILE is a live (not zombie) process named NAME.
pid_alive() {
    local pid stat
    [[ -f "$1" ]] || return 1
    pid="$(cat "$1" 2>/dev/null)" || return 1
    [[ -n "$pid" && -r "/proc/$pid/comm" ]] || return 1
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$2" ]] || return 1
    stat="$(cat "/proc/$pid/stat" 2>/dev/null)" || return 1
    stat="${stat##*) }"
    [[ "${stat%% *}" != Z && "${stat%% *}" != X ]]
}

node_pidfile() { echo "/run/ddpq-slurmd-$1.pid"; }

# wait_for SECONDS DESCRIPTION COMMAND...: retry COMMAND every 0.2 s until it succeeds.
wait_for() {
    local limit="$1" what="$2" deadline
    shift 2
    deadline=$(($(date +%s) + limit))
    until "$@" >/dev/null 2>&1; do
        if (($(date +%s) >= deadline)); then
            die "timed out after ${limit}s waiting for $what"
        fi
        sleep 0.2
    done
}

install_packages() {
    local missing=()
    command -v munged >/dev/null || missing+=(munge)
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v slurmdbd >/dev/null || missing+=(slurmdbd)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    command -v mysql >/dev/null || missing+=(mariadb-client)
    ((${#missing[@]} == 0)) && return 0
    log "installing ${missing[*]} (apt-get)"
    "$(dirname "${BASH_SOURCE[0]}")/apt-install.sh" "${missing[@]}"
}

mysql_ok() { mysql -h "$MYSQL_HOST" -P "$MYSQL_PORT" -u root -e 'SELECT 1' >/dev/null 2>&1; }

ensure_mariadb() {
    mysql_ok && return 0
    if [[ -x /usr/sbin/mariadbd ]]; then
        log "starting MariaDB"
        start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
        wait_for 30 "MariaDB at $MYSQL_HOST:$MYSQL_PORT" mysql_ok
    else
        die "no MariaDB at $MYSQL_HOST:$MYSQL_PORT (root, empty password) and none installed"
    fi
}

write_configs() {
    local mem_mb gres_files i
    mkdir -p "$CONF_DIR" "$DEV_DIR"/{log,ctld} /run/munge
    for i in "${!NODES[@]}"; do mkdir -p "$DEV_DIR/slurmd-${NODES[$i]}"; done
    mem_mb=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
    mem_mb=$((${mem_mb:-4096} * 9 / 10))
    for i in 0 1; do
        [[ -e /dev/fakegpu$i ]] || mknod -m 666 "/dev/fakegpu$i" c 1 3
    done
    gres_files="/dev/fakegpu[0-1]"

    cat >"$CONF_DIR/slurm.conf" <<EOF
# Written by ddpq scripts/slurm-dev-cluster.sh; rewritten on every 'up'.
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
MailProg=/bin/true
StateSaveLocation=$DEV_DIR/ctld
SlurmdSpoolDir=$DEV_DIR/slurmd-%n
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=/run/ddpq-slurmd-%n.pid
SlurmctldLogFile=$DEV_DIR/log/slurmctld.log
SlurmdLogFile=$DEV_DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
KillWait=30
InactiveLimit=0
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
SchedulerParameters=bf_interval=1,sched_min_interval=100000
SchedulerType=sched/backfill
JobRequeue=1
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
JobCompType=jobcomp/none
GresTypes=gpu
NodeName=${NODES[0]} NodeAddr=127.0.0.1 Port=$NODE_BASE_PORT CPUs=$CPUS RealMemory=$mem_mb Gres=gpu:2 State=UNKNOWN
NodeName=${NODES[1]} NodeAddr=127.0.0.1 Port=$((NODE_BASE_PORT + 1)) CPUs=$CPUS RealMemory=$mem_mb Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$CONF_DIR/gres.conf" <<EOF
# Fake GPUs for --gpus-per-node tests (character devices 1:3, like /dev/null).
NodeName=${NODES[0]},${NODES[1]} Name=gpu File=$gres_files
EOF
    cat >"$CONF_DIR/slurmdbd.conf" <<EOF
# Written by ddpq scripts/slurm-dev-cluster.sh.
AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$DBD_PID
LogFile=$DEV_DIR/log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=$MYSQL_HOST
StoragePort=$MYSQL_PORT
StorageUser=root
StorageLoc=$ACCT_DB
EOF
    chmod 0644 "$CONF_DIR/slurm.conf" "$CONF_DIR/gres.conf"
    chmod 0600 "$CONF_DIR/slurmdbd.conf"
}

start_munge() {
    pid_alive "$MUNGE_PID" munged && return 0
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating /etc/munge/munge.key"
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=128 status=none
    fi
    chown -R munge:munge /etc/munge /run/munge
    chmod 0700 /etc/munge
    chmod 0400 /etc/munge/munge.key
    mkdir -p /var/lib/munge /var/log/munge
    chown munge:munge /var/lib/munge /var/log/munge
    chmod 0755 /run/munge
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged --force
    wait_for 10 "munge" sh -c 'munge -n | unmunge'
}

start_slurmdbd() {
    pid_alive "$DBD_PID" slurmdbd || {
        log "starting slurmdbd"
        slurmdbd
    }
    wait_for 30 "slurmdbd on port $DBD_PORT" sacctmgr -n -P list cluster format=cluster
    if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null
    fi
}

ctld_ok() { scontrol ping | grep -q 'is UP'; }

CTLD_RESTARTED=0

# cancel_all_jobs: scancel every job slurmctld knows (all states), batch steps included.
cancel_all_jobs() {
    local ids
    ids="$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')"
    [[ -n "${ids// /}" ]] || return 0
    # shellcheck disable=SC2086 # one argument per job id
    scancel --full $ids >/dev/null 2>&1 || true
}

# set_first_job_id: never reuse a job id that accounting already holds. slurmctld's saved
# state lags its last submissions, so after a crash (or a purge of the state alone) it would
# hand out ids that sacct still lists for older jobs; FirstJobId lifts it past them.
set_first_job_id() {
    local max_id
    max_id="$(mysql -h "$MYSQL_HOST" -P "$MYSQL_PORT" -u root -N -e \
        "SELECT MAX(id_job) FROM \`$ACCT_DB\`.\`${CLUSTER}_job_table\`" 2>/dev/null)" || true
    [[ "$max_id" =~ ^[0-9]+$ ]] || max_id=0
    sed -i '/^FirstJobId=/d' "$CONF_DIR/slurm.conf"
    echo "FirstJobId=$((max_id + 1))" >>"$CONF_DIR/slurm.conf"
}

# other_slurmctld: a live slurmctld main process exists (not a zombie, not its slurmscriptd).
other_slurmctld() {
    local pid stat
    for pid in $(pgrep -x slurmctld || true); do
        stat="$(cat "/proc/$pid/stat" 2>/dev/null)" || continue
        stat="${stat##*) }"
        [[ "${stat%% *}" == Z || "${stat%% *}" == X ]] && continue
        [[ "$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" == :* ]] && continue
        return 0
    done
    return 1
}

start_slurmctld() {
    if ! pid_alive "$CTLD_PID" slurmctld; then
        # A second slurmctld would kill the first; processes killed a moment ago may still
        # be exiting, so give them a few seconds before calling one foreign.
        local deadline=$((SECONDS + 5))
        while other_slurmctld; do
            ((SECONDS < deadline)) || die "a slurmctld this script did not start is running"
            sleep 0.2
        done
        set_first_job_id
        log "starting slurmctld"
        slurmctld
        CTLD_RESTARTED=1
    else
        scontrol reconfigure >/dev/null 2>&1 || true
    fi
    wait_for 20 "slurmctld" ctld_ok
}

start_slurmds() {
    local node
    for node in "${NODES[@]}"; do
        pid_alive "$(node_pidfile "$node")" slurmd && continue
        log "starting slurmd -N $node"
        slurmd -N "$node"
    done
}

# All nodes idle or allocated/mixed (usable), none down or drained.
nodes_ok() {
    local states
    states="$(sinfo -h -N -o '%N %T' 2>/dev/null)" || return 1
    [[ -n "$states" ]] || return 1
    ! grep -Eqv ' (idle|mixed|allocated|completing)$' <<<"$states"
}

resume_nodes() {
    # A node left down/drained by an earlier run (e.g. killed mid-job) comes back here.
    local node state
    while read -r node state; do
        case "$state" in
            down* | drain* | fail* | unknown*)
                scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true
                ;;
        esac
    done < <(sinfo -h -N -o '%N %T' 2>/dev/null || true)
}

accounting_ok() { sacct -n -X -a -S now-1minutes -o JobID >/dev/null; }

cmd_up() {
    local t0=$SECONDS
    install_packages
    ensure_mariadb
    write_configs
    start_munge
    start_slurmdbd
    start_slurmctld
    start_slurmds
    local deadline=$((SECONDS + UP_TIMEOUT_S))
    until nodes_ok; do
        resume_nodes
        ((SECONDS < deadline)) || die "nodes not idle after ${UP_TIMEOUT_S}s: $(sinfo -h -N -o '%N %T' | tr '\n' ' ')"
        sleep 0.5
    done
    if ((CTLD_RESTARTED)) && [[ -n "$(squeue -h -o %i 2>/dev/null)" ]]; then
        # slurmctld recovered jobs from its saved state, but their processes died with the
        # machine (or a kill -9): cancel them so they do not hold the nodes as phantoms.
        log "cancelling jobs left from before the restart: $(squeue -h -o %i | tr '\n' ' ')"
        cancel_all_jobs
        local drain_deadline=$((SECONDS + 20))
        while [[ -n "$(squeue -h -o %i 2>/dev/null)" ]] && ((SECONDS < drain_deadline)); do
            sleep 0.5
        done
    fi
    wait_for 20 "accounting (sacct)" accounting_ok
    log "up in $((SECONDS - t0))s: cluster $CLUSTER, nodes ${NODES[*]} ($(sinfo -h -N -o '%N=%T' | tr '\n' ' '))"
}

# stop_daemons PIDFILE:NAME...: TERM them all, wait up to 10 s for each to exit, then KILL.
stop_daemons() {
    local pair pids=() pid i
    for pair in "$@"; do
        pid_alive "${pair%%:*}" "${pair##*:}" || continue
        pid="$(cat "${pair%%:*}")"
        kill -TERM "$pid" 2>/dev/null || true
        pids+=("$pid")
        rm -f "${pair%%:*}"
    done
    for pid in "${pids[@]}"; do
        for i in $(seq 50); do
            [[ -d "/proc/$pid" ]] || break
            sleep 0.2
        done
        [[ -d "/proc/$pid" ]] && kill -KILL "$pid" 2>/dev/null || true
    done
}

cmd_down() {
    local purge="${1:-}" node
    if pid_alive "$CTLD_PID" slurmctld; then
        # Cancel every job and let the slurmds finish them (within KillWait), so that no job is
        # left "running" in slurmctld's saved state for a node that is gone.
        cancel_all_jobs
        local deadline=$((SECONDS + 35))
        while [[ -n "$(squeue -h -o %i 2>/dev/null)" ]] && ((SECONDS < deadline)); do
            sleep 0.5
        done
    fi
    local daemons=("$CTLD_PID:slurmctld")
    for node in "${NODES[@]}"; do daemons+=("$(node_pidfile "$node"):slurmd"); done
    stop_daemons "${daemons[@]}"
    stop_daemons "$DBD_PID:slurmdbd" "$MUNGE_PID:munged"
    if [[ "$purge" == "--purge" ]]; then
        mysql -h "$MYSQL_HOST" -P "$MYSQL_PORT" -u root -e "DROP DATABASE IF EXISTS $ACCT_DB" \
            2>/dev/null || true
        rm -rf "$DEV_DIR"
    fi
    log "down"
}

cmd_status() {
    local rc=0 node
    pid_alive "$MUNGE_PID" munged && echo "munged     up" || { echo "munged     down"; rc=1; }
    pid_alive "$DBD_PID" slurmdbd && echo "slurmdbd   up" || { echo "slurmdbd   down"; rc=1; }
    pid_alive "$CTLD_PID" slurmctld && echo "slurmctld  up" || { echo "slurmctld  down"; rc=1; }
    for node in "${NODES[@]}"; do
        if pid_alive "$(node_pidfile "$node")" slurmd; then
            echo "slurmd     up ($node)"
        else
            echo "slurmd     down ($node)"
            rc=1
        fi
    done
    if ((rc == 0)); then
        sinfo -N -o '%N %P %T %c %m %G' || rc=1
        sacct -a -X -S now-1hours -o JobID,JobName%20,State,ExitCode,NodeList | tail -n 10 || rc=1
    fi
    return "$rc"
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down "${2:-}" ;;
    status) cmd_status ;;
    *)
        echo "usage: $0 up|down [--purge]|status" >&2
        exit 2
        ;;
esac
