"""ddpjob's benchmarks: side-by-side ratios on the machine at hand (see bench/README.md).

`python -m bench` runs them all (run.py); suite.py defines P1-P8, harness.py the interleaved
trials over pinned worker processes (worker.py), recipes.py the hand-written references.
"""
