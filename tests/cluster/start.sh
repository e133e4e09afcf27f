#!/usr/bin/env bash
# Start ddpjob's real one-machine SLURM test cluster: munge, MariaDB, slurmdbd, slurmctld and two
# slurmd daemons (nodes n1 on 127.0.0.2 and n2 on 127.0.0.3), partitions `low` (default,
# preemptible, requeue) and `high` (preempts low). Installs the Debian packages if missing.
#
# Idempotent: daemons that already run and answer are left alone. When slurmctld has to be
# (re)started (first start, after a reboot or crash, or after slurm.conf.in changed), its saved
# state is cleared so stale jobs from an earlier life never come back, and FirstJobId is set past
# every job id already in the accounting database so job ids stay unique for sacct.
#
# Needs root. State and logs live under $DDPJOB_CLUSTER_DIR (default /var/lib/ddpjob-test-cluster).
# Exit status 0 only when `sinfo` shows n1 and n2 usable and `sacct` answers.
# --clean: also cancel every job already queued or running (CI does this: jobs left by an earlier
# session would otherwise hold the CPUs its tests need).
# --nodes N (2-32, default 2): N slurmd daemons, n1..nN on 127.0.0.2..; `low` and `high` keep
# n1 and n2 (the preemption tests need exactly those), partition `wide` holds them all, for the
# tests and benchmarks that need more nodes (a lost node with a spare, 2 to 32 ranks). Another N
# than the running cluster's restarts the controller (fresh state).
set -euo pipefail

CLEAN=false
# Without --nodes: as many as the running cluster has (a test that grew it is not undone by the
# next one that only wants the cluster up), else 2.
NODE_COUNT=$(grep -c '^NodeName=n' /etc/slurm/slurm.conf 2>/dev/null || true)
[[ $NODE_COUNT =~ ^[0-9]+$ ]] && [ "$NODE_COUNT" -ge 2 ] || NODE_COUNT=2
usage() { echo "usage: bash tests/cluster/start.sh [--clean] [--nodes N]   (2 <= N <= 32)" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --clean) CLEAN=true ;;
        --nodes) [ $# -ge 2 ] || usage; NODE_COUNT=$2; shift ;;
        *) usage ;;
    esac
    shift
done
[[ $NODE_COUNT =~ ^[0-9]+$ ]] && [ "$NODE_COUNT" -ge 2 ] && [ "$NODE_COUNT" -le 32 ] || usage

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DIR=${DDPJOB_CLUSTER_DIR:-/var/lib/ddpjob-test-cluster}
TIMEOUT=${DDPJOB_CLUSTER_TIMEOUT:-120}   # seconds allowed for each daemon to come up
CLUSTER=ddpjobtest
ACCOUNT=ddpjob
DBUSER=slurm
DBPASS=ddpjob-test-only                  # local test database reached only through its socket
MEM=2000                                 # MB per node: modest, well under the machine's memory
ETC=/etc/slurm
MARKER="ddpjob's one-machine test cluster"
NODES=()
for k in $(seq 1 "$NODE_COUNT"); do NODES+=("n$k"); done
PACKAGES=(slurm-wlm munge slurmdbd mariadb-server)
T0=$(date +%s%N)

log() { printf '[cluster] %s\n' "$*"; }
die() {  # die MESSAGE [LOGFILE...]: say what failed and show the end of the daemon's log
    printf '[cluster] ERROR: %s\n' "$1" >&2
    shift
    for f in "$@"; do
        if [ -f "$f" ]; then
            printf -- '--- last 25 lines of %s ---\n' "$f" >&2
            tail -n 25 "$f" >&2
        fi
    done
    exit 1
}
elapsed() { echo $(( ($(date +%s%N) - T0) / 1000000 )) | awk '{printf "%.1f", $1/1000}'; }

# wait_for DESCRIPTION LOGFILE COMMAND...: poll COMMAND every 0.5 s for at most $TIMEOUT seconds.
wait_for() {
    local what=$1 logf=$2
    shift 2
    local deadline=$(( $(date +%s) + TIMEOUT ))
    until "$@" >/dev/null 2>&1; do
        # WATCH_PID: a launcher whose early death means waiting longer is pointless.
        if [ -n "${WATCH_PID:-}" ] && ! kill -0 "$WATCH_PID" 2>/dev/null; then
            die "$what exited while starting" "$logf" "${WATCH_LOG:-}"
        fi
        if [ "$(date +%s)" -ge "$deadline" ]; then
            die "$what did not come up within ${TIMEOUT}s" "$logf"
        fi
        sleep 0.5
    done
}

# alive PIDFILE NAME: the pid file names a live process called NAME (a stale file after a reboot
# may name a pid that some other program now has; a killed daemon nobody reaped is a zombie).
alive() {
    local pid stat
    [ -f "$1" ] || return 1
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] || return 1
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [ "${stat%% *}" != Z ]
}

