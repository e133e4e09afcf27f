"""`ddpjob submit`: parameter mapping to submitit, NodeTask's exit-code contract, dry runs,
one-line errors that leave nothing behind, and (on the test cluster) real submitit jobs."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from clirun import ddpjob as run_cli
from ddpjob import fileio, rundir
from ddpjob.ledger.events import read as read_events
from runlogs import decisions

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "jobs" / "smoke.toml")


# ------------------------------------------------------------------ the real test cluster
def _submit_slurm(tmp_path: Path, *extra: str, timeout: float = 120) -> tuple[Path, dict]:
    import slurmtools

    run = tmp_path / "run"
    out = run_cli("submit", SMOKE, "--backend", "slurm", "--run-dir", str(run), *extra, cwd=tmp_path,
                  timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    job = fileio.read_json(run / "job.json")
    slurmtools.submitted.append(job["job_id"])  # conftest cancels what a failed test leaves
    return run, job


def _wait_step(run: Path, step: int, timeout: float) -> None:
    from ddpjob.launch import runs

    deadline = time.monotonic() + timeout
    while (runs.last_metric(run)[0] or 0) < step:
        assert time.monotonic() < deadline, f"no step {step} in {run}/metrics.jsonl after {timeout}s"
        time.sleep(0.5)


@pytest.mark.cluster
def test_submitit_runs_a_2x2_job_to_completion(slurm_cluster, tmp_path):
    from slurmtools import cluster_free, wait_done, wait_state

    cluster_free()
    t0 = time.monotonic()
    run, job = _submit_slurm(tmp_path, "--nodes", "2", "--set", "train.max_steps=4",
                             "--set", "train.eval_every=0", "--set", "checkpoint.every_steps=2")
    submitted = time.monotonic()
    assert job["backend"] == "slurm" and job["job_id"].isdigit()
    script = (run / "job.sbatch").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --requeue",
                 "#SBATCH --open-mode=append", "#SBATCH --signal=USR2@60", "#SBATCH --time=00:15:00"):
        assert line in script.splitlines()
    wait_state(job["job_id"], ("RUNNING", "COMPLETING", "COMPLETED"), timeout=120)
    running = time.monotonic()
    assert wait_done(job["job_id"], timeout=300) == "COMPLETED"
    done = time.monotonic()
    assert rundir.completed(run) is not None and (run / "final" / "model.pt").is_file()
    out = run_cli("status", str(run))
    assert "state       COMPLETED" in out.stdout and "completed   yes" in out.stdout
    for rank in range(4):  # submitit's per-task logs, found through job.json
        assert (run / "logs" / f"{job['job_id']}_{rank}_log.out").is_file()
    log1 = run_cli("logs", str(run), "--rank", "1")
    assert log1.returncode == 0 and "JobEnvironment(" in log1.stdout and "global_rank=1(4)" in log1.stdout
    print(f"\nsubmit command {submitted - t0:.1f}s, submit->RUNNING {running - submitted:.1f}s, "
          f"submit->COMPLETED {done - submitted:.1f}s (2 nodes x 2 tasks, 4 steps)")


@pytest.mark.cluster
def test_usr2_requeues_the_submitit_job_which_resumes_and_completes(slurm_cluster, tmp_path):
    """The requeue contract: USR2 -> checkpoint, scontrol requeue, NodeTask exits 3 without a
    result; the same pickled NodeTask runs again, resumes from the checkpoint and completes."""
    from slurmtools import release_now, wait_done, wait_state

    run, job = _submit_slurm(tmp_path, "--set", "train.max_steps=400", "--set", "train.eval_every=0",
                             "--set", "train.log_every=5", "--set", "checkpoint.every_steps=0")
    jid = job["job_id"]
    wait_state(jid, ("RUNNING",), timeout=120)
    follower = subprocess.Popen([sys.executable, "-m", "ddpjob", "logs", str(run), "--follow"],
                                stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    _wait_step(run, 10, timeout=120)
    subprocess.run(["scancel", "--signal=USR2", jid], check=True, timeout=30)
    wait_state(jid, ("PENDING", "REQUEUED"), timeout=120)
    release_now(jid)
    assert wait_done(jid, timeout=400) == "COMPLETED"
    followed, _ = follower.communicate(timeout=120)  # --follow ends by itself with the job
    assert follower.returncode == 0 and followed.count("ddpjob run ") == 2
    stops = decisions(read_events(run))
    assert stops[0]["reason"] == "time_limit" and stops[0]["requeued"] is True
    assert stops[-1]["reason"] == "finished" and stops[-1]["restart"] == 1
    out = run_cli("status", str(run))
    assert "state       COMPLETED" in out.stdout and "restarts    1" in out.stdout
    log0 = (run / "logs" / f"{jid}_0_log.out").read_text()  # appended across the requeue
    assert log0.count("ddpjob run ") == 2 and "resum" in log0.lower()


@pytest.mark.cluster
def test_unknown_partition_and_sbatch_refusals_are_one_line_and_leave_nothing(slurm_cluster, tmp_path):
    out = run_cli("submit", SMOKE, "--backend", "slurm", "--partition", "nope", cwd=tmp_path)
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert "partition 'nope' does not exist on this cluster (sinfo lists: high, low)" in out.stderr
    assert "Hint: set slurm.partition" in out.stderr
    out = run_cli("submit", SMOKE, "--backend", "slurm", "--set", "slurm.constraint=nosuchfeature",
                  cwd=tmp_path)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("ddpjob: error: sbatch refused the job: ") and "Hint:" in out.stderr
    assert not (tmp_path / "runs").exists()
