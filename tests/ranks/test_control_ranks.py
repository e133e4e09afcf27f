"""`ddpjob status / logs / cancel / ls` on local runs (real supervisor, fake ranks), the parsing
of sacct/squeue output (fake binaries on PATH), on real SLURM jobs (test cluster), and on a run
that torchrun started (real ranks)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from clirun import ddpjob, wait_for
from fake_local import fake_command, local_state, make_run
from ranks import base_env

from ddpjob import fileio
from ddpjob.launch import runs
from ddpjob.launch.backends import local_procs
from ddpjob.ledger.events import read as read_events


_started: list[Path] = []


@pytest.fixture(autouse=True)
def _kill_leftovers():
    """A failed test must not leave a supervisor and its fake ranks behind."""
    yield
    while _started:
        run = _started.pop()
        pids = [(fileio.read_json(run / "job.json") or {}).get("pid")]
        pids += (fileio.read_json(run / "local.json") or {}).get("rank_pids", [])
        for pid in filter(None, pids):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def submit_fake(tmp_path: Path, mode: str, name: str = "run", **kw) -> Path:
    """A local run as `ddpjob submit` makes it, with fake ranks instead of `ddpjob run`."""
    run = make_run(tmp_path / "runs", mode, name=name, **kw)
    rec = local_procs.submit_local([run], run / "logs", ["ddpjob", "submit"],
                              rank_command=fake_command(tmp_path))[0]
    fileio.write_json_atomic(run / "job.json", rec)
    _started.append(run)
    return run


# ------------------------------------------------------------------ local runs
def test_status_ls_logs_cancel_on_a_local_run(tmp_path):
    run = submit_fake(tmp_path, "wait")
    wait_for(lambda: local_state(run).get("state") == "RUNNING", what="RUNNING")
    wait_for(lambda: "mode wait" in (run / "logs" / "rank-1.log").read_text(), what="rank 1 log")
    job_id = fileio.read_json(run / "job.json")["job_id"]

    out = ddpjob("status", str(run), cwd=tmp_path)
    assert out.returncode == 0 and "state       RUNNING" in out.stdout and job_id in out.stdout
    out = ddpjob("status", job_id, cwd=tmp_path)  # by job id, found under ./runs
    assert out.returncode == 0 and "run         runs/run\n" in out.stdout
    out = ddpjob("ls", cwd=tmp_path)
    row = next(ln.split() for ln in out.stdout.splitlines() if job_id in ln)
    assert row[1:4] == ["local", job_id, "RUNNING"]
    [line] = ddpjob("ls", "--json", cwd=tmp_path).stdout.splitlines()
    rec = json.loads(line)
    assert (rec["run_dir"], rec["backend"], rec["job_id"], rec["state"]) == ("runs/run", "local", job_id, "RUNNING")
    by_path = json.loads(ddpjob("status", str(run), "--json", cwd=tmp_path).stdout)
    assert by_path == {**rec, "run_dir": str(run)}  # the run dir as given
    out = ddpjob("logs", str(run), "--rank", "1", cwd=tmp_path)
    assert out.returncode == 0 and "fake rank 1 restart 0 mode wait" in out.stdout
    assert "fake rank 0" not in out.stdout

    out = ddpjob("cancel", str(run), cwd=tmp_path)
    assert out.returncode == 0 and f"cancelled {job_id}" in out.stdout
    wait_for(lambda: local_state(run).get("state") == "CANCELLED", what="CANCELLED")
    assert any(e["event"] == "cancel" and e["by"] == "user" for e in read_events(run))
    out = ddpjob("status", str(run), cwd=tmp_path)
    assert "state       CANCELLED" in out.stdout and "completed   no" in out.stdout
    out = ddpjob("cancel", str(run), cwd=tmp_path)  # twice: nothing left to cancel
    assert out.returncode == 1 and out.stderr.startswith("ddpjob: error: ")
    assert "already finished" in out.stderr


def test_cancel_of_a_local_sweep_cancels_the_running_point_and_the_pending_ones(tmp_path):
    sweep = tmp_path / "runs" / "sw"
    runs = [make_run(sweep, "wait", name=str(i)) for i in range(3)]
    fileio.write_json_atomic(sweep / "sweep.json", {"job_id": "x", "points": [
        {"id": str(i), "index": i, "values": {"train.lr": i}} for i in range(3)]})
    recs = local_procs.submit_local(runs, sweep / "logs", ["ddpjob", "submit"], rank_command=fake_command(tmp_path))
    for run, rec in zip(runs, recs):
        fileio.write_json_atomic(run / "job.json", rec)
        _started.append(run)
    wait_for(lambda: local_state(runs[0]).get("state") == "RUNNING", what="point 0 RUNNING")
    assert [local_state(r)["state"] for r in runs[1:]] == ["PENDING", "PENDING"]
    out = ddpjob("cancel", str(sweep), cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.count("cancelled ") == 3, out.stderr
    wait_for(lambda: all(local_state(r).get("state") == "CANCELLED" for r in runs), what="all CANCELLED")
    assert not (runs[1] / "fake-r0-s0.json").exists()  # the pending points never started
    out = ddpjob("ls", cwd=tmp_path)
    assert out.stdout.count("CANCELLED") == 3 and "train.lr=2" in out.stdout


def test_logs_follow_keeps_going_across_a_restart_until_the_end(tmp_path):
    run = submit_fake(tmp_path, "wait")
    pid = fileio.read_json(run / "job.json")["pid"]
    follower = subprocess.Popen([sys.executable, "-m", "ddpjob", "logs", str(run), "--follow"],
                                stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    # every rank's handler in place (each writes its file after): a rank still starting dies of
    # the signal, a crash (seen once on a loaded machine: max_failures = 0 ended the run)
    wait_for(lambda: all((run / f"fake-r{r}-s0.json").is_file() for r in (0, 1)), what="ranks to start")
    os.kill(pid, signal.SIGUSR2)  # ranks exit 3, the supervisor restarts them, they finish
    out, _ = follower.communicate(timeout=60)
    assert follower.returncode == 0
    assert "fake rank 0 restart 0 mode wait" in out and "fake rank 0 restart 1 mode wait" in out
    assert local_state(run)["state"] == "COMPLETED"


def test_a_dead_supervisor_is_reported_not_trusted(tmp_path):
    run = submit_fake(tmp_path, "wait")
    pid = fileio.read_json(run / "job.json")["pid"]
    wait_for(lambda: local_state(run).get("state") == "RUNNING", what="RUNNING")
    os.kill(pid, 9)  # no chance to write its final state
    os.waitpid(pid, 0)
    info = runs.run_info(run)
    assert info.state == "FAILED" and "supervisor died" in info.reason
    for rec in fileio.read_json(run / "local.json")["rank_pids"]:  # clean up the orphaned ranks
        try:
            os.kill(rec, 9)
        except ProcessLookupError:
            pass


def test_a_completed_run_is_not_submitted_again_with_another_length(tmp_path, capsys, monkeypatch):
    """`submit ... --run-dir R --set train.max_steps=60` on a COMPLETED run used to rewrite its
    config.json, and nothing trained; `sbatch` the same. Both refuse, and point at init_from."""
    from ddpjob.cli import main

    monkeypatch.chdir(tmp_path)
    job = str(Path(__file__).resolve().parents[2] / "jobs" / "smoke.toml")
    run = tmp_path / "done"
    out = subprocess.run([sys.executable, "-m", "ddpjob", "run", job, "--run-dir", str(run), "--set", "train.max_steps=2"],
                         capture_output=True, text=True, timeout=300, env=base_env())
    assert out.returncode == 0 and (run / "COMPLETED").is_file(), out.stderr[-2000:]
    before = (run / "config.json").read_text()
    capsys.readouterr()
    for argv in (["submit", job, "--backend", "local", "--run-dir", str(run)],
                 ["sbatch", job, "--run-dir", str(run), "-o", str(tmp_path / "x.sbatch")]):
        assert main([*argv, "--set", "train.max_steps=60"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"ddpjob: error: run directory '{run}' completed at step 2"), err
        assert "checkpoint.init_from" in err[0]
    assert (run / "config.json").read_text() == before and not (tmp_path / "x.sbatch").exists()


def test_a_torchrun_run_with_a_killed_rank_is_shown_completed_with_its_two_attempts(tmp_path):
    """`torchrun --nproc-per-node 2 --max-restarts 1 -m ddpjob run JOB.toml` as a user types it, rank
    1 SIGKILLed in its 12th training forward call of the first round (trainer_plugins "kill": at
    the step, not a timer): the agent starts a second round, which resumes from the checkpoint at
    step 10 and finishes. ls, status (text and --json) and logs show it as ddpjob knows it."""
    from ranks import write_job

    job = write_job(tmp_path / "job.toml", slurm={"nodes": 1, "tasks_per_node": 2},
                    train={"model": "trainer_plugins:signalling_cnn", "batch_size": 16, "max_steps": 30,
                           "log_every": 1, "eval_every": 0, "threads": 1, "amp": "off", "channels_last": False},
                    data={"dataset": "synthetic", "synthetic_train": 512, "synthetic_test": 64},
                    checkpoint={"every_steps": 5})
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts",
                          "1", "-m", "ddpjob", "run", str(job)], cwd=tmp_path,
                         env=base_env({"DDPJOB_TEST_SIGNAL": "1:12:0:kill"}), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (run,) = (tmp_path / "runs").iterdir()
    # named after torchrun's run id, the uuid it makes up for a one-node run (docs/api.md)
    uuid = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
    assert re.fullmatch(f"t-torchrun-{uuid}", run.name), run.name
    job_id = run.name.removeprefix("t-")
    starts = [e for e in read_events(run) if e["event"] == "start"]
    assert [(s["job_id"], s["resumed_step"]) for s in starts] == [(job_id, None), (job_id, 10)], starts

    row = next(line.split() for line in ddpjob("ls", cwd=tmp_path).stdout.splitlines() if line.startswith("runs/"))
    assert row == [f"runs/{run.name}", "torchrun", job_id, "COMPLETED", "30", "1"], row
    status = ddpjob("status", str(run), cwd=tmp_path).stdout
    for line in (f"job         {job_id} (torchrun)", "state       COMPLETED", "restarts    1 (attempts 0-1)",
                 "restarts    1: resumed at step 10 after crash", "completed   yes"):
        assert line in status.splitlines(), status
    (rec,) = [json.loads(line) for line in ddpjob("status", "--json", str(run), cwd=tmp_path).stdout.splitlines()]
    assert (rec["backend"], rec["state"], rec["restarts"], rec["job_ids"]) == ("torchrun", "COMPLETED", 1, [job_id])
    assert len(rec["goodput"]["attempts"]) == 2, rec["goodput"]

    # torchrun printed the ranks' output on its own stdout; each rank also wrote it to its log
    for rank in (0, 1):
        logs = ddpjob("logs", str(run), "--rank", str(rank), cwd=tmp_path).stdout.splitlines()
        marks = [line for line in logs if line.startswith("==> ")]
        assert marks == [f"==> attempt 0 (job {job_id}, first start) <==",
                         f"==> attempt 1 (job {job_id}, restarted by torchrun after crash at step 10) <=="], logs
    logs = ddpjob("logs", str(run), cwd=tmp_path).stdout
    assert "resumed from step-000000010" in logs and "finished: step 30" in logs, logs
    plot = ddpjob("plot", str(run), "-o", str(tmp_path / "curves.png"), cwd=tmp_path).stdout
    assert "1 restart marker(s)" in plot and f"{run.name}: step 10  restart 1: crash" in plot, plot
