"""One history, on the real SLURM test cluster (2 nodes x 2 tasks, `ddpjob sbatch` + `sbatch`): the
sequence of tests/ranks/test_history_local.py (`ddpjob stop`, `ddpjob resume`, the time limit's
signal and `scontrol requeue`, kill -9 of a rank restarted in place, `ddpjob stop`, `ddpjob
resume`, the signal again, the end), each caused at a step by the rank itself. Every view numbers
the six attempts 0..5 the same way; goodput's replayed steps are the steps trained twice, its
parts add up to the wall time, and its queue and run times match sacct within a second."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from ranks import write_job
from test_history_local import ACTIONS, DATA, TRAIN, assert_the_sequence
from test_preemption_slurm import ddpjob, job_env, release
from test_requeue_slurm import sbatch

SLURM = dict(nodes=2, tasks_per_node=2, time="00:10:00", signal_lead_s=60)


def wait_state(run: Path, jobs: set[str], cwd: Path, timeout: float = 600) -> str:
    """Release each requeued job of the run as it waits (the ~11 s BeginTime hold is SLURM's, not
    ddpjob's), until the run's job has ended; returns `ddpjob status`'s state."""
    import slurmtools

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for jid in jobs:
            state, _ = slurmtools._state(jid)
            if state == "PENDING" and slurmtools.job_info(jid).get("Restarts", "0") != "0":
                release(jid)
        if all(slurmtools._state(j)[0] in slurmtools.FINAL_STATES for j in jobs):
            return slurmtools._state(max(jobs, key=lambda j: int(j.split("_")[0])))[0]
        time.sleep(1)
    raise TimeoutError(f"the run's jobs {sorted(jobs)} did not end in {timeout} s")


@pytest.mark.cluster
@pytest.mark.slow
def test_every_view_tells_one_history_on_slurm(slurm_cluster: Any, tmp_path: Path) -> None:
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    (tmp_path / "actions").write_text(ACTIONS)
    job = write_job(tmp_path / "job.toml", slurm=SLURM, train=TRAIN, data=DATA,
                    checkpoint=dict(every_steps=10, keep_last=3))
    env = dict(DDPJOB_TEST_ACTIONS=str(tmp_path / "actions"))
    run, first = sbatch(tmp_path, job, **env)
    jobs = {first}
    assert wait_state(run, jobs, tmp_path) == "FAILED"  # `ddpjob stop`: exit 3, STOPPED to ddpjob
    for _ in range(2):  # each `ddpjob resume` runs until the next `ddpjob stop`, then to the end
        ddpjob("resume", str(run), cwd=tmp_path, env=job_env(**env))
        record = json.loads((run / "job.json").read_text())
        jobs |= {str(j) for j in record.get("job_ids") or []} | {str(record["job_id"])}
        slurmtools.submitted.extend(jobs)  # conftest cancels what a failed test leaves
        state = wait_state(run, jobs, tmp_path)
    assert state == "COMPLETED"
    stops, gp = assert_the_sequence(run, tmp_path)
    assert (stops[2]["failed_rank"], stops[2]["failed_host"]) == (1, "n1")
    # the queue and the run's span, against sacct's Submit/Start/End of every start of every job
    starts = sorted(t for j in jobs for t in slurmtools.sacct_times(j))
    assert abs(gp["begin"] - starts[0][0]) <= 1 and abs(gp["end"] - starts[-1][2]) <= 1, (gp, starts)
    queued = sum(start - submit for submit, start, _ in starts)
    assert abs(gp["seconds"]["queue"] - queued) <= 1 * len(starts), (gp["seconds"], starts)
