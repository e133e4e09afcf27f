"""`ddpjob status / logs / cancel / ls` on local runs (real supervisor, fake ranks), the parsing
of sacct/squeue output (fake binaries on PATH), and on real SLURM jobs (test cluster)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from clirun import ddpjob, wait_for
from ranks import LAG

from ddpjob import fileio, jobfile, rundir
from ddpjob.launch import runs
from ddpjob.ledger.events import read as read_events
from runlogs import decisions

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ real SLURM jobs
@pytest.mark.cluster
def test_a_stop_decided_while_ddpjob_cancel_is_recorded_is_not_requeued(slurm_cluster, tmp_path):
    """`ddpjob cancel` records its cancel, then scancels. SLURM 22.05 takes `scontrol requeue` of
    a job still COMPLETING after its scancel and runs it again (job 391 of a CI run, 2026-11-28:
    cancelled as its ranks started, requeued by their decision). Caused here at a step: rank 0
    waits in its 10th forward call, the test records the cancel as `ddpjob cancel` does and sends
    the time-limit signal: the stop's decision ends the job, nothing requeues it."""
    import slurmtools
    from ranks import write_job
    from test_preemption_slurm import CHECKPOINT, DATA, SLURM, TRAIN
    from test_requeue_slurm import sbatch

    from ddpjob.ledger import requests

    slurmtools.cluster_free(timeout=300)
    job = write_job(tmp_path / "job.toml", slurm=SLURM, train=TRAIN, data=DATA, checkpoint=CHECKPOINT)
    run, jid = sbatch(tmp_path, job, DDPJOB_TEST_SIGNAL="0:10::pause")
    log = run / rundir.LOGS / "rank-0.log"
    wait_for(lambda: log.is_file() and "paused at call 10" in log.read_text(errors="replace"), 300,
             "rank 0 to pause", alive=lambda: slurmtools.active(jid), whose=f"job {jid}")
    requests.cancel(run, jid, 0)  # `ddpjob cancel`'s first half; its scancel would follow
    assert subprocess.run(["scancel", "--signal=USR2", jid], timeout=60).returncode == 0
    slurmtools.wait_done(jid, 300)
    decided = decisions(read_events(run))
    assert [(d["reason"], d.get("action")) for d in decided] == [("time_limit", "end")], decided
    assert "cancelled by `ddpjob cancel`" in decided[0]["note"], decided
    assert len(slurmtools.sacct_times(jid)) == 1  # one start: never requeued


