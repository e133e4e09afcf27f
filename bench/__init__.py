"""ddpjob's benchmarks: side-by-side ratios on the machine at hand (see bench/README.md).

`python -m bench` runs them all (run.py); core.py holds what each takes and gives (Bench, Row),
suite.py defines them (P8 in p8.py, P11 in p11.py), harness.py and pool.py the interleaved
trials over pinned worker processes (worker.py), recipes.py the hand-written references.
"""
