#!/usr/bin/env bash
# Stop ddpjob's one-machine SLURM test cluster started by tests/cluster/start.sh: cancel its jobs,
# then stop every slurmd (n1 .. nN), slurmctld, slurmdbd, MariaDB and munged. Idempotent: whatever is not
# running is skipped. Saved state and logs stay under $DDPJOB_CLUSTER_DIR for inspection.
set -euo pipefail

DIR=${DDPJOB_CLUSTER_DIR:-/var/lib/ddpjob-test-cluster}
log() { printf '[cluster] %s\n' "$*"; }
[ "$(id -u)" = 0 ] || { echo "[cluster] ERROR: tests/cluster/stop.sh must run as root" >&2; exit 1; }

alive() {  # alive PIDFILE NAME: the pid file names a live process called NAME
    local pid
    [ -f "$1" ] || return 1
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}

stop_pidfile() {  # stop_pidfile PIDFILE NAME: SIGTERM, up to 15 s, then SIGKILL
    local pid i
    if alive "$1" "$2"; then
        pid=$(cat "$1")
        log "stopping $2 (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for i in $(seq 30); do
            [ -d "/proc/$pid" ] || break
            sleep 0.5
        done
        if [ -d "/proc/$pid" ]; then
            log "$2 (pid $pid) ignored SIGTERM for 15 s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$1"
}

# Cancel jobs first so slurmstepd and job processes end cleanly instead of outliving slurmd.
if command -v scontrol >/dev/null && timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP'; then
    jobs=$(timeout 10 squeue -h -o %A 2>/dev/null || true)
    if [ -n "$jobs" ]; then
        log "cancelling jobs: $(echo $jobs)"
        # shellcheck disable=SC2086  # one argument per job id
        scancel $jobs 2>/dev/null || true
        for _ in $(seq 40); do
            [ -z "$(timeout 10 squeue -h -o %A 2>/dev/null)" ] && break
            sleep 0.5
        done
    fi
fi

for f in "$DIR"/run/slurmd-*.pid; do [ -e "$f" ] && stop_pidfile "$f" slurmd; done  # n1 .. nN
stop_pidfile "$DIR/run/slurmctld.pid" slurmctld
stop_pidfile "$DIR/run/slurmdbd.pid" slurmdbd

if command -v mysqladmin >/dev/null && mysqladmin ping >/dev/null 2>&1; then
    log "stopping MariaDB"
    mysqladmin shutdown || true
    for _ in $(seq 60); do
        [ -e /run/mysqld/mysqld.pid ] || break
        sleep 0.5
    done
fi

stop_pidfile /run/munge/munged.pid munged
log "stopped (state and logs kept under $DIR)"