# stop_pidfile PIDFILE NAME: SIGTERM, wait up to 15 s, then SIGKILL; removes the pid file.
stop_pidfile() {
    local pid i
    if alive "$1" "$2"; then
        pid=$(cat "$1")
        kill -TERM "$pid" 2>/dev/null || true
        for i in $(seq 30); do
            [ -d "/proc/$pid" ] || break
            sleep 0.5
        done
        if [ -d "/proc/$pid" ]; then
            kill -KILL "$pid" 2>/dev/null || true
            sleep 0.5
        fi
    fi
    rm -f "$1"
}

# launch LOG COMMAND...: start a daemon with stdin from /dev/null, output appended to LOG, and no
# other inherited file descriptor. A daemon that kept the caller's descriptors would hold CI's
# output pipe (the run never "ends") or this script's lock open for as long as it lives.
# launch_bg: the same for a command that stays in the foreground; sets LAUNCHED_PID.
close_fds() {  # in a subshell: close every descriptor above 2
    local fd n
    for fd in /proc/$BASHPID/fd/*; do
        n=${fd##*/}
        if [ "$n" -gt 2 ]; then eval "exec $n>&-"; fi  # n is a number from /proc, not input
    done
}
launch() {
    local logf=$1
    shift
    ( close_fds; exec "$@" ) </dev/null >>"$logf" 2>&1
}
launch_bg() {
    local logf=$1
    shift
    ( close_fds; exec "$@" ) </dev/null >>"$logf" 2>&1 &
    LAUNCHED_PID=$!
}

render() {  # render TEMPLATE FIRSTJOBID: print the template with @VARS@ filled in
    sed -e "s|@CLUSTER@|$CLUSTER|g" -e "s|@HOST@|$HOST|g" -e "s|@DIR@|$DIR|g" \
        -e "s|@MEM@|$MEM|g" -e "s|@FIRSTJOBID@|$2|g" \
        -e "s|@DBUSER@|$DBUSER|g" -e "s|@DBPASS@|$DBPASS|g" "$1"
    if [ "$(basename "$1")" = slurm.conf.in ] && [ "$NODE_COUNT" -gt 2 ]; then
        # the nodes past n2, each on its own loopback address and slurmd port, and `wide`
        for k in $(seq 3 "$NODE_COUNT"); do
            echo "NodeName=n$k NodeHostname=$HOST NodeAddr=127.0.0.$((k + 1)) Port=$((6820 + k)) CPUs=2 RealMemory=$MEM State=UNKNOWN"
        done
        echo "PartitionName=wide Nodes=n[1-$NODE_COUNT] Default=NO MaxTime=1:00:00 State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=20 OverSubscribe=NO"
    fi
}

[ "$(id -u)" = 0 ] || die "tests/cluster/start.sh must run as root (it starts system daemons and edits /etc/hosts)"

# ---- 1. packages -----------------------------------------------------------------------------
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} with apt (about a minute)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null \
        || die "apt-get install ${missing[*]} failed"
fi

mkdir -p "$DIR"/{state,spool,run,log}
# One start at a time: several test runs may call this script at once. Daemons are started
# through `launch`, so none inherits (and holds forever) this lock.
exec 9>"$DIR/start.lock"
flock -w 300 9 || die "another tests/cluster/start.sh holds $DIR/start.lock for over 300 s"

HOST=$(hostname -s)
SLURMCTLD_LOG=$DIR/log/slurmctld.log
SLURMDBD_LOG=$DIR/log/slurmdbd.log
MARIADB_LOG=$DIR/log/mariadb/error.log

if [ -f "$ETC/slurm.conf" ] && ! grep -q "$MARKER" "$ETC/slurm.conf"; then
    die "$ETC/slurm.conf exists and was not written by this script; refusing to overwrite it (move it away to use the test cluster)"
fi

# ---- 2. node names resolve to their own loopback addresses -----------------------------------
add_host() {  # add_host IP NAME, idempotent
    if ! grep -qE "^[[:space:]]*$1[[:space:]]+([^#]*[[:space:]])?$2([[:space:]]|$)" /etc/hosts; then
        printf '%s %s  # %s\n' "$1" "$2" "$MARKER" >>/etc/hosts
    fi
    [ "$(getent hosts "$2" | awk '{print $1; exit}')" = "$1" ] \
        || die "/etc/hosts maps $2 to $(getent hosts "$2" | awk '{print $1; exit}'), expected $1"
}
for k in $(seq 1 "$NODE_COUNT"); do add_host "127.0.0.$((k + 1))" "n$k"; done

