"""Run-dir permissions: 0700 (or 0750 with slurm.share_group), files 0600/0640, whatever the
umask; `ddpjob run` and submitit's script refuse a run dir others can write (submitit unpickles
RUN_DIR/logs/*_submitted.pkl at every start: a writable folder is code run as the job's user)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpjob import fileio
from test_permissions_ranks import _loose

REPO = Path(__file__).resolve().parents[2]
DDPJOB = [sys.executable, "-m", "ddpjob"]


@pytest.mark.cluster
def test_a_submitit_job_under_umask_002_with_share_group_keeps_its_pickle_private(slurm_cluster, tmp_path: Path) -> None:
    """Through real sbatch/srun: submitit's pickle, its logs, the checkpoints: nothing the group can
    write (the pickle used to be 664, so any group member could run code as the job's owner)."""
    import slurmtools

    run = tmp_path / "run"
    r = subprocess.run(DDPJOB + ["submit", str(REPO / "jobs/smoke.toml"), "--backend", "slurm", "--run-dir", str(run),
                                 "--set", "train.max_steps=4", "--set", "checkpoint.every_steps=2",
                                 "--set", "slurm.share_group=true"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, preexec_fn=lambda: os.umask(0o002))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    job_id = fileio.read_json(run / "job.json")["job_id"]
    slurmtools.submitted.append(job_id)
    assert slurmtools.wait_done(job_id, timeout=300) == "COMPLETED"
    assert list(run.glob("logs/*.pkl")) and list(run.glob("checkpoints/step-*/*.pt"))
    assert _loose(run, share=True) == {}
