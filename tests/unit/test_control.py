"""`ddpjob status / logs / cancel / ls` on local runs (real supervisor, fake ranks), the parsing
of sacct/squeue output (fake binaries on PATH), and on real SLURM jobs (test cluster)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import fake_checkpoint
import pytest
from clirun import ddpjob
from fake_local import make_run

from ddpjob import fileio
from ddpjob.errors import DDPJobError, UsageError
from ddpjob.launch import control, runs
from ddpjob.launch.backends import slurmjobs
from ddpjob.ledger.events import read as read_events, record as record_event


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
    record_event(run, "start", job_id="4242", restart=0)
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


def test_the_json_record_of_a_run(tmp_path):
    # what `status --json` says of a run requeued once after a node failure, with a NaN loss
    import fake_checkpoint
    from ddpjob.launch import report

    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    fileio.write_json_atomic(run / "config.json", {})
    fileio.write_json_atomic(run / "job.json", {"backend": "slurm", "job_id": "78", "job_ids": ["77", "78"]})
    for rec in ({"event": "start", "job_id": "77", "restart": 0},
                {"event": "stop", "reason": "node_failure", "step": 10, "job_id": "77", "restart": 0,
                 "steps_lost": 3, "requeued": True, "requeued_by": "slurm", "time": 5.0, "note": "n"},
                {"event": "stop", "reason": "crash", "rank": 1, "job_id": "77"},  # a rank's: not the ledger
                {"event": "start", "job_id": "78", "restart": 1, "resumed_step": 10}):
        fileio.append_jsonl(run / "events.jsonl", rec)
    for rec in ({"kind": "train", "step": 12, "loss": 0.5}, {"kind": "eval", "step": 12, "eval_acc": 0.75},
                {"kind": "eval", "step": 14, "eval_acc": 0.5}, {"kind": "train", "step": 14, "loss": math.nan}):
        fileio.append_jsonl(run / "metrics.jsonl", rec)
    fake_checkpoint.committed(run, 10)
    fake_checkpoint.committed(run, 14, damaged=True)
    info = runs.RunInfo(run_dir=run, backend="slurm", job_id="78", state="RUNNING", restarts=1, attempts=[0, 1],
                           step=14, loss=math.nan, checkpoint=runs.last_checkpoint(run))
    rec = json.loads(report.dumps(report.record(info)))  # strict JSON: NaN would not parse back
    assert rec == {
        "schema": "ddpjob.run/1", "run_dir": str(run), "point": None, "backend": "slurm",
        "job_id": "78", "job_ids": ["77", "78"], "state": "RUNNING", "reason": None, "completed": False,
        "restarts": 1, "attempts": [0, 1],
        "stops": [{"reason": "node_failure", "step": 10, "job_id": "77", "restart": 0, "steps_lost": 3,
                   "requeued": True, "requeued_by": "slurm", "next_job_id": None, "time": 5.0, "note": "n",
                   "phases": {}}],  # no phase has both of its ends recorded here
        "step": 14, "loss": None,
        "checkpoint": {"step": 10, "path": str(run / "checkpoints" / "step-000000010")},
        "best_accuracy": {"value": 0.75, "step": 12}, "final_accuracy": None, "code": None,
        "goodput": None,  # its starts recorded no times: no ledger (tests/unit/test_goodput.py)
        "stragglers": [], "slowdowns": [], "baseline_step_ms": None}
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
    assert main(["sbatch", str(Path(__file__).resolve().parents[2] / "jobs" / "smoke.toml"),
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
    assert read_events(never) == []  # nothing recorded that could block a later requeue


def test_resume_waits_a_bounded_time_for_a_job_that_is_completing(tmp_path, fake_slurm, monkeypatch, capsys):
    """`ddpjob resume` right after scancel found the job COMPLETING and refused; now it waits for
    the end (bounded), and refuses with one line only if the job is still there after it."""
    run = tmp_path / "run"
    run.mkdir()
    fileio.write_json_atomic(run / "job.json", {"backend": "slurm", "job_id": "77"})
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


# ------------------------------------------------------------------ lines that must be true
def _run_with(tmp_path: Path, events: list[dict], metrics: list[dict] = (), job: dict | None = None) -> Path:
    run = tmp_path / "runs" / "r"
    (run / "logs").mkdir(parents=True)
    fileio.write_json_atomic(run / "config.json", {})
    fileio.write_json_atomic(run / "job.json", job or {"backend": "local", "job_id": "local-1", "pid": 0})
    for rec in events:
        fileio.append_jsonl(run / "events.jsonl", rec)
    for rec in metrics:
        fileio.append_jsonl(run / "metrics.jsonl", rec)
    return run


# a local run: a time limit the supervisor requeued, a crash it restarted in place, `ddpjob stop`,
# then `ddpjob resume` (a new job) to the end
LOCAL_HISTORY = [
    {"event": "local_start", "job_id": "local-1", "restart": 0, "time": 9.0},
    {"event": "start", "job_id": "local-1", "restart": 0, "time": 10.0, "resumed_step": None},
    {"event": "stop", "reason": "time_limit", "step": 7, "job_id": "local-1", "restart": 0, "requeued": True,
     "requeued_by": "supervisor", "action": "requeue", "time": 20.0},
    {"event": "start", "job_id": "local-1", "restart": 1, "time": 25.0, "resumed_step": 7},
    {"event": "stop", "reason": "crash", "rank": 1, "job_id": "local-1", "restart": 1, "error": "boom"},
    {"event": "stop", "reason": "crash", "step": 10, "job_id": "local-1", "restart": 1, "requeued": True,
     "requeued_by": "supervisor", "source": "local-supervisor", "time": 30.0},
    {"event": "start", "job_id": "local-1", "restart": 2, "time": 35.0, "resumed_step": 10},
    {"event": "stop", "reason": "user_stop", "step": 12, "job_id": "local-1", "restart": 2, "requeued": None,
     "time": 40.0},
    # `ddpjob resume`: a new job, and the run's attempts go on numbering (ledger/attempts.py)
    {"event": "start", "job_id": "local-2", "restart": 3, "time": 50.0, "resumed_step": 12},
    {"event": "stop", "reason": "finished", "step": 20, "job_id": "local-2", "restart": 3, "time": 60.0}]


def test_the_ledger_says_who_brought_a_local_run_back(tmp_path):
    """Not "not requeued" where the local supervisor requeued the run (rank 0's stop decision,
    requeued_by "supervisor") or restarted the ranks in place after a crash (its own decision)."""
    from ddpjob.launch import summary

    lines = [line for line, _ in summary.ledger(LOCAL_HISTORY)]
    assert lines == [
        "time_limit at step 7 (job local-1), steps lost ?, requeued by the local supervisor, resumed step 7 after 5 s",
        "crash at step 10 (job local-1), steps lost ?, restarted in place by the local supervisor, "
        "resumed step 10 after 5 s",
        "user_stop at step 12 (job local-1), steps lost ?, not requeued, resumed step 12 after 10 s"]


def test_logs_mark_each_attempt_in_the_appended_rank_log(tmp_path, capsys):
    """Each rank writes console.attempt_line at each start; `ddpjob logs` shows a mark there, numbered
    by the run's starts and saying how the attempt came about. A line that no start record
    matches (say, a start refused before rank 0 recorded it) stays as the rank wrote it."""
    from ddpjob import console
    from ddpjob.cli import main

    run = _run_with(tmp_path, LOCAL_HISTORY, job={"backend": "local", "job_id": "local-2", "pid": 0,
                                                  "job_ids": ["local-1", "local-2"]})
    text = "".join(f"{console.attempt_line(r, 0, 'vm', j)}\nstep of attempt {n}\n" for n, (j, r) in enumerate(
        [("local-1", 0), ("local-1", 1), ("local-1", 2), ("local-1", 9), ("local-2", 3)]))
    (run / "logs" / "rank-0.log").write_text(text)
    assert main(["logs", str(run)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "==> attempt 0 (job local-1, first start) <==", "step of attempt 0",
        "==> attempt 1 (job local-1, requeued by the local supervisor after time_limit at step 7) <==",
        "step of attempt 1",
        "==> attempt 2 (job local-1, restarted in place by the local supervisor after crash at step 10) <==",
        "step of attempt 2",
        "ddpjob: attempt 9 starts: rank 0 on vm, job local-1", "step of attempt 3",
        "==> attempt 3 (job local-2, resumed after user_stop at step 12) <==", "step of attempt 4"]


def test_metrics_a_run_does_not_have_are_not_shown(tmp_path):
    """A loop that evaluates a loss but no accuracy: no "best acc nan" line, null in --json."""
    from ddpjob.launch import report, summary

    run = _run_with(tmp_path, LOCAL_HISTORY[:2], [{"kind": "train", "step": 5, "loss": 0.5, "time": 11.0},
                                                  {"kind": "eval", "step": 5, "eval_loss": 0.7, "time": 12.0}])
    lines = summary.summary(run)
    assert not [line for line in lines if line.startswith("best acc")], lines
    assert "progress    step 5, loss 0.5000" in lines, lines
    info = runs.run_info(run)
    assert report.record(info)["best_accuracy"] is None


def test_a_stopped_run_finished_by_ddpjob_run_is_completed(tmp_path):
    """`ddpjob stop` (local.json STOPPED), then `ddpjob run RUN_DIR` alone finished it: COMPLETED, not
    STOPPED beside "completed yes"."""
    run = _run_with(tmp_path, [
        *LOCAL_HISTORY[:2],
        {"event": "stop", "reason": "user_stop", "step": 7, "job_id": "local-1", "restart": 0, "time": 20.0},
        {"event": "start", "job_id": None, "restart": 0, "time": 30.0, "resumed_step": 7},
        {"event": "stop", "reason": "finished", "step": 20, "job_id": None, "restart": 0, "time": 40.0}])
    fileio.write_json_atomic(run / "local.json", {"state": "STOPPED", "reason": "stopped by `ddpjob stop`"})
    fileio.write_json_atomic(run / "COMPLETED", {"step": 20, "accuracy": None})
    info = runs.run_info(run)
    assert (info.state, info.reason, info.completed) == (
        "COMPLETED", "at step 20, after job local-1 ended STOPPED", True)
    text = control.format_status(info)
    assert "state       COMPLETED (at step 20, after job local-1 ended STOPPED)" in text and "STOPPED (" not in text


def test_a_torchrun_run_s_state_comes_from_its_records_and_its_agent(tmp_path):
    """No scheduler knows a torchrun run: RUNNING while the agent recorded in job.json lives (its
    command line names torchrun: a reused pid does not count), else how the records end."""
    import socket
    import subprocess
    import sys

    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "torchrun"])
    try:
        job = {"backend": "torchrun", "job_id": "torchrun-x", "pid": agent.pid, "host": socket.gethostname()}
        started = [{"event": "start", "job_id": "torchrun-x", "restart": 0, "time": 1.0}]
        run = _run_with(tmp_path, started, job=job)
        assert (runs.run_info(run).state, runs.run_info(run).backend) == ("RUNNING", "torchrun")
        # `ddpjob stop` cannot reach torchrun's ranks: one line, and no request left behind
        out = ddpjob("stop", str(run), cwd=tmp_path)
        assert out.returncode == 1 and out.stderr.startswith(
            f"ddpjob: error: '{run}' runs under torchrun, which `ddpjob stop` cannot stop"), out.stderr
        assert [e["event"] for e in read_events(run)] == ["start"]
    finally:
        agent.kill()
        agent.wait()
    info = runs.run_info(run)
    assert (info.state, info.reason) == ("FAILED", "torchrun ended without a stop recorded (killed?); see its output")
    fileio.append_jsonl(run / "events.jsonl", {"event": "stop", "reason": "time_limit", "step": 8,
                                               "job_id": "torchrun-x", "restart": 0})
    assert (runs.run_info(run).state, runs.run_info(run).reason) == ("STOPPED", "time_limit at step 8, checkpoint written")
    fileio.write_json_atomic(run / "job.json", {**job, "host": "elsewhere"})
    fileio.append_jsonl(run / "events.jsonl", {"event": "start", "job_id": "torchrun-x", "restart": 1, "time": 2.0})
    info = runs.run_info(run)
    assert (info.state, info.reason, info.restarts) == (
        "UNKNOWN", "torchrun runs on elsewhere: `ddpjob status` there tells", 1)
    # ddpjob cannot start torchrun's agent again: `resume` says so, and writes nothing
    before = sorted(p.name for p in run.iterdir())
    out = ddpjob("resume", str(run), cwd=tmp_path)
    assert out.returncode == 1 and out.stderr.startswith(f"ddpjob: error: '{run}' was started by torchrun"), out.stderr
    assert "Hint: run it under torchrun again: `torchrun ... -m ddpjob run RUN_DIR`" in out.stderr
    assert sorted(p.name for p in run.iterdir()) == before


def test_a_host_is_excluded_only_by_the_next_restart_of_a_live_slurm_job(tmp_path):
    """Two host faults on n2: `status` says "excluded" while the SLURM job runs (its next restart
    inside the allocation leaves n2 out), not once it has ended, and never on the local backend
    (its restarts run on this machine whatever it did)."""
    crash = {"event": "stop", "reason": "crash", "step": 10, "job_id": "77", "restart": 0, "failed_rank": 2,
             "failed_host": "n2", "failed_how": "Killed", "host_fault": True, "requeued": True,
             "requeued_by": "in_allocation"}
    run = _run_with(tmp_path, [{"event": "start", "job_id": "77", "restart": 0}, crash,
                               {"event": "start", "job_id": "77", "restart": 1}, {**crash, "restart": 1}],
                    job={"backend": "slurm", "job_id": "77"})

    def hosts(state: str) -> str:
        info = runs.RunInfo(run_dir=run, backend="slurm", job_id="77", state=state)
        return next(ln for ln in control.format_status(info).splitlines() if ln.startswith("hosts"))

    assert hosts("RUNNING") == "hosts       n2 2 failures (excluded from job 77)"
    assert hosts("COMPLETED") == hosts("FAILED") == "hosts       n2 2 failures"
    fileio.write_json_atomic(run / "job.json", {"backend": "local", "job_id": "77", "pid": 0})
    assert hosts("RUNNING") == "hosts       n2 2 failures"


def test_the_marks_of_a_slurm_run_say_who_brought_it_back():
    history = [
        {"event": "start", "job_id": "77", "restart": 0},
        {"event": "stop", "reason": "preemption", "step": 9, "job_id": "77", "restart": 0, "requeued": True,
         "requeued_by": "scontrol"},
        {"event": "start", "job_id": "77", "restart": 1},
        {"event": "stop", "reason": "crash", "step": 20, "job_id": "77", "restart": 1, "requeued": True,
         "requeued_by": "in_allocation"},
        {"event": "start", "job_id": "77", "restart": 2},
        {"event": "stop", "reason": "time_limit", "step": 30, "job_id": "77", "restart": 2, "requeued": True,
         "requeued_by": "successor", "next_job_id": "78"},
        {"event": "start", "job_id": "78", "restart": 3},
        {"event": "start", "job_id": "78", "restart": 4}]
    assert [mark for _, mark in control.attempt_marks(history)] == [
        "==> attempt 0 (job 77, first start) <==",
        "==> attempt 1 (job 77, requeued after preemption at step 9) <==",
        "==> attempt 2 (job 77, restarted inside the allocation after crash at step 20) <==",
        "==> attempt 3 (job 78, a successor job after time_limit at step 30) <==",
        "==> attempt 4 (job 78, no stop recorded before it: killed?) <=="]


def test_a_local_run_that_ends_between_the_two_reads_is_its_end_not_a_dead_supervisor(tmp_path, monkeypatch):
    """The supervisor writes COMPLETED into local.json, then exits. A reader that took the record
    before the end and the pid after it called the run FAILED ("the supervisor died") and
    `submit --wait` ended 1 on a completed run. Here the end lands while the pid is asked."""
    from ddpjob.launch.backends import local_procs

    run = tmp_path / "run"
    run.mkdir()
    fileio.write_json_atomic(run / local_procs.LOCAL, {"state": "RUNNING", "restarts": 0})

    def ends_now(pid, marker=local_procs.SUPERVISOR):
        fileio.write_json_atomic(run / local_procs.LOCAL, {"state": "COMPLETED", "reason": "all ranks exited 0",
                                                           "restarts": 0})
        return False  # and it is gone

    monkeypatch.setattr(local_procs, "pid_alive", ends_now)
    got = local_procs.LocalBackend().state(run, {"pid": 4242}, None)
    assert (got.state, got.reason) == ("COMPLETED", "all ranks exited 0"), got
    # a supervisor that died without its end written is still named
    fileio.write_json_atomic(run / local_procs.LOCAL, {"state": "RUNNING", "restarts": 0})
    monkeypatch.setattr(local_procs, "pid_alive", lambda pid, marker=local_procs.SUPERVISOR: False)
    got = local_procs.LocalBackend().state(run, {"pid": 4242}, None)
    assert got.state == "FAILED" and "supervisor died" in got.reason, got


def test_the_mark_of_a_torchrun_round_says_torchrun_brought_it_back():
    """rank/rounds.py's decision (requeued_by torchrun, its step the resume point) as the next
    round's mark, in the words the other backends' restarts get."""
    history = [
        {"event": "start", "job_id": "torchrun-1", "restart": 0},
        {"event": "stop", "reason": "crash", "rank": 1, "step": 11, "job_id": "torchrun-1", "restart": 0},
        {"event": "stop", "reason": "crash", "step": 10, "job_id": "torchrun-1", "restart": 0, "requeued": True,
         "requeued_by": "torchrun", "source": "torchrun"},
        {"event": "start", "job_id": "torchrun-1", "restart": 1}]
    assert [mark for _, mark in control.attempt_marks(history)][1] == \
        "==> attempt 1 (job torchrun-1, restarted by torchrun after crash at step 10) <=="