# ---- 3. munge --------------------------------------------------------------------------------
if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "munged already running"
else
    log "starting munged"
    if [ ! -s /etc/munge/munge.key ]; then
        mungekey --create --keyfile=/etc/munge/munge.key
    fi
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    chmod 755 /run/munge
    # --force: start even if a socket lock survived a reboot or crash.
    launch "$DIR/log/munged.out" su -s /bin/sh munge -c '/usr/sbin/munged --force' \
        || die "munged failed to start" "$DIR/log/munged.out" /var/log/munge/munged.log
    wait_for "munged" /var/log/munge/munged.log sh -c 'munge -n | unmunge'
fi

# ---- 4. MariaDB ------------------------------------------------------------------------------
if mysqladmin ping >/dev/null 2>&1; then
    log "MariaDB already running"
else
    log "starting MariaDB"
    mkdir -p /run/mysqld "$DIR/log/mariadb" && chown mysql:mysql /run/mysqld "$DIR/log/mariadb"
    if [ ! -d /var/lib/mysql/mysql ]; then
        mysql_install_db --user=mysql --datadir=/var/lib/mysql >"$DIR/log/mysql_install_db.out" 2>&1 \
            || die "mysql_install_db failed" "$DIR/log/mysql_install_db.out"
    fi
    # A pid file left by a reboot or crash would make mysqld_safe think the server is running.
    alive /run/mysqld/mysqld.pid mariadbd || alive /run/mysqld/mysqld.pid mysqld \
        || rm -f /run/mysqld/mysqld.pid
    launch_bg "$DIR/log/mysqld_safe.out" setsid mysqld_safe --user=mysql --log-error="$MARIADB_LOG"
    WATCH_PID=$LAUNCHED_PID WATCH_LOG=$DIR/log/mysqld_safe.out wait_for "MariaDB" "$MARIADB_LOG" mysqladmin ping
fi
mysql <<SQL || die "creating the slurm_acct_db database and its user failed" "$MARIADB_LOG"
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS '$DBUSER'@'localhost' IDENTIFIED BY '$DBPASS';
GRANT ALL ON slurm_acct_db.* TO '$DBUSER'@'localhost';
FLUSH PRIVILEGES;
SQL

# ---- 5. slurmdbd -----------------------------------------------------------------------------
mkdir -p "$ETC"
dbd_conf=$(render "$HERE/slurmdbd.conf.in" 0)
if alive "$DIR/run/slurmdbd.pid" slurmdbd && [ "$dbd_conf" = "$(cat "$ETC/slurmdbd.conf" 2>/dev/null)" ]; then
    log "slurmdbd already running"
else
    stop_pidfile "$DIR/run/slurmdbd.pid" slurmdbd
    log "starting slurmdbd"
    (umask 077 && printf '%s\n' "$dbd_conf" >"$ETC/slurmdbd.conf")
    chmod 600 "$ETC/slurmdbd.conf"
    launch "$DIR/log/slurmdbd.out" slurmdbd || die "slurmdbd failed to start" "$SLURMDBD_LOG"
fi

# slurm.conf must exist for sacctmgr to find slurmdbd; write it now when it is missing, using the
# FirstJobId that step 6 would compute (rewritten there anyway if slurmctld restarts).
first_job_id() {
    local max
    max=$(mysql -N -B slurm_acct_db -e "SELECT COALESCE(MAX(id_job),0) FROM ${CLUSTER}_job_table" 2>/dev/null) || max=0
    echo $(( ${max:-0} + 1 ))
}
[ -f "$ETC/slurm.conf" ] || render "$HERE/slurm.conf.in" "$(first_job_id)" >"$ETC/slurm.conf"
wait_for "slurmdbd" "$SLURMDBD_LOG" timeout 15 sacctmgr -n -P list cluster format=cluster
if ! timeout 15 sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
    timeout 30 sacctmgr -i add cluster "$CLUSTER" >/dev/null || die "sacctmgr add cluster $CLUSTER failed" "$SLURMDBD_LOG"
fi

# ---- 6. slurmctld ----------------------------------------------------------------------------
# The installed slurm.conf matches the template when everything but FirstJobId is the same.
conf_body() { grep -v '^FirstJobId=' "$@"; }
ctld_ok=false
if alive "$DIR/run/slurmctld.pid" slurmctld \
    && [ "$(render "$HERE/slurm.conf.in" 0 | conf_body)" = "$(conf_body "$ETC/slurm.conf")" ] \
    && timeout 15 scontrol ping 2>/dev/null | grep -q 'is UP'; then
    ctld_ok=true
    log "slurmctld already running"
