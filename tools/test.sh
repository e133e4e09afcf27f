#!/usr/bin/env bash
# The project's test command: set up .venv, start the real SLURM test cluster, run pytest over the
# three tiers in one session (tests/unit, then tests/ranks, then tests/cluster).
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
status=0
.venv/bin/python -m pytest "${tiers[@]}" "$@" || status=$?
if [ "$status" -eq 5 ]; then
    echo "[test] pytest collected no tests: treating that as a failure" >&2
    exit 1
fi
exit "$status"
