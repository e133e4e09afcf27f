"""The straggler watch on the SLURM test cluster, through `ddpjob submit` (submitit): 2 nodes x
2 tasks, one rank made slow at a chosen step (its 31st training forward call, trainer_plugins
DDPJOB_TEST_STRAGGLE) by a busy-wait in its backward pass or a sleep in its data loading, is
named with its host and the cause within 100 steps; a clean run names nobody. The CPU hog
needs a core of its own to share with one rank only, which 2 cores allow for 2 ranks: 2 nodes x
1 task, the slow rank and the hog pinned to the last core, the other rank to the first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from test_straggler_ranks import straggler_run

CASES = [("compute", 2, 2, 3, "n2"), ("data", 2, 2, 1, "n1"), ("hog", 2, 1, 1, "n2"), ("clean", 2, 2, None, "")]


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize("how, nodes, tasks, slow, host", CASES, ids=[c[0] for c in CASES])
def test_a_slow_rank_is_named_with_its_host_and_cause_and_a_clean_run_names_nobody(
        slurm_cluster: Any, tmp_path: Path, how: str, nodes: int, tasks: int, slow: int | None, host: str) -> None:
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    run, flags = straggler_run(tmp_path, how, backend="slurm", nodes=nodes, tasks=tasks, slow_rank=slow,
                               seconds=0.15 if how != "hog" else 0.0)
    if slow is None:
        assert flags == [], flags
        return
    assert [(f["rank"], f["host"]) for f in flags] == [(slow, host)], flags
    assert flags[0]["cause"] == ("data" if how == "data" else "compute"), flags
    assert 31 <= flags[0]["step"] <= 131, flags
