#!/usr/bin/env bash
# The suite as CI runs it, on a fresh clone of HEAD, with both cores busy (`stress-ng --cpu 2`
# beside it the whole time): how this project checks that no test races the clock.
#   bash tools/stress.sh [NAME]    log: /tmp/NAME.log, pytest's temp dirs: /tmp/NAME-bt
# The clone (its .venv alone is ~5.5 GB) and the temp dirs are removed at the end, the log kept;
# KEEP=1 keeps them. Why: CI runs on this same machine after the session, and each clone left
# behind holds ~6 GB of its disk (one CI run failed in pip: "No space left on device").
# It holds /tmp/ddpjob-cluster.lock while it runs (CI=true restarts the SLURM test cluster with
# --clean): wrap other cluster users or benchmarks in `flock /tmp/ddpjob-cluster.lock ...`.
set -u
name=${1:-stress}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
commit=$(git -C "$repo" rev-parse HEAD)
command -v stress-ng >/dev/null || { echo "stress-ng is missing: apt-get install -y stress-ng" >&2; exit 2; }
exec > "/tmp/$name.log" 2>&1
exec 9>/tmp/ddpjob-cluster.lock
echo "waiting for the cluster lock $(date -u +%T)"
flock 9
rm -rf "/tmp/$name" "/tmp/$name-bt"
git clone -q "$repo" "/tmp/$name" && git -C "/tmp/$name" checkout -q "$commit" || exit 9
cd "/tmp/$name"
echo "start $(date -u +%T) commit $(git rev-parse --short HEAD)"
stress-ng --cpu 2 --quiet &
spid=$!
t0=$(date +%s)
CI=true PYTEST_ADDOPTS="--basetemp=/tmp/$name-bt -p no:cacheprovider -rfE --durations=25" bash .ci/run
rc=$?
kill "$spid"; wait "$spid" 2>/dev/null
cd /tmp
[ "${KEEP:-0}" = 1 ] || rm -rf "/tmp/$name" "/tmp/$name-bt"
echo "end $(date -u +%T) rc=$rc took $(( $(date +%s) - t0 )) s"
exit "$rc"
