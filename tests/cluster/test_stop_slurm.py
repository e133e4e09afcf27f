"""`ddpjob stop RUN` (launch/stop.py): every rank stops at the same step with a checkpoint, the
job ends without a requeue (STOPPED), and `ddpjob resume` finishes it. On the local backend and
through real sbatch/scancel on the SLURM test cluster. The stop is caused at a step: rank 0 waits
in its 6th training forward call until the stop signal has reached it (trainer_plugins "pause")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from clirun import ddpjob as run_cli
from ranks import LAG, write_job
from test_stop import _env, _paused, _stops


@pytest.mark.cluster
def test_stop_of_a_slurm_job_checkpoints_and_ends_it_without_a_requeue(slurm_cluster: Any, tmp_path: Path) -> None:
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    job = write_job(tmp_path / "job.toml",
                    train=dict(model="trainer_plugins:signalling_cnn", batch_size=16, max_steps=30,
                               eval_every=0, threads=1, amp="off", log_every=1),
                    data=dict(dataset="synthetic", synthetic_train=512, synthetic_test=64),
                    checkpoint=dict(every_steps=100),
                    slurm=dict(nodes=1, tasks_per_node=2, time="00:10:00", max_requeues=3))
    run = tmp_path / "run"
    env = _env()
    assert run_cli("sbatch", str(job), "-o", str(tmp_path / "job.sbatch"), "--run-dir", str(run),
                   cwd=tmp_path, env=env).returncode == 0
    jid = slurmtools.submit(tmp_path / "job.sbatch", cwd=tmp_path,
                            env={"PYTHONPATH": env["PYTHONPATH"], "OMP_NUM_THREADS": "1",
                                 "DDPJOB_TEST_SIGNAL": "0:6:0:pause"})
    slurmtools.submitted.append(jid)
    _paused(run / "logs" / "rank-0.log", timeout=300)
    out = run_cli("stop", str(run), cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    slurmtools.wait_done(jid, 300)
    (stop,) = _stops(run)
    assert stop["reason"] == "user_stop" and stop["step"] == 6 + LAG and stop["requeued"] is None, stop
    assert "stopped by `ddpjob stop`" in stop["note"], stop
    assert slurmtools.job_info(jid)["Restarts"] == "0"
    status = run_cli("status", str(run), cwd=tmp_path, env=env).stdout
    assert "state       STOPPED (by `ddpjob stop` at step" in status, status
