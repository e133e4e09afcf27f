#!/usr/bin/env bash
# The GPU checks of one lent GPU machine, as one short script (issue 25): tests/ranks/test_gpu.py runs
# beside bench P8's cold compiles (compiling is host work), then P8 times its arms alone, then the
# async-snapshot test runs again alone (its figure is a blocking time). Uses the python3 on the
# PATH as it is (a GPU image's own torch); writes everything into OUT.
#   bash tools/gpu.sh OUT [BUDGET_S]      BUDGET_S: P8 starts no arm that would end later (default 480)
set -uo pipefail

OUT=${1:?usage: bash tools/gpu.sh OUT [BUDGET_S]}
BUDGET=${2:-480}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${TMPDIR:-/tmp}/ddpjob-gpu
mkdir -p "$OUT" "$WORK"
cd "$ROOT" || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    python3 -c 'import sys, torch, torchvision, triton; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "torchvision", torchvision.__version__,
"triton", triton.__version__)'
    nproc
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

hold=$WORK/tests-running
touch "$hold"
workers=$(python3 -c 'import xdist' 2>/dev/null && echo "-n 4")  # pytest-xdist, where installed
(python3 -m pytest tests/ranks/test_gpu.py -q -rP $workers -p no:cacheprovider >"$OUT/pytest.log" 2>&1
 echo "pytest exit $?" >>"$OUT/pytest.log"; rm -f "$hold") &
tests=$!
(while sleep 15; do cp "$WORK/P8/arms.jsonl" "$OUT/" 2>/dev/null; done) &
copier=$!

python3 -m bench P8 --trials 2 --budget-s "$BUDGET" --hold "$hold" --work "$WORK" --json "$OUT/p8.json" \
    >"$OUT/bench.log" 2>&1
echo "bench exit $?" >>"$OUT/bench.log"
wait "$tests"
kill "$copier" 2>/dev/null
cp "$WORK/P8/arms.jsonl" "$OUT/" 2>/dev/null
python3 -m pytest tests/ranks/test_gpu.py -q -rP -p no:cacheprovider -k async_snapshot >"$OUT/snapshot.log" 2>&1
tail -5 "$OUT/pytest.log"
grep -E "blocked|amp auto on" "$OUT/pytest.log" "$OUT/snapshot.log"
grep -E "^\| P8|exit" "$OUT/bench.log"
