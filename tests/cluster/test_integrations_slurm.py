"""The trainer callbacks (docs/integrations.md) on the real SLURM test cluster: a Hugging Face
Trainer run (tests/command_scripts/hf_train.py) and a Lightning run (lightning_train.py), each
with `DdpjobCallback()` and a job file that sets only the command, 2 nodes x 1 task, 300 steps,
a checkpoint every 50, through `ddpjob sbatch` + real sbatch (and HF through `ddpjob submit`,
submitit); a Lightning script without the callback, which resumes from its save of step 100; and
a kill -9 of an HF rank, restarted in place from its save of step 100; `ddpjob stop` + `ddpjob
resume` of an HF run, resumed at its step.

Rank 1 pauses after step 130 until its stop signal; a `high` job on both nodes preempts the job;
the callback stops both ranks after step 130, saves, exits 3; rank 0 requeues; the next start
resumes at step 130 (0 steps redone) and ends COMPLETED at 300; `status` shows the real step
and the goodput. Caused at a step, never by a timer.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

import clirun
from clirun import TESTS, job_env, without_job_env
from ranks import write_job
from runlogs import decisions, events, lines
from test_command_slurm import rank_log  # both log layouts: sbatch's rank-R.log, submitit's

pytest.importorskip("transformers")
pytest.importorskip("lightning")

pytestmark = pytest.mark.cluster

SCRIPTS = {"hf": TESTS / "command_scripts" / "hf_train.py", "lightning": TESTS / "command_scripts" / "lightning_train.py"}
STEPS, EVERY, AT = 300, 50, 130


def preempted_at(run: Path, jid: str, tmp_path: Path, step: int | None = AT) -> None:
    """As test_command_slurm's, at step AT: rank 1 waits there until the preemption's signal.
    `step`: the step the stop record names (None: not checked; a script without the callback
    writes no metrics lines)."""
    import slurmtools
    from test_preemption_slurm import preempt, release

    clirun.wait_for(lambda: f"paused at step {AT}" in rank_log(run, 1), 420, f"rank 1 to pause after step {AT}",
                    alive=lambda: slurmtools.active(jid), whose=f"job {jid}")
    high = preempt(jid, tmp_path, "high")
    stop = clirun.wait_for(lambda: decisions(events(run)), 240, "the preemption's stop")[0]
    assert (stop["reason"], stop["requeued"]) == ("preemption", True), stop
    assert step is None or stop["step"] == step, stop
    slurmtools.wait_state(jid, {"PENDING"}, timeout=90)
    assert slurmtools.wait_done(high, timeout=180) == "COMPLETED"
    release(jid)


def sbatched(tmp_path: Path, trainer: str, at: str, *, callback: bool = True) -> tuple[Path, str]:
    """The trainer's script as the job's command (2 nodes x 1 task, 300 steps, a save every 50),
    through `ddpjob sbatch` and real sbatch, with the test hook DDPJOB_TEST_AT=`at`; the run dir
    and the job id."""
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.toml", slurm=dict(nodes=2, tasks_per_node=1, time="00:15:00"),
                    train=dict(command=[sys.executable, str(SCRIPTS[trainer]), "--out_dir", str(tmp_path / "out"),
                                        "--max_steps", str(STEPS), "--save_every", str(EVERY),
                                        *(["--callback"] if callback else [])]))
    clirun.ddpjob("sbatch", str(job), "-o", str(tmp_path / "job.sbatch"), "--run-dir", str(run), cwd=tmp_path,
                  env=without_job_env(), timeout=180, check=True)
    return run, slurmtools.submit(tmp_path / "job.sbatch", cwd=tmp_path, env=job_env(DDPJOB_TEST_AT=at))


@pytest.mark.parametrize("trainer,launch", [("hf", "sbatch"), ("lightning", "sbatch"), ("hf", "submit")])
def test_a_preempted_trainer_with_the_callback_resumes_at_its_step_on_slurm(
        slurm_cluster: Any, tmp_path: Path, trainer: str, launch: str) -> None:
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.toml", slurm=dict(nodes=2, tasks_per_node=1, time="00:15:00"),
                    train=dict(command=[sys.executable, str(SCRIPTS[trainer]), "--out_dir", str(tmp_path / "out"),
                                        "--max_steps", str(STEPS), "--save_every", str(EVERY), "--callback"]))
    if launch == "sbatch":
        clirun.ddpjob("sbatch", str(job), "-o", str(tmp_path / "job.sbatch"), "--run-dir", str(run), cwd=tmp_path,
                      env=without_job_env(), timeout=180, check=True)
        jid = slurmtools.submit(tmp_path / "job.sbatch", cwd=tmp_path, env=job_env(DDPJOB_TEST_AT=f"1:{AT}:0:pause"))
    else:
        clirun.ddpjob("submit", str(job), "--backend", "slurm", "--run-dir", str(run), cwd=tmp_path,
                      env=without_job_env(job_env(DDPJOB_TEST_AT=f"1:{AT}:0:pause")), timeout=180, check=True)
        jid = json.loads((run / "job.json").read_text())["job_id"]
        slurmtools.submitted.append(jid)
    preempted_at(run, jid, tmp_path)
    assert slurmtools.wait_done(jid, 900) == "COMPLETED", rank_log(run, 0) + rank_log(run, 1)
    assert (run / "COMPLETED").is_file()
    assert [int(s) for s in re.findall(r"^training from step ([0-9]+)$", rank_log(run, 0), re.M)] == [0, AT]
    assert f"done at step {STEPS}" in rank_log(run, 0)
    steps = [(r["restart"], r["step"]) for r in lines(run / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == [(0, s) for s in range(1, AT + 1)] + [(1, s) for s in range(AT + 1, STEPS + 1)], steps[-3:]
    info = json.loads(clirun.ddpjob("status", str(run), "--json", cwd=tmp_path, env=without_job_env(),
                                    check=True).stdout)
    assert info["state"] == "COMPLETED" and info["restarts"] >= 1, info
    text = clirun.ddpjob("status", str(run), cwd=tmp_path, env=without_job_env(), check=True).stdout
    assert f"last step   {STEPS}" in text and f"resumed at step {AT}" in text and "goodput" in text, text


def test_a_preempted_lightning_run_without_the_callback_resumes_from_its_last_save_on_slurm(
        slurm_cluster: Any, tmp_path: Path) -> None:
    """The issue's first complaint, on real SLURM: an unported Lightning script (its own SIGTERM
    handler, ModelCheckpoint(save_last=True) every 50 steps, fit(ckpt_path="last")) preempted
    after step 130, rank 0 waiting there. Lightning's handler cannot end the fit inside the
    step's all-reduce, and GraceTime's SIGKILL (20 s, under command_grace_s' 60) ends every rank
    before ddpjob records a stop: SLURM requeues the job itself, and the next start records the
    attempt's end from sacct (it used to find no start record of a program that logs no steps,
    and ran as the same attempt). It is never marked COMPLETED early; the next start resumes
    from last.ckpt of step 100 (30 steps redone, docs/integrations.md) and ends COMPLETED at 300."""
    import slurmtools
    from test_preemption_slurm import preempt

    run, jid = sbatched(tmp_path, "lightning", f"0:{AT}:0:pause", callback=False)  # rank 0 waits at 130
    clirun.wait_for(lambda: f"paused at step {AT}" in rank_log(run, 0), 420, f"rank 0 to pause after step {AT}",
                    alive=lambda: slurmtools.active(jid), whose=f"job {jid}")
    high = preempt(jid, tmp_path, "high")
    assert slurmtools.wait_done(high, timeout=300) == "COMPLETED"
    assert slurmtools.wait_done(jid, 900) == "COMPLETED", rank_log(run, 0) + rank_log(run, 1)
    assert (run / "COMPLETED").is_file()
    # without the callback's end line a teardown abort after step 300 on every rank (docs/commands.md)
    # is read as a crash: one more start from the save of step 300, never one from before it
    started = [int(s) for s in re.findall(r"^training from step ([0-9]+)$", rank_log(run, 0), re.M)]
    assert started[:2] == [0, 100] and set(started[2:]) <= {STEPS}, rank_log(run, 0)
    assert f"done at step {STEPS}" in rank_log(run, 0)
    first = decisions(events(run))[0]
    assert first["restart"] == 0 and first["requeued"] is True and first["reason"] != "finished", first
    finished = [e for e in events(run, "stop") if e.get("reason") == "finished"]
    assert len(finished) == 1 and finished[0]["restart"] >= 1, finished  # COMPLETED once, after the requeue


def test_a_killed_rank_of_an_hf_trainer_with_the_callback_restarts_in_place_on_slurm(
        slurm_cluster: Any, tmp_path: Path) -> None:
    """kill -9 of rank 1's trainer after step 130 (its own SIGKILL: no code runs, nothing is
    saved): srun ends the step, the batch shell decides it (infrastructure, restart in place
    inside the allocation) and the trainer resumes from checkpoint-100 (30 steps redone, the
    docs' table), COMPLETED at 300 in the same job."""
    import slurmtools

    run, jid = sbatched(tmp_path, "hf", f"1:{AT}:0:kill")
    assert slurmtools.wait_done(jid, 900) == "COMPLETED", rank_log(run, 0) + rank_log(run, 1)
    (crash,) = decisions(events(run))[:1]
    assert (crash["reason"], crash["verdict"], crash["action"], crash["requeued_by"]) == \
        ("crash", "infrastructure", "restart", "in_allocation"), crash
    assert crash["failed_rank"] == 1, crash
    assert [int(s) for s in re.findall(r"^training from step ([0-9]+)$", rank_log(run, 0), re.M)] == [0, 100], \
        rank_log(run, 0)
    assert (run / "COMPLETED").is_file() and f"done at step {STEPS}" in rank_log(run, 0)
    assert {str(e["job_id"]) for e in events(run, "start")} == {jid}  # in place: the same job


def test_stop_and_resume_of_an_hf_trainer_with_the_callback_loses_nothing_on_slurm(
        slurm_cluster: Any, tmp_path: Path) -> None:
    """`ddpjob stop` of the sbatch job while rank 1 waits after step 130: the callback stops both
    ranks after step 130 and saves checkpoint-130; the job ends STOPPED, not requeued; `ddpjob
    resume` submits it again and it resumes at 130 (0 steps redone), COMPLETED at 300."""
    import slurmtools

    run, jid = sbatched(tmp_path, "hf", f"1:{AT}:0:pause")
    clirun.wait_for(lambda: f"paused at step {AT}" in rank_log(run, 1), 420, f"rank 1 to pause after step {AT}",
                    alive=lambda: slurmtools.active(jid), whose=f"job {jid}")
    clirun.ddpjob("stop", str(run), cwd=tmp_path, env=without_job_env(), check=True)
    slurmtools.wait_done(jid, 300)
    assert not (run / "COMPLETED").exists(), rank_log(run, 0) + rank_log(run, 1)
    (stop,) = decisions(events(run))
    assert (stop["reason"], stop["step"], stop["requeued"]) == ("user_stop", AT, None), stop
    assert (tmp_path / "out" / f"checkpoint-{AT}" / "ddpjob-manifest.json").is_file()
    clirun.ddpjob("resume", str(run), cwd=tmp_path, env=without_job_env(), timeout=180, check=True)
    jid2 = json.loads((run / "job.json").read_text())["job_id"]
    slurmtools.submitted.append(jid2)
    assert slurmtools.wait_done(jid2, 900) == "COMPLETED", rank_log(run, 0) + rank_log(run, 1)
    assert [int(s) for s in re.findall(r"^training from step ([0-9]+)$", rank_log(run, 0), re.M)] == [0, AT], \
        rank_log(run, 0)
    assert (run / "COMPLETED").is_file() and f"done at step {STEPS}" in rank_log(run, 0)
