#!/usr/bin/env bash
# The project's test command: set up .venv, start the real SLURM test cluster, run pytest.
# Extra arguments go to pytest, e.g. `bash tools/test.sh -k hostlist`. Exits with pytest's status;
# "no tests collected" (pytest's 5) counts as a failure.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash tools/setup.sh
if [ "${CI:-}" = true ]; then
    bash tests/cluster/start.sh --clean  # CI owns the machine: no jobs left from a session
else
    bash tests/cluster/start.sh
fi
status=0
.venv/bin/python -m pytest "$@" || status=$?
if [ "$status" -eq 5 ]; then
    echo "[test] pytest collected no tests: treating that as a failure" >&2
    exit 1
fi
exit "$status"