else
    # A fresh controller: stop the slurmds too (they would keep running jobs the controller
    # no longer knows), clear saved state (stale jobs from before a reboot or crash), start clean.
    for f in "$DIR"/run/slurmd-*.pid; do [ -e "$f" ] && stop_pidfile "$f" slurmd; done  # every node of before
    stop_pidfile "$DIR/run/slurmctld.pid" slurmctld
    rm -rf "${DIR:?}/state" "${DIR:?}/spool"
    mkdir -p "$DIR/state" "$DIR/spool"
    fjid=$(first_job_id)
    render "$HERE/slurm.conf.in" "$fjid" >"$ETC/slurm.conf"
    log "starting slurmctld (fresh state, FirstJobId=$fjid)"
    launch "$DIR/log/slurmctld.out" slurmctld -c \
        || die "slurmctld failed to start" "$DIR/log/slurmctld.out" "$SLURMCTLD_LOG"
    wait_for "slurmctld" "$SLURMCTLD_LOG" sh -c 'timeout 15 scontrol ping | grep -q "is UP"'
fi

# ---- 7. slurmd n1 .. nN ----------------------------------------------------------------------
for n in "${NODES[@]}"; do
    if alive "$DIR/run/slurmd-$n.pid" slurmd; then
        log "slurmd $n already running"
    else
        log "starting slurmd $n"
        rm -f "$DIR/run/slurmd-$n.pid"
        mkdir -p "$DIR/spool/$n"
        launch "$DIR/log/slurmd-$n.out" slurmd -N "$n" \
            || die "slurmd -N $n failed to start" "$DIR/log/slurmd-$n.out" "$DIR/log/slurmd-$n.log"
    fi
done

# ---- 8. nodes usable -------------------------------------------------------------------------
# Usable: idle, mixed, allocated or completing, without the `*` that marks "not responding".
nodes_up() {
    local states
    states=$(timeout 15 sinfo -h -N -o '%N %T' 2>/dev/null | sort -u) || return 1
    for n in "${NODES[@]}"; do
        grep -qE "^$n (idle|mixed|allocated|completing)$" <<<"$states" || return 1
    done
}
deadline=$(( $(date +%s) + TIMEOUT ))
resumed=false
until nodes_up; do
    # A node left down/drained by an earlier crash stays so until resumed (once it responds).
    if ! $resumed; then
        for n in $(timeout 15 sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2 ~ /^(down|drain)/ {print $1}' | sort -u); do
            log "resuming node $n, left $(sinfo -h -n "$n" -o %T | head -1) by an earlier run"
            scontrol update nodename="$n" state=resume 2>/dev/null || true
            resumed=true
        done
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
        sinfo -N -l >&2 || true
        die "nodes ${NODES[*]} were not usable within ${TIMEOUT}s" "$SLURMCTLD_LOG" "$DIR/log/slurmd-n1.log" "$DIR/log/slurmd-n2.log"
    fi
    sleep 0.5
done

# ---- 9. accounting: account and user associations, sacct answers ----------------------------
if ! timeout 15 sacctmgr -n -P list account format=account | grep -qx "$ACCOUNT"; then
    timeout 30 sacctmgr -i add account "$ACCOUNT" cluster="$CLUSTER" \
        description="ddpjob tests" organization=ddpjob >/dev/null \
        || die "sacctmgr add account failed" "$SLURMDBD_LOG"
fi
if ! timeout 15 sacctmgr -n -P list assoc where user=root cluster="$CLUSTER" format=account | grep -qx "$ACCOUNT"; then
    timeout 30 sacctmgr -i add user root account="$ACCOUNT" cluster="$CLUSTER" >/dev/null \
        || die "sacctmgr add user root failed" "$SLURMDBD_LOG"
fi
wait_for "sacct (accounting)" "$SLURMDBD_LOG" timeout 15 sacct -n -X -S now
if ! $ctld_ok; then
    # Jobs the database still shows as running from before a crash or reboot ("runaway"): close
    # them, so sacct never reports a job from an earlier life as still running.
    timeout 60 sacctmgr -i show runawayjobs >/dev/null 2>&1 || log "warning: sacctmgr show runawayjobs failed"
fi

if $CLEAN; then
    jobs=$(timeout 15 squeue -h -o %A | sort -u | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
        log "--clean: cancelling jobs left from earlier runs: $jobs"
        # shellcheck disable=SC2086  # one argument per job id
        timeout 30 scancel $jobs || true
        deadline=$(( $(date +%s) + 60 ))
        until [ -z "$(timeout 15 squeue -h -o %A)" ] && nodes_up; do
            [ "$(date +%s)" -lt "$deadline" ] || die "jobs $jobs still there 60 s after scancel" "$SLURMCTLD_LOG"
            sleep 0.5
        done
    fi
fi

$ctld_ok && how=warm || how=cold
log "cluster $CLUSTER ready ($how) in $(elapsed)s: $(sinfo -h -N -o '%N=%T' | sort -u | tr '\n' ' ')"
log "state and logs under $DIR; stop with: bash tests/cluster/stop.sh"
