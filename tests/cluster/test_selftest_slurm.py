"""`ddpjob selftest` as a user runs it: alone, under torchrun, under the legacy launcher, under srun."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from test_selftest import table_rows


PY = sys.executable


@pytest.mark.cluster
def test_two_nodes_two_tasks_each_under_srun(slurm_cluster, tmp_path: Path) -> None:
    from slurmtools import job_info, submit, wait_done

    out = tmp_path / "selftest.out"
    script = f"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --time=00:05:00
#SBATCH --job-name=ddpjob-selftest
#SBATCH --output={out}
# in the batch shell itself (not a rank): must refuse with one line
{PY} -m ddpjob selftest --timeout 10 && echo "batch-shell: ran" || echo "batch-shell: refused $?"
srun {PY} -m ddpjob selftest --size-mb 4 --timeout 60
"""
    job_id = submit(script, cwd=tmp_path)
    state = wait_done(job_id, timeout=600)  # may queue behind other tests
    text = out.read_text()
    assert state == "COMPLETED", text
    assert job_info(job_id).get("ExitCode", "0:0") == "0:0", text
    assert "batch-shell: refused 1" in text
    assert re.search(r"ddpjob: error: SLURM_NTASKS=4 but SLURM_STEP_ID is not set: this process runs "
                     r"in the sbatch batch script of job \d+.*Hint: start it with `srun", text)
    rows = table_rows(text)
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert [(r[1], r[2], r[3]) for r in rows] == [("0", "0", "n1"), ("1", "0", "n1"),
                                                   ("0", "1", "n2"), ("1", "1", "n2")]
    assert "all_reduce sum of ranks: 6 (expected 6)" in text
    assert "selftest: 4 rank(s) on 2 node(s) via slurm" in text and "master n1:" in text
    assert text.count("selftest: OK") == 1
