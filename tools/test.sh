#!/usr/bin/env bash
# The project's test command: set up .venv, start the real SLURM test cluster, run pytest over the
# three tiers: tests/unit then tests/ranks in one session, tests/cluster in another beside it.
# Extra arguments go to pytest, e.g. `bash tools/test.sh -k hostlist` (across all tiers); when one of
# them names a test path (`bash tools/test.sh tests/ranks`), only what they name runs.
# Exits with pytest's status; "no tests collected" (pytest's 5) counts as a failure.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash tools/setup.sh
if [ "${CI:-}" = true ]; then
    bash tests/cluster/start.sh --clean  # CI owns the machine: no jobs left from a session
else
    bash tests/cluster/start.sh
fi
tiers=(tests/unit tests/ranks tests/cluster)
prev=
for arg in "$@"; do
    # a path among the arguments (not the value of an option such as -k or -m) selects what runs
    case "$prev" in -k|-m|-p|-o|-c|-W|--deselect|--ignore|--basetemp|--rootdir) prev=$arg; continue ;; esac
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
        tiers=()
        break
    fi
    prev=$arg
done
# The full run (no path among the arguments) runs the cluster tier in a second pytest session beside
# the other two: its tests spend about a fifth of their time waiting for SLURM (holds, scheduling
# passes, KillWait) and the other tiers a quarter waiting for their ranks, so the two fill each
# other's gaps on a 2-core machine. DDPJOB_TEST_SERIAL=1: one session, the tiers in turn.
if [ ${#tiers[@]} -eq 3 ] && [ "${DDPJOB_TEST_SERIAL:-}" != 1 ]; then
    side=$(mktemp -d "${TMPDIR:-/tmp}/ddpjob-cluster-tier.XXXXXX")
    # A --basetemp given to both sessions would be emptied by the one that starts second.
    own=()
    prev=
    read -ra addopts <<< "${PYTEST_ADDOPTS:-}"
    for arg in "${addopts[@]}" "$@"; do
        case "$arg" in
            --basetemp=*) own=(--basetemp "${arg#--basetemp=}-cluster") ;;
            *) [ "$prev" != --basetemp ] || own=(--basetemp "$arg-cluster") ;;
        esac
        prev=$arg
    done
    echo "[test] the cluster tier runs beside the others; its output follows theirs (live: $side/pytest.log)"
    .venv/bin/python -m pytest tests/cluster "$@" "${own[@]}" > "$side/pytest.log" 2>&1 &
    cluster=$!
    # An interrupted run takes the cluster tier with it (a background job ignores the terminal's ^C)
    trap '[ -z "$cluster" ] || kill "$cluster" 2>/dev/null || true' EXIT
    first=0
    .venv/bin/python -m pytest tests/unit tests/ranks "$@" || first=$?
    echo "[test] waiting for the cluster tier"
    second=0
    wait "$cluster" || second=$?
    cluster=
    echo "[test] ---------------- the cluster tier (tests/cluster) ----------------"
    cat "$side/pytest.log"
    rm -rf "$side"
    # pytest's 5 (nothing collected) only counts where both sessions collected nothing
    if [ "$first" -eq 5 ] && [ "$second" -eq 5 ]; then
        status=5
    elif [ "$first" -ne 0 ] && [ "$first" -ne 5 ]; then
        status=$first
    elif [ "$second" -ne 0 ] && [ "$second" -ne 5 ]; then
        status=$second
    else
        status=0
    fi
else
    status=0
    .venv/bin/python -m pytest "${tiers[@]}" "$@" || status=$?
fi
if [ "$status" -eq 5 ]; then
    echo "[test] pytest collected no tests: treating that as a failure" >&2
    exit 1
fi
exit "$status"