@pytest.mark.cluster
def test_status_logs_cancel_ls_on_a_real_slurm_job(slurm_cluster, tmp_path):
    import slurmtools
    from slurmtools import wait_done, wait_state

    run = tmp_path / "runs" / "long"
    out = ddpjob("submit", str(ROOT / "jobs" / "smoke.toml"), "--backend", "slurm", "--run-dir", str(run),
                 "--set", "train.max_steps=100000", "--set", "train.eval_every=0",
                 cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    job_id = fileio.read_json(run / "job.json")["job_id"]
    slurmtools.submitted.append(job_id)
    wait_state(job_id, ("RUNNING",), timeout=120)
    wait_for(lambda: ddpjob("logs", str(run), "--rank", "1", cwd=tmp_path).returncode == 0, timeout=60,
             what="rank 1's log")
    out = ddpjob("status", job_id, cwd=tmp_path)
    assert "state       RUNNING" in out.stdout and f"job         {job_id} (slurm)" in out.stdout
    out = ddpjob("ls", cwd=tmp_path)
    assert any(ln.split()[1:4] == ["slurm", job_id, "RUNNING"] for ln in out.stdout.splitlines()[1:])
    rec = json.loads(ddpjob("status", str(run), "--json", cwd=tmp_path).stdout)
    assert (rec["backend"], rec["job_ids"], rec["state"], rec["completed"]) == ("slurm", [job_id], "RUNNING", False)
    out = ddpjob("cancel", str(run), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert wait_done(job_id, timeout=120) == "CANCELLED"
    wait_for(lambda: "CANCELLED" in ddpjob("status", str(run), cwd=tmp_path).stdout, timeout=30,
             what="status CANCELLED")
    assert any(e["event"] == "cancel" for e in read_events(run))


@pytest.mark.cluster
def test_a_preempted_submitit_job_is_requeued_by_slurm_and_resumes(slurm_cluster, tmp_path):
    """PreemptMode=REQUEUE: SIGTERM -> checkpoint, exit 3 (NodeTask leaves no result), SLURM
    requeues the job itself; the next incarnation resumes and completes."""
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    run = tmp_path / "runs" / "pre"
    out = ddpjob("submit", str(ROOT / "jobs" / "smoke.toml"), "--backend", "slurm", "--run-dir", str(run),
                 "--set", "train.max_steps=300", "--set", "train.eval_every=0", "--set", "train.log_every=5",
                 cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    job_id = fileio.read_json(run / "job.json")["job_id"]
    slurmtools.submitted.append(job_id)
    slurmtools.wait_state(job_id, ("RUNNING",), timeout=120)
    wait_for(lambda: (runs.last_metric(run)[0] or 0) >= 10, timeout=120, what="step 10")
    high = slurmtools.submit("#!/bin/bash\n#SBATCH -p high -N 2 --ntasks-per-node=2 -t 2 -J pre-high\n"
                             "srun sleep 3\n", cwd=tmp_path)
    assert slurmtools.wait_done(high, timeout=180) == "COMPLETED"
    if slurmtools.wait_state(job_id, ("PENDING", "RUNNING", "COMPLETED"), timeout=60) == "PENDING":
        slurmtools.release_now(job_id)  # skip the ~11 s hold of a requeued job
    assert slurmtools.wait_done(job_id, timeout=400) == "COMPLETED"
    stops = decisions(read_events(run))
    assert stops[0]["reason"] == "preemption" and stops[-1]["reason"] == "finished"
    assert stops[-1]["restart"] == 1 and rundir.completed(run)["step"] == 300
    out = ddpjob("status", str(run), cwd=tmp_path)
    assert "state       COMPLETED" in out.stdout and "restarts    1" in out.stdout


@pytest.mark.cluster
def test_status_and_logs_of_a_run_started_with_ddpjob_sbatch(slurm_cluster, tmp_path):
    """rank-<R>.log and the job id from events.jsonl: runs that `ddpjob submit` did not make."""
    import slurmtools

    run = tmp_path / "runs" / "sb"
    out = ddpjob("sbatch", str(ROOT / "jobs" / "smoke.toml"), "-o", str(tmp_path / "job.sbatch"),
                 "--run-dir", str(run), "--set", "train.max_steps=3", "--set", "train.eval_every=0",
                 cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    job_id = slurmtools.submit(tmp_path / "job.sbatch", cwd=tmp_path)
    assert slurmtools.wait_done(job_id, timeout=300) == "COMPLETED"
    out = ddpjob("status", job_id, cwd=tmp_path)
    assert f"job         {job_id} (slurm)" in out.stdout and "state       COMPLETED" in out.stdout
    assert "completed   yes" in out.stdout
    out = ddpjob("logs", str(run), "--rank", "1", cwd=tmp_path)
    # the log as the rank wrote it, its line at the start shown as the attempt's mark
    log = (run / "logs" / "rank-1.log").read_text()
    wrote = re.search(rf"^ddpjob: attempt 0 starts: rank 1 on n[12], job {job_id}\n", log, re.M)
    assert wrote, log
    assert out.returncode == 0 and out.stdout == log.replace(wrote.group(0), f"==> attempt 0 (job {job_id}, first start) <==\n")


@pytest.mark.cluster
def test_resume_of_a_cancelled_sbatch_run_finishes_it(slurm_cluster, tmp_path):
    """`ddpjob resume` of a run made by `ddpjob sbatch` + sbatch and cancelled: the template is
    rendered again and submitted; the run resumes from the checkpoint written at the cancel."""
    import slurmtools

    run = tmp_path / "runs" / "sb"
    keys = ["--set", "train.eval_every=0", "--set", 'train.model="trainer_plugins:signalling_cnn"']
    out = ddpjob("sbatch", str(ROOT / "jobs" / "smoke.toml"), "-o", str(tmp_path / "job.sbatch"),
                 "--run-dir", str(run), "--set", "train.max_steps=30", *keys, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    # rank 0 waits in its 6th forward call until the cancel's SIGTERM has reached it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
           "DDPJOB_TEST_SIGNAL": "0:6:0:pause"}
    first = slurmtools.submit(tmp_path / "job.sbatch", cwd=tmp_path, env=env)
    slurmtools.read_when(run / "logs" / "rank-0.log", "paused at call 6", timeout=300)
    assert ddpjob("cancel", str(run), cwd=tmp_path).returncode == 0
    assert slurmtools.wait_done(first, timeout=120) == "CANCELLED"
    [stop] = decisions(read_events(run))
    assert (stop["reason"], stop["step"], stop["requeued"]) == ("signal", 6 + LAG, None), stop
    env.pop("DDPJOB_TEST_SIGNAL")  # sbatch passes resume's environment on to the job
    out = subprocess.run([sys.executable, "-m", "ddpjob", "resume", str(run), "--set", "train.max_steps=12"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    job = fileio.read_json(run / "job.json")
    assert job["via"] == "sbatch" and job["job_ids"] == [first, job["job_id"]]
    slurmtools.submitted.append(job["job_id"])
    assert slurmtools.wait_done(job["job_id"], timeout=300) == "COMPLETED"
    starts = [e for e in read_events(run) if e.get("event") == "start"]
    assert [(s["job_id"], s.get("resumed_step")) for s in starts] == [(first, None), (job["job_id"], 6 + LAG)]
    assert rundir.completed(run)["step"] == 12
    assert "#SBATCH" in (run / "job.sbatch").read_text() and jobfile.read_run_config(run).train.max_steps == 12
