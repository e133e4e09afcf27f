"""Nothing hangs (node/hang.py): a rank that stops making progress ends the job within
train.dist_timeout_s + 60 s, with one line naming the rank, its host and where it was, and
every thread's stack in each rank's log. Real processes (tests/api_script.py, 2 ranks under
`ddpjob run`); the stall is caused at a chosen step by the script itself, and the only clock
in the assertions is the issue's own bound (timeout + 60 s), measured from the stall."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from ranks import TESTS, write_job


@pytest.mark.cluster
def test_a_stalled_rank_on_the_slurm_cluster_fails_the_job_naming_rank_1_and_n2(
        slurm_cluster: object, tmp_path: Path) -> None:
    """2 nodes x 1 task through `ddpjob submit --backend slurm`: rank 1 (on n2) deadlocks in step
    6. The job ends FAILED (max_failures = 0) within dist_timeout_s + 60 s of the stall (SLURM's
    EndTime), rank 0's log names rank 1 and n2, rank 1's log holds its stack."""
    import slurmtools
    from test_examples_slurm import _submit

    slurmtools.cluster_free(timeout=600)
    timeout_s = 20
    job = write_job(tmp_path / "job.toml",
                    train={"entry": str(TESTS / "api_script.py"), "threads": 1, "dist_timeout_s": timeout_s},
                    checkpoint={"every_steps": 5}, user={"steps": 20, "stall_at": "1:6"},
                    slurm={"nodes": 2, "tasks_per_node": 1, "time": "00:10:00", "max_failures": 0})
    run_dir = tmp_path / "run"
    jid = _submit(job, run_dir)
    assert slurmtools.wait_done(jid, timeout=600) == "FAILED"
    logs = run_dir / "logs"
    rank0 = "".join(p.read_text() for p in sorted(logs.glob(f"{jid}_0_log.*")))
    rank1 = "".join(p.read_text() for p in sorted(logs.glob(f"{jid}_1_log.*")))
    (stalled,) = re.findall(r"stalled at ([0-9.]+)", rank1)
    ended = time.mktime(time.strptime(slurmtools.job_info(jid)["EndTime"], "%Y-%m-%dT%H:%M:%S"))
    assert ended - float(stalled) < timeout_s + 60, f"ended {ended - float(stalled):.0f} s after the stall"
    (line,) = [x for x in rank0.splitlines() if x.startswith("ddpjob: error:")]
    assert "rank 0 on n1:" in line and "rank 1 (n2) did not arrive" in line and "api_script.py:" in line
    assert re.search(r'File ".*api_script\.py", line \d+ in stall', rank1), rank1[-3000:]
    assert slurmtools.job_info(jid)["Restarts"] == "0"
