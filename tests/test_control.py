"""`ddpjob status / logs / cancel / ls` on local runs (real supervisor, fake ranks), the parsing
of sacct/squeue output (fake binaries on PATH), and on real SLURM jobs (test cluster)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import fake_checkpoint
import pytest
from ranks import LAG, base_env
from test_local_backend import fake_command, local_state, make_run, wait_for

from ddpjob import config, rundir
from ddpjob.errors import DDPJobError, UsageError
from ddpjob.launch import control, runs
from ddpjob.launch.backends import local_procs, slurmjobs

ROOT = Path(__file__).resolve().parents[1]


def ddpjob(*argv: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddpjob", *argv], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


_started: list[Path] = []


@pytest.fixture(autouse=True)
def _kill_leftovers():
    """A failed test must not leave a supervisor and its fake ranks behind."""
    yield
    while _started:
        run = _started.pop()
        pids = [(rundir.read_json(run / "job.json") or {}).get("pid")]
        pids += (rundir.read_json(run / "local.json") or {}).get("rank_pids", [])
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
    rundir.write_json_atomic(run / "job.json", rec)
    _started.append(run)
    return run


# ------------------------------------------------------------------ pure parts
def test_format_status_is_a_compact_summary(tmp_path):
    info = runs.RunInfo(run_dir=Path("runs/smoke-1"), backend="slurm", job_id="123", state="RUNNING",
                           restarts=2, step=150, loss=1.23456, checkpoint="step-000000100")
    assert control.format_status(info).splitlines() == [
        "run         runs/smoke-1", "job         123 (slurm)", "state       RUNNING", "restarts    2",
        "last step   150  loss 1.2346", "checkpoint  step-000000100", "completed   no"]


def test_last_checkpoint_is_the_newest_valid_one_and_last_metric_skips_torn_lines(tmp_path):
    # what a resume would pick: step 20's save never finished, step 16 is truncated on disk
    fake_checkpoint.committed(tmp_path, 5)
    fake_checkpoint.committed(tmp_path, 12)
    fake_checkpoint.committed(tmp_path, 16, damaged=True)
    (fake_checkpoint.committed(tmp_path, 20) / "manifest.json").unlink()
    assert runs.last_checkpoint(tmp_path) == "step-000000012"
    assert runs.last_checkpoint(tmp_path / "nothing-here") == ""
    (tmp_path / "metrics.jsonl").write_text('{"step": 10, "loss": 2.5}\n{"step": 20, "eval_acc": 0.1}\n'
                                            '{"step": 30, "loss": 1.5}\n{"step": 40, "lo')
    assert runs.last_metric(tmp_path) == (30, 1.5)


def test_array_ids_expand():
    assert slurmjobs.expand_array_id("77_[0-2,5%2]") == ["77_0", "77_1", "77_2", "77_5"]
    assert slurmjobs.expand_array_id("77_3") == ["77_3"] and slurmjobs.expand_array_id("78") == ["78"]


def test_slurm_states_counts_requeues_and_prefers_squeue(tmp_path, monkeypatch):
    """sacct -D lists each incarnation of a requeued job; squeue knows the live state first."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text("#!/bin/sh\necho \"$@\" > %s/sacct.args\ncat <<'EOF'\n"
                                   "100|REQUEUED|0:0|n[1-2]\n100|PREEMPTED|0:0|n[1-2]\n100|RUNNING|0:0|n[1-2]\n"
                                   "200_0|COMPLETED|0:0|n1\n200_1|CANCELLED by 0|0:15|n2\nEOF\n" % tmp_path)
    (bin_dir / "squeue").write_text("#!/bin/sh\necho '200_[2-3]|PENDING|Priority'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    states = slurmjobs.slurm_states(["100", "200_0", "200_1", "200_2"])
    assert states["100"]["state"] == "RUNNING" and states["100"]["restarts"] == 2
    assert states["200_0"]["state"] == "COMPLETED" and states["200_1"]["state"] == "CANCELLED"
    assert states["200_2"]["state"] == "PENDING" and states["200_3"]["reason"] == "Priority"
    assert "-j 100,200" in (tmp_path / "sacct.args").read_text()  # one call for all jobs


def test_a_run_without_job_json_is_found_through_the_job_id_its_ranks_recorded(tmp_path, monkeypatch):
    """`ddpjob sbatch` + `sbatch` writes no job.json: the runner's events carry the job id."""
    run = make_run(tmp_path, "ok")
    assert runs.run_info(run).state == "UNKNOWN"
    rundir.record_event(run, "start", job_id="4242", restart=0)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text("#!/bin/sh\necho '4242|RUNNING|0:0|n1'\n")
    (bin_dir / "squeue").write_text("#!/bin/sh\nexit 1\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    info = runs.run_info(run)
    assert (info.backend, info.job_id, info.state) == ("slurm", "4242", "RUNNING")
    assert runs.resolve("4242", tmp_path) == (run, False)


# ------------------------------------------------------------------ local runs
def test_status_ls_logs_cancel_on_a_local_run(tmp_path):
    run = submit_fake(tmp_path, "wait")
    wait_for(lambda: local_state(run).get("state") == "RUNNING", what="RUNNING")
    wait_for(lambda: "mode wait" in (run / "logs" / "rank-1.log").read_text(), what="rank 1 log")
    job_id = rundir.read_json(run / "job.json")["job_id"]

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
    assert any(e["event"] == "cancel" and e["by"] == "user" for e in rundir.events(run))
    out = ddpjob("status", str(run), cwd=tmp_path)
    assert "state       CANCELLED" in out.stdout and "completed   no" in out.stdout
    out = ddpjob("cancel", str(run), cwd=tmp_path)  # twice: nothing left to cancel
    assert out.returncode == 1 and out.stderr.startswith("ddpjob: error: ")
    assert "already finished" in out.stderr


def test_cancel_of_a_local_sweep_cancels_the_running_point_and_the_pending_ones(tmp_path):
    sweep = tmp_path / "runs" / "sw"
    runs = [make_run(sweep, "wait", name=str(i)) for i in range(3)]
    rundir.write_json_atomic(sweep / "sweep.json", {"job_id": "x", "points": [
        {"id": str(i), "index": i, "values": {"train.lr": i}} for i in range(3)]})
    recs = local_procs.submit_local(runs, sweep / "logs", ["ddpjob", "submit"], rank_command=fake_command(tmp_path))
    for run, rec in zip(runs, recs):
        rundir.write_json_atomic(run / "job.json", rec)
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
    pid = rundir.read_json(run / "job.json")["pid"]
    follower = subprocess.Popen([sys.executable, "-m", "ddpjob", "logs", str(run), "--follow"],
                                stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    wait_for(lambda: (run / "fake-r1-s0.json").is_file(), what="ranks to start")
    os.kill(pid, signal.SIGUSR2)  # ranks exit 3, the supervisor restarts them, they finish
    out, _ = follower.communicate(timeout=60)
    assert follower.returncode == 0
    assert "fake rank 0 restart 0 mode wait" in out and "fake rank 0 restart 1 mode wait" in out
    assert local_state(run)["state"] == "COMPLETED"


def test_a_dead_supervisor_is_reported_not_trusted(tmp_path):
    run = submit_fake(tmp_path, "wait")
    pid = rundir.read_json(run / "job.json")["pid"]
    wait_for(lambda: local_state(run).get("state") == "RUNNING", what="RUNNING")
    os.kill(pid, 9)  # no chance to write its final state
    os.waitpid(pid, 0)
    info = runs.run_info(run)
    assert info.state == "FAILED" and "supervisor died" in info.reason
    for rec in rundir.read_json(run / "local.json")["rank_pids"]:  # clean up the orphaned ranks
        try:
            os.kill(rec, 9)
        except ProcessLookupError:
            pass


def test_unknown_run_and_bad_rank_are_one_line_errors(tmp_path):
    out = ddpjob("status", "nope", cwd=tmp_path)
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert "neither a run directory nor a job id" in out.stderr and "Hint: `ddpjob ls`" in out.stderr
    run = make_run(tmp_path, "ok")
    out = ddpjob("logs", str(run), "--rank", "2", cwd=tmp_path)
    assert out.returncode == 2 and "rank 2 does not exist" in out.stderr and "between 0 and 1" in out.stderr
    out = ddpjob("logs", str(run), cwd=tmp_path)
    assert out.returncode == 1 and "no log for rank 0" in out.stderr
    out = ddpjob("ls", cwd=tmp_path)
    assert out.returncode == 0 and "no runs under runs/" in out.stdout


# ------------------------------------------------------------------ real SLURM jobs
@pytest.mark.cluster
def test_status_logs_cancel_ls_on_a_real_slurm_job(slurm_cluster, tmp_path):
    import slurmtools
    from slurmtools import wait_done, wait_state

    run = tmp_path / "runs" / "long"
    out = ddpjob("submit", str(ROOT / "jobs" / "smoke.toml"), "--backend", "slurm", "--run-dir", str(run),
                 "--set", "train.max_steps=100000", "--set", "train.eval_every=0",
                 cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    job_id = rundir.read_json(run / "job.json")["job_id"]
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
    assert any(e["event"] == "cancel" for e in rundir.events(run))


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
    job_id = rundir.read_json(run / "job.json")["job_id"]
    slurmtools.submitted.append(job_id)
    slurmtools.wait_state(job_id, ("RUNNING",), timeout=120)
    wait_for(lambda: (runs.last_metric(run)[0] or 0) >= 10, timeout=120, what="step 10")
    high = slurmtools.submit("#!/bin/bash\n#SBATCH -p high -N 2 --ntasks-per-node=2 -t 2 -J pre-high\n"
                             "srun sleep 3\n", cwd=tmp_path)
    assert slurmtools.wait_done(high, timeout=180) == "COMPLETED"
    if slurmtools.wait_state(job_id, ("PENDING", "RUNNING", "COMPLETED"), timeout=60) == "PENDING":
        slurmtools.release_now(job_id)  # skip the ~11 s hold of a requeued job
    assert slurmtools.wait_done(job_id, timeout=400) == "COMPLETED"
    stops = [e for e in rundir.events(run) if e["event"] == "stop"]
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
    assert out.returncode == 0 and out.stdout == (run / "logs" / "rank-1.log").read_text()


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
    [stop] = [e for e in rundir.events(run) if e.get("event") == "stop" and "rank" not in e]
    assert (stop["reason"], stop["step"], stop["requeued"]) == ("signal", 6 + LAG, None), stop
    env.pop("DDPJOB_TEST_SIGNAL")  # sbatch passes resume's environment on to the job
    out = subprocess.run([sys.executable, "-m", "ddpjob", "resume", str(run), "--set", "train.max_steps=12"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    job = rundir.read_json(run / "job.json")
    assert job["via"] == "sbatch" and job["job_ids"] == [first, job["job_id"]]
    slurmtools.submitted.append(job["job_id"])
    assert slurmtools.wait_done(job["job_id"], timeout=300) == "COMPLETED"
    starts = [e for e in rundir.events(run) if e.get("event") == "start"]
    assert [(s["job_id"], s.get("resumed_step")) for s in starts] == [(first, None), (job["job_id"], 6 + LAG)]
    assert rundir.completed(run)["step"] == 12
    assert "#SBATCH" in (run / "job.sbatch").read_text() and config.read_run_config(run).train.max_steps == 12


def test_the_json_record_of_a_run(tmp_path):
    # what `status --json` says of a run requeued once after a node failure, with a NaN loss
    import fake_checkpoint
    from ddpjob.launch import report

    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    rundir.write_json_atomic(run / "config.json", {})
    rundir.write_json_atomic(run / "job.json", {"backend": "slurm", "job_id": "78", "job_ids": ["77", "78"]})
    for rec in ({"event": "start", "job_id": "77", "restart": 0},
                {"event": "stop", "reason": "node_failure", "step": 10, "job_id": "77", "restart": 0,
                 "steps_lost": 3, "requeued": True, "requeued_by": "slurm", "time": 5.0, "note": "n"},
                {"event": "stop", "reason": "crash", "rank": 1, "job_id": "77"},  # a rank's: not the ledger
                {"event": "start", "job_id": "78", "restart": 1, "resumed_step": 10}):
        rundir.append_jsonl(run / "events.jsonl", rec)
    for rec in ({"kind": "train", "step": 12, "loss": 0.5}, {"kind": "eval", "step": 12, "eval_acc": 0.75},
                {"kind": "eval", "step": 14, "eval_acc": 0.5}, {"kind": "train", "step": 14, "loss": math.nan}):
        rundir.append_jsonl(run / "metrics.jsonl", rec)
    fake_checkpoint.committed(run, 10)
    fake_checkpoint.committed(run, 14, damaged=True)
    info = runs.RunInfo(run_dir=run, backend="slurm", job_id="78", state="RUNNING", restarts=1,
                           step=14, loss=math.nan, checkpoint=runs.last_checkpoint(run))
    rec = json.loads(report.dumps(report.record(info)))  # strict JSON: NaN would not parse back
    assert rec == {
        "schema": "ddpjob.run/1", "run_dir": str(run), "point": None, "backend": "slurm",
        "job_id": "78", "job_ids": ["77", "78"], "state": "RUNNING", "reason": None, "completed": False,
        "restarts": 1,
        "stops": [{"reason": "node_failure", "step": 10, "job_id": "77", "restart": 0, "steps_lost": 3,
                   "requeued": True, "requeued_by": "slurm", "next_job_id": None, "time": 5.0, "note": "n",
                   "phases": {}}],  # no phase has both of its ends recorded here
        "step": 14, "loss": None,
        "checkpoint": {"step": 10, "path": str(run / "checkpoints" / "step-000000010")},
        "best_accuracy": {"value": 0.75, "step": 12}, "final_accuracy": None, "code": None}
    # a damaged run dir is still one line, and no runs are no lines
    (tmp_path / "runs" / "bad").mkdir()
    (tmp_path / "runs" / "bad" / "config.json").write_text("{}")
    (tmp_path / "runs" / "bad" / "job.json").write_text("[1, 2]")
    lines = ddpjob("ls", "--json", cwd=tmp_path).stdout.splitlines()
    assert [json.loads(ln)["run_dir"] for ln in lines] == ["runs/bad", "runs/r"]
    empty = ddpjob("status", "--json", "--runs-root", str(tmp_path / "none"), cwd=tmp_path)
    assert empty.returncode == 0 and empty.stdout == ""


def test_cancel_of_an_empty_name_or_of_a_run_never_submitted_cancels_nothing(tmp_path, capsys, monkeypatch):
    """`ddpjob cancel ''` used to match every run without a job id, and a cancel of a run never
    submitted said "cancelled" and recorded a cancel event that later blocked its requeue."""
    from ddpjob.cli import main

    monkeypatch.chdir(tmp_path)
    never = tmp_path / "runs" / "never"
    assert main(["sbatch", str(Path(__file__).resolve().parents[1] / "jobs" / "smoke.toml"),
                 "--run-dir", str(never), "-o", str(tmp_path / "x.sbatch")]) == 0
    capsys.readouterr()
    assert main(["cancel", ""]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "ddpjob: error: run directory is empty, expected a path. Hint: give a non-empty run directory."]
    with pytest.raises(UsageError, match="the run is ''"):  # the same without the CLI's check
        runs.resolve("")
    assert main(["cancel", str(never)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ddpjob: error: '{never}' has no job id"), err
    assert rundir.events(never) == []  # nothing recorded that could block a later requeue


def test_a_completed_run_is_not_submitted_again_with_another_length(tmp_path, capsys, monkeypatch):
    """`submit ... --run-dir R --set train.max_steps=60` on a COMPLETED run used to rewrite its
    config.json, and nothing trained; `sbatch` the same. Both refuse, and point at init_from."""
    from ddpjob.cli import main

    monkeypatch.chdir(tmp_path)
    job = str(Path(__file__).resolve().parents[1] / "jobs" / "smoke.toml")
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


def test_resume_waits_a_bounded_time_for_a_job_that_is_completing(tmp_path, fake_slurm, monkeypatch, capsys):
    """`ddpjob resume` right after scancel found the job COMPLETING and refused; now it waits for
    the end (bounded), and refuses with one line only if the job is still there after it."""
    run = tmp_path / "run"
    run.mkdir()
    rundir.write_json_atomic(run / "job.json", {"backend": "slurm", "job_id": "77"})
    monkeypatch.setattr(runs, "sleep", lambda s: None)
    fake_slurm.answer("sacct", "77|CANCELLED by 0|0:15|n1\n")
    fake_slurm.answer("squeue", "77|COMPLETING|None\n", then=[{"stdout": "77|COMPLETING|None\n"}, {"stdout": ""}])
    runs.check_idle(run)  # ended after two polls: nothing to refuse
    assert "job 77 is COMPLETING; waiting up to 60 s" in capsys.readouterr().out
    assert len(fake_slurm.called("squeue")) == 3
    clock = iter(range(0, 1000, 30))
    monkeypatch.setattr(runs.time, "monotonic", lambda: float(next(clock)))
    fake_slurm.answer("squeue", "77|COMPLETING|None\n")  # stuck, past the bound
    with pytest.raises(DDPJobError, match="has job 77 still COMPLETING"):
        runs.check_idle(run)
