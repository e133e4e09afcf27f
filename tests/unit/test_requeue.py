"""ddpjob/slurm.py (failed vs no) and rank/requeue.py's one decision, every branch, against the
scripted fake (tests/fake_slurm.py): preemption within GraceTime, scancel, a failed preemption
check, scontrol refused -> successor job, budgets (max_requeues, max_failures), the ledger."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

import fake_checkpoint

from ddpjob import config, fileio, jobfile, slurm
from ddpjob.launch import control, runs, summary
from ddpjob.ledger import phases
from ddpjob.node import preemption
from ddpjob.rank import requeue, startcheck
from ddpjob.node.cluster import ClusterEnv
from ddpjob.ledger import attempts, budget, policy, requests
from ddpjob.ledger.events import is_decision, read as read_events, record as record_event
from runlogs import decisions

PREEMPTING = "JobId=77 JobState=RUNNING PreemptTime=2026-01-01T00:00:00 Command=/a b/job.sbatch"
CANCELLED = "JobId=77 JobState=RUNNING PreemptTime=None"
ENV = ClusterEnv(source="slurm", job_id="77", restart_count=0)


def run_dir(tmp_path: Path, **slurm_keys) -> tuple[config.JobConfig, Path]:
    cfg = jobfile.from_dict({"name": "t", "slurm": {"max_requeues": 3, **slurm_keys}})
    fileio.write_text_atomic(tmp_path / "config.json", cfg.to_json())
    fileio.write_text_atomic(tmp_path / "job.sbatch", "#!/bin/bash\n")
    fileio.write_json_atomic(tmp_path / "job.json", {"backend": "slurm", "job_id": "77"})
    return cfg, tmp_path


def last_stop(d: Path) -> dict:
    return decisions(read_events(d))[-1]


# ------------------------------------------------------------------ slurm.py
def test_a_failed_query_is_neither_yes_nor_no(fake_slurm) -> None:
    fake_slurm.hang("scontrol show job")
    answer = slurm.being_preempted("77")
    assert isinstance(answer, slurm.Failed) and "no answer" in answer.why
    with pytest.raises(TypeError, match="neither true nor false"):
        bool(answer)
    fake_slurm.answer("scontrol show job", CANCELLED)
    assert slurm.being_preempted("77") is False
    fake_slurm.answer("scontrol show job", PREEMPTING)
    assert slurm.being_preempted("77") is True
    assert slurm.show_job("77")["Command"] == "/a b/job.sbatch"  # values with spaces
    assert isinstance(slurm.being_preempted("77; rm -rf /"), slurm.Failed)  # never reaches a shell
    # whole strings only: a trailing newline or non-ASCII digits are no job id
    for bad in ("77\n", "\n77", "٧٧", "77_", "77_1_2"):
        assert isinstance(slurm.being_preempted(bad), slurm.Failed), repr(bad)


def test_result_tells_missing_timeout_and_refusal(fake_slurm) -> None:
    fake_slurm.missing("scontrol")
    assert not slurm.requeue("5").ok and "not found" in slurm.requeue("5").error
    fake_slurm.answer("scontrol requeue", rc=1, stderr="Requeue of job is disabled")
    res = slurm.requeue("5")
    assert res.rc == 1 and "Requeue of job is disabled" in res.error
    fake_slurm.answer("squeue", "2026-05-09T12:00:00\n")
    assert isinstance(slurm.end_time("5"), float)
    fake_slurm.answer("squeue", "N/A\n")
    assert slurm.end_time("5") is None
    fake_slurm.hang("squeue")
    assert isinstance(slurm.end_time("5"), slurm.Failed)


def test_the_real_runner_reports_a_missing_binary(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    res = slurm.run(["scontrol", "ping"])
    assert res.rc is None and not res.ok and "command not found" in res.error


def self_signalling(monkeypatch, tmp_path, command: str, name: str, then: str) -> None:
    """A stand-in `command` first on PATH that sends itself SIG`name`, then runs `then`."""
    fake = tmp_path / command
    fake.write_text(f"#!/bin/sh\nkill -{name} $$\n{then}\n")
    fake.chmod(0o700)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_the_sigterm_that_ends_the_job_does_not_cut_our_scontrol_short(monkeypatch, tmp_path) -> None:
    """A preemption's requeue sends SIGTERM to every process of the job again, `scontrol requeue`
    of rank 0 included: it runs to its answer (stop 34's CI: killed halfway, the job got a
    successor although SLURM brought it back itself). Here the command sends it to itself."""
    self_signalling(monkeypatch, tmp_path, "scontrol", "TERM", 'echo "requeued $2"')
    res = slurm.run(["scontrol", "requeue", "77"])
    assert res.ok and res.stdout == "requeued 77\n", res
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # ours: as before


@pytest.mark.parametrize("name", ["USR2", "USR1"])
def test_a_stop_signal_the_rank_catches_does_not_cut_our_scontrol_short(monkeypatch, tmp_path, name) -> None:
    """A warm-started rank is its server's child, in the server's step: `scancel --signal=USR2`
    reaches it twice (that step's, and its srun task's relay), the second while rank 0's
    `scontrol requeue` runs (a stressed CI run: exit -12, read as a refusal, a successor sent
    instead of the requeue). A signal the process catches as a stop (its StopFlag: USR2, or
    `slurm.signal`) waits while a command runs. Here the command sends it to itself."""
    signum = getattr(signal, f"SIG{name}")
    self_signalling(monkeypatch, tmp_path, "scontrol", name, 'echo "requeued $2"')
    caught: list[int] = []
    previous = signal.signal(signum, lambda s, f: caught.append(s))
    try:
        res = slurm.run(["scontrol", "requeue", "77"])
    finally:
        signal.signal(signum, previous)
    assert res.ok and res.stdout == "requeued 77\n", res
    assert signum not in signal.pthread_sigmask(signal.SIG_BLOCK, set()) and caught == []  # ours: as before


def test_a_signal_this_process_does_not_catch_still_ends_the_command(monkeypatch, tmp_path) -> None:
    """On the login side nothing catches USR2, and Ctrl-C's INT is never held: a command ends of
    them as it would without ddpjob."""
    self_signalling(monkeypatch, tmp_path, "sinfo", "USR2", "echo never")
    # as on the login side (an earlier test in this process may have left a StopFlag's handler)
    previous = signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    try:
        res = slurm.run(["sinfo"])
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert res.rc == -signal.SIGUSR2 and not res.ok and "never" not in res.stdout, res


def test_successor_job_drops_the_running_jobs_slurm_variables(fake_slurm, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_NTASKS", "4")
    fake_slurm.answer("sbatch", "91\n")
    assert slurm.submit_successor("77", "/r/job.sbatch", cwd="/r") == "91"
    call = fake_slurm.calls[-1]
    assert call.args == ["sbatch", "--parsable", "--dependency=afterany:77", "/r/job.sbatch"]
    assert call.env is not None and "SLURM_NTASKS" not in call.env and call.cwd == "/r"


# ------------------------------------------------------------------ the decision
@pytest.mark.parametrize("code, show, reason, requeued", [
    (preemption.REQUEUE, None, "time_limit", True),        # USR2 warning
    (preemption.DEADLINE, None, "time_limit", True),       # the deadline watch
    (preemption.PREEMPTED, PREEMPTING, "preemption", True),  # stopped within GraceTime
    (preemption.PREEMPTED, CANCELLED, "signal", None),      # scancel: stays ended
])
def test_stop_decision(fake_slurm, tmp_path, code, show, reason, requeued) -> None:
    cfg, d = run_dir(tmp_path)
    fake_slurm.answer("scontrol requeue")
    if show:
        fake_slurm.answer("scontrol show job", show)
    assert requeue.after_stop(cfg, ENV, d, code, 17, signal_step=14) is requeued
    stop = last_stop(d)
    assert (stop["reason"], stop["step"], stop["steps_lost"]) == (reason, 17, 2)
    assert fake_slurm.called("scontrol requeue") == ([["scontrol", "requeue", "77"]] if requeued else [])
    # every end, a scancel's too, is the policy's verdict, said in its line
    assert stop["action"] == (policy.REQUEUE if requeued else policy.END)
    if not requeued:
        assert stop["note"] == policy.decide(policy.Facts(reason), policy.Limits.of(cfg)).line


def test_a_failed_preemption_check_is_retried_then_treated_as_preemption(fake_slurm, tmp_path) -> None:
    cfg, d = run_dir(tmp_path)
    fake_slurm.hang("scontrol show job")
    fake_slurm.answer("scontrol requeue")
    assert requeue.after_stop(cfg, ENV, d, preemption.PREEMPTED, 5) is True
    assert len(fake_slurm.called("scontrol show job")) == requeue.CHECK_TRIES
    assert "preemption check failed" in last_stop(d)["note"]
    # a hiccup that passes: the answer of the retry counts
    fake_slurm.answer("scontrol show job", rc=1, stderr="Socket timed out", then=[{"stdout": CANCELLED}])
    assert requeue.after_stop(cfg, ENV, d, preemption.PREEMPTED, 6) is None


@pytest.mark.parametrize("refusal", ["Requeue of job is disabled", "Access/permission denied", None])
def test_scontrol_refused_or_missing_submits_one_successor(fake_slurm, tmp_path, refusal) -> None:
    cfg, d = run_dir(tmp_path)
    if refusal:
        fake_slurm.answer("scontrol requeue", rc=1, stderr=refusal)
    else:
        fake_slurm.missing("scontrol")
    fake_slurm.answer("sbatch", "78")
    assert requeue.after_stop(cfg, ENV, d, preemption.REQUEUE, 9) is True
    stop = last_stop(d)
    assert stop["requeued_by"] == "successor" and stop["next_job_id"] == "78"
    assert fake_slurm.called("sbatch") == [["sbatch", "--parsable", "--dependency=afterany:77",
                                            str(d / "job.sbatch")]]
    job = json.loads((d / "job.json").read_text())
    assert job["job_id"] == "78" and job["job_ids"] == ["77", "78"]
    # the successor's SLURM_RESTART_COUNT is 0, its attempt in the run is 1
    assert attempts.current(read_events(d), "78") == 1
    assert runs.job_record(d)["job_id"] == "78"


def test_submitit_successor_gets_the_task_pickle_under_its_id(fake_slurm, tmp_path) -> None:
    cfg, d = run_dir(tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "77_submitted.pkl").write_bytes(b"task")
    fileio.write_json_atomic(d / "job.json", {"backend": "slurm", "job_id": "77", "log_folder": str(logs)})
    fake_slurm.answer("scontrol requeue", rc=1, stderr="Requeue of job is disabled").answer("sbatch", "80")
    requeue.after_stop(cfg, ENV, d, preemption.REQUEUE, 3)
    assert (logs / "80_submitted.pkl").read_bytes() == b"task"
    assert [f.name for f in control.log_files(d, 0)][1:] == [
        "77_0_log.out", "77_0_log.err", "80_0_log.out", "80_0_log.err"]


def test_no_successor_for_a_cancelled_run_or_without_sbatch(fake_slurm, tmp_path) -> None:
    cfg, d = run_dir(tmp_path)
    fake_slurm.answer("scontrol requeue", rc=1, stderr="Requeue of job is disabled")
    fake_slurm.answer("sbatch", rc=1, stderr="Batch job submission failed")
    assert requeue.after_stop(cfg, ENV, d, preemption.REQUEUE, 3) is False
    assert "no successor either" in last_stop(d)["note"]
    requests.cancel(d, str(ENV.job_id), 0)  # what `ddpjob cancel` records before its scancel
    assert requeue.after_stop(cfg, ENV, d, preemption.REQUEUE, 4) is None  # not asked: the policy ends it
    assert len(fake_slurm.called("sbatch")) == 1
    assert len(fake_slurm.called("scontrol requeue")) == 1  # SLURM 22.05 would take it: never asked
    assert "cancelled by `ddpjob cancel`" in last_stop(d)["note"]


# ------------------------------------------------------------------ sweep points (array tasks)
def array_task(array: str, task: int, slurm_job_id: str) -> ClusterEnv:
    """Rank 0 of a one-task array task as SLURM's variables describe it."""
    return ClusterEnv.from_environ({"SLURM_JOB_ID": slurm_job_id, "SLURM_ARRAY_JOB_ID": array,
                                    "SLURM_ARRAY_TASK_ID": str(task), "SLURM_STEP_ID": "0",
                                    "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, argv=[])


def sweep_point(tmp_path: Path, task: int) -> tuple[config.JobConfig, Path, Path]:
    """SWEEP/<task>: job.sbatch is submitit's script of the whole array; the pickles are in SWEEP/logs."""
    (tmp_path / str(task)).mkdir()
    cfg, d = run_dir(tmp_path / str(task))
    fileio.write_text_atomic(d / "job.sbatch", "#!/bin/bash\n#SBATCH --array=0-1%2\n")
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    (logs / f"548_{task}_submitted.pkl").write_bytes(b"point %d" % task)
    fileio.write_json_atomic(d / "job.json", {"backend": "slurm", "job_id": f"548_{task}", "log_folder": str(logs),
                                              "array": {"job_id": "548", "index": task, "count": 2}})
    return cfg, d, logs


def test_the_array_task_whose_job_id_is_the_arrays_requeues_itself_only(fake_slurm, tmp_path) -> None:
    # Task 548_1 runs with SLURM_JOB_ID=548 = the array's id: `scontrol requeue 548` would
    # requeue the whole array (test cluster: "548_0: Job is pending execution; 548_1: No error").
    cfg, d, _ = sweep_point(tmp_path, 1)
    env = array_task("548", 1, slurm_job_id="548")
    fake_slurm.answer("scontrol requeue")
    assert requeue.after_stop(cfg, env, d, preemption.REQUEUE, 9) is True
    assert fake_slurm.called("scontrol requeue") == [["scontrol", "requeue", "548_1"]]
    assert not fake_slurm.called("sbatch")
    stop = last_stop(d)
    assert (stop["job_id"], stop["requeued_by"], stop["note"]) == ("548_1", "scontrol", "requeued job 548_1")
    # the preemption check and `ddpjob stop` (which asks by job.json's id, 548_1) name it alike
    fake_slurm.answer("scontrol show job", PREEMPTING.replace("JobId=77", "JobId=548 ArrayJobId=548 ArrayTaskId=1"))
    assert requeue.after_stop(cfg, env, d, preemption.PREEMPTED, 10) is True
    assert fake_slurm.called("scontrol show job")[-1] == ["scontrol", "show", "job", "-o", "548_1"]
    record_event(d, "stop_request", by="user", job_id="548_1", restart=2)
    assert requeue.after_stop(cfg, env, d, preemption.REQUEUE, 11) is None
    assert last_stop(d)["reason"] == "user_stop" and len(fake_slurm.called("scontrol requeue")) == 2


def test_a_sweep_points_successor_runs_that_point_alone(fake_slurm, tmp_path) -> None:
    cfg, d, logs = sweep_point(tmp_path, 1)
    env = array_task("548", 1, slurm_job_id="548")
    fake_slurm.answer("scontrol requeue", rc=1, stderr="Requeue of job is disabled").answer("sbatch", "560")
    assert requeue.after_stop(cfg, env, d, preemption.REQUEUE, 9) is True
    # never the whole array: the script's `#SBATCH --array=0-1%2` is overridden by index 1 alone
    assert fake_slurm.called("sbatch") == [["sbatch", "--parsable", "--dependency=afterany:548_1", "--array=1",
                                            str(d / "job.sbatch")]]
    stop = last_stop(d)
    assert (stop["requeued_by"], stop["next_job_id"]) == ("successor", "560_1")
    job = json.loads((d / "job.json").read_text())
    assert job["job_id"] == "560_1" and job["job_ids"] == ["548_1", "560_1"]
    assert (logs / "560_1_submitted.pkl").read_bytes() == b"point 1"  # submitit loads NEWID_TASK's
    assert [f.name for f in control.log_files(d, 0)][1:] == [
        "548_1_0_log.out", "548_1_0_log.err", "560_1_0_log.out", "560_1_0_log.err"]
    # the successor's task names itself 560_1 and finds its restart
    successor = array_task("560", 1, slurm_job_id="560")
    assert successor.job_id == "560_1" and attempts.current(read_events(d), successor.job_id) == 1


def test_scontrols_per_task_answer_is_read_for_the_asked_task(fake_slurm, tmp_path) -> None:
    # scontrol answers per task and exits 1 when any task failed, "No error" included
    fake_slurm.answer("scontrol requeue", rc=1, stderr="548_0: Job is pending execution\n548_1: No error\n")
    assert slurm.requeue("548_1").ok
    res = slurm.requeue("548_0")
    assert not res.ok and res.error == "scontrol requeue 548_0 failed: Job is pending execution"
    assert not slurm.requeue("548").ok  # the whole array: one of its tasks was refused
    fake_slurm.answer("scontrol requeue", rc=1, stderr="548_0: No error\n548_1: No error\n")
    assert slurm.requeue("548").ok  # several entries: exit 1 even when every one succeeded
    fake_slurm.answer("scontrol requeue", rc=1, stderr="80520_31-33,71: Job has already finished\n"
                                                       "80520_[36,56-63]: No error\n")
    assert not slurm.requeue("80520_32").ok and slurm.requeue("80520_60").ok
    fake_slurm.answer("scontrol requeue", rc=1, stderr="Requeue of job is disabled")  # no per-task lines
    assert "Requeue of job is disabled" in slurm.requeue("548_1").error
    # rank 0 of 548_1, so answered: requeued, no successor
    cfg, d, _ = sweep_point(tmp_path, 1)
    fake_slurm.answer("scontrol requeue", rc=1, stderr="548_1: No error\n548_0: Job is pending execution\n")
    assert requeue.after_stop(cfg, array_task("548", 1, "548"), d, preemption.REQUEUE, 9) is True
    assert last_stop(d)["requeued_by"] == "scontrol" and not fake_slurm.called("sbatch")


def test_max_requeues_counts_successors_too(fake_slurm, tmp_path) -> None:
    cfg, d = run_dir(tmp_path, max_requeues=1)
    fake_slurm.answer("scontrol requeue", rc=1, stderr="Requeue of job is disabled").answer("sbatch", "78")
    assert requeue.after_stop(cfg, ENV, d, preemption.REQUEUE, 3) is True
    successor = ClusterEnv(source="slurm", job_id="78", restart_count=0)
    restart = attempts.current(read_events(d), "78")
    assert requeue.after_stop(cfg, successor, d, preemption.REQUEUE, 6, restart=restart) is None
    assert "max_requeues = 1 reached" in last_stop(d)["note"]


def test_local_backend_and_requeue_off_decide_nothing(fake_slurm, tmp_path) -> None:
    cfg, d = run_dir(tmp_path, requeue=False)
    assert requeue.after_stop(cfg, ENV, d, preemption.REQUEUE, 3) is None
    assert "slurm.requeue = false" in last_stop(d)["note"]
    local = ClusterEnv(source="local", job_id="local-1", restart_count=0)
    assert requeue.after_stop(cfg, local, d, preemption.PREEMPTED, 3) is None
    assert fake_slurm.calls == []


@pytest.mark.parametrize("max_failures, requeued", [(0, None), (1, True)])
def test_a_crash_is_retried_only_within_max_failures(fake_slurm, tmp_path, max_failures, requeued) -> None:
    cfg, d = run_dir(tmp_path, max_failures=max_failures)
    fake_checkpoint.committed(d, 10)
    fake_checkpoint.committed(d, 12, damaged=True)  # a resume skips it: so does the ledger
    fileio.append_jsonl(d / "metrics.jsonl", {"kind": "train", "step": 13})
    fake_slurm.answer("scontrol requeue")
    fake_slurm.answer("scontrol show job", "JobId=77 JobState=RUNNING Restarts=0 PreemptTime=None")
    assert requeue.after_crash(cfg, ENV, d, 1) is requeued
    stop = last_stop(d)
    assert (stop["reason"], stop["step"], stop["steps_lost"]) == ("crash", 10, 3)
    if requeued:  # the second crash finds the budget spent; preemptions keep theirs
        assert budget.used(read_events(d), "77") == (0, 1)
        again = ClusterEnv(source="slurm", job_id="77", restart_count=1)
        fake_slurm.answer("scontrol show job", "JobId=77 JobState=RUNNING Restarts=1 PreemptTime=None")
        assert requeue.after_crash(cfg, again, d, 1) is None
        assert "max_failures = 1 reached" in last_stop(d)["note"]
        assert requeue.after_stop(cfg, again, d, preemption.REQUEUE, 12, restart=1) is True


def test_the_sigterm_of_our_own_requeue_waits_until_the_crash_is_recorded(fake_slurm, tmp_path,
                                                                          monkeypatch) -> None:
    """`scontrol requeue` of the job ends the batch step with SIGTERM, the deciding process too:
    the crash must be on record before that signal is let in (CI once lost it on a busy node)."""
    cfg, d = run_dir(tmp_path, max_failures=1)
    fake_checkpoint.committed(d, 10)
    fake_slurm.answer("scontrol requeue")
    fake_slurm.answer("scontrol show job", "JobId=77 JobState=RUNNING Restarts=0 PreemptTime=None")
    real = slurm.requeue

    def requeue_then_sigterm(job_id: str) -> slurm.Result:
        res = real(job_id)
        os.kill(os.getpid(), signal.SIGTERM)  # what slurmstepd does to the batch step
        return res

    monkeypatch.setattr(slurm, "requeue", requeue_then_sigterm)
    # another thread, as torch's in a rank: a process-directed signal may be delivered to it
    threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
    stops_at_sigterm: list[list[dict]] = []
    old = signal.signal(signal.SIGTERM, lambda *_: stops_at_sigterm.append(
        decisions(read_events(d))))
    try:
        assert requeue.after_crash(cfg, ENV, d, 1) is True
    finally:
        signal.signal(signal.SIGTERM, old)
    (stops,) = stops_at_sigterm  # the signal came, once, and only after the record
    assert [(s["reason"], s["requeued"]) for s in stops] == [("crash", True)], stops



def test_the_ledger_in_status(tmp_path) -> None:
    d = tmp_path
    fileio.append_jsonl(d / "events.jsonl", {"event": "start", "time": 100.0, "restart": 0, "job_id": "77"})
    fileio.append_jsonl(d / "events.jsonl", {"event": "signal", "time": 130.0, "signal_time": 120.0,
                                             "rank": 1, "job_id": "77", "restart": 0, "at_step": 7})
    fileio.append_jsonl(d / "events.jsonl", {"event": "stop", "time": 131.0, "reason": "preemption",
                                             "step": 9, "steps_lost": 1, "job_id": "77", "restart": 0,
                                             "requeued": True, "requeued_by": "successor",
                                             "next_job_id": "78"})
    fileio.append_jsonl(d / "events.jsonl", {"event": "start", "time": 165.0, "restart": 1,
                                             "job_id": "78", "resumed_step": 9})
    [(line, took)] = summary.ledger(read_events(d))
    assert line == ("preemption at step 9 (job 77), steps lost 1, successor -> job 78, "
                    "resumed step 9 after 45 s")
    assert took == ""  # a run from before the phases were recorded: none is guessed


def test_the_recovery_phases_from_the_events(tmp_path) -> None:
    """Each phase from the two records that bound it, adding up to the signal -> the end of the
    next first step (120.0 -> 141.75); a phase with an end missing is left out."""
    d = tmp_path
    for rec in [
        {"event": "start", "time": 100.0, "restart": 0, "job_id": "77"},
        {"event": "signal", "signal_time": 120.0, "rank": 1, "job_id": "77", "restart": 0},
        {"event": "signal", "signal_time": 120.5, "rank": 0, "job_id": "77", "restart": 0},
        {"event": "stop", "time": 122.1, "reason": "preemption", "step": 9, "job_id": "77", "restart": 0,
         "requeued": True, "decided_time": 120.25, "saved_time": 122.0, "signal_time": 120.5},
        {"event": "exit", "time": 122.5, "step": 9, "job_id": "77", "restart": 0},
        {"event": "start", "time": 141.0, "restart": 1, "job_id": "77", "resumed_step": 9,
         "launched_time": 133.5, "load_s": 1.25},
        {"event": "first_step", "time": 141.75, "step": 10, "job_id": "77", "restart": 1},
    ]:
        fileio.append_jsonl(d / "events.jsonl", rec)
    events = read_events(d)
    i = next(n for n, e in enumerate(events) if is_decision(e))
    assert phases.recovery(events, i) == {"stop vote": 0.25, "save": 1.75, "exit": 0.5, "requeue": 11.0,
                                          "start-up": 6.25, "load": 1.25, "first step": 0.75}
    assert sum(phases.recovery(events, i).values()) == pytest.approx(141.75 - 120.0)
    [(line, took)] = summary.ledger(events)
    assert took == ("stop vote 0.25 s, save 1.75 s, exit 0.50 s, requeue 11.00 s, start-up 6.25 s, "
                    "load 1.25 s, first step 0.75 s")
    # killed before its exit was recorded: exit and requeue have one end only
    events = [e for e in events if e["event"] != "exit"]
    assert set(phases.recovery(events, i)) == {"stop vote", "save", "start-up", "load", "first step"}


def test_the_batch_shell_env_is_the_job_not_a_rank() -> None:
    # The batch script runs `python -m ddpjob.rank.requeue` outside any srun step, where
    # from_environ refuses a multi-task job (no SLURM_STEP_ID).
    environ = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4", "SLURM_RESTART_COUNT": "2",
               "SLURM_JOB_PARTITION": "low"}
    with pytest.raises(Exception, match="SLURM_STEP_ID"):
        ClusterEnv.from_environ(environ, argv=[])
    env = ClusterEnv.batch_shell(environ)
    assert (env.job_id, env.restart_count, env.source, env.partition) == ("77", 2, "slurm", "low")


def test_no_crash_decision_after_rank0_already_stopped(fake_slurm, tmp_path) -> None:
    # Preempted: ranks 1-3 exit 3, srun --kill-on-bad-exit ends rank 0 after it recorded its
    # stop (srun's status 143), and the batch shell was not signalled: not a crash.
    cfg, d = run_dir(tmp_path, max_failures=1)
    fake_slurm.answer("scontrol show job", PREEMPTING)
    fake_slurm.answer("scontrol requeue")
    assert requeue.after_stop(cfg, ENV, d, preemption.PREEMPTED, 9) is True
    calls = len(fake_slurm.calls)
    assert requeue.after_crash(cfg, ENV, d, 143) is None
    assert len(fake_slurm.calls) == calls and last_stop(d)["reason"] == "preemption"


def test_no_crash_decision_when_slurm_requeued_the_job_itself(fake_slurm, tmp_path) -> None:
    # A node went down: srun returns 137 while rank 0 on a living node still writes its
    # node_failure stop. SLURM's Restarts went up already: the batch shell records nothing.
    cfg, d = run_dir(tmp_path, max_failures=0)
    fake_slurm.answer("scontrol show job", "JobId=77 JobState=PENDING Restarts=1 PreemptTime=None")
    assert requeue.after_crash(cfg, ENV, d, 137) is None
    assert decisions(read_events(d)) == []
    # not requeued by SLURM (Restarts still this attempt's): a crash, the budget spent
    fake_slurm.answer("scontrol show job", "JobId=77 JobState=RUNNING Restarts=0 PreemptTime=None")
    assert requeue.after_crash(cfg, ENV, d, 137) is None
    assert (last_stop(d)["reason"], last_stop(d)["status"]) == ("crash", 137)
    assert "max_failures = 0 reached" in last_stop(d)["note"]


def sacct_time(t: float) -> str:
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


def started(d: Path, job_id: str, restart: int, t: float) -> None:
    fileio.append_jsonl(d / "events.jsonl", {"event": "start", "time": t, "restart": restart,
                                             "job_id": job_id, "source": "slurm"})
    if not (d / "checkpoints").is_dir():
        fake_checkpoint.committed(d, 10)
    fileio.append_jsonl(d / "metrics.jsonl", {"kind": "train", "step": 13})


@pytest.mark.parametrize("max_failures", [0, 1])
def test_a_node_failure_nobody_saw_is_recorded_at_the_next_start(fake_slurm, tmp_path, max_failures) -> None:
    # Attempt 0 of job 77 started and its node died: no ddpjob code ran, nothing was recorded,
    # and SLURM requeued the job by itself. The next start learns it from sacct.
    cfg, d = run_dir(tmp_path, max_failures=max_failures)
    t = 1_790_000_000.0
    started(d, "77", 0, t)
    fake_slurm.answer("sacct", f"NODE_FAIL|{sacct_time(t - 5)}|{sacct_time(t + 60)}\n"
                               f"RUNNING|{sacct_time(t + 80)}|Unknown\n")
    again = ClusterEnv(source="slurm", job_id="77", restart_count=1)
    restart, why = startcheck.check_start(cfg, again, d)
    stops = decisions(read_events(d))
    failure = stops[0]
    assert (failure["reason"], failure["job_id"], failure["restart"]) == ("node_failure", "77", 0)
    assert (failure["step"], failure["steps_lost"], failure["requeued_by"]) == (10, 3, "slurm")
    assert "sacct says NODE_FAIL" in failure["note"] and failure["signal_time"] == t + 60
    assert restart == 1 and budget.used(read_events(d), "77") == (0, 1)  # a failure, not a requeue
    if max_failures:
        assert why is None and len(stops) == 1
    else:
        assert why == "1 failure(s) retried, more than slurm.max_failures = 0", why
        assert (stops[-1]["reason"], stops[-1]["restart"]) == ("budget", 1)
        assert summary.ledger(read_events(d))[1] == (
            "start refused (job 77): 1 failure(s) retried, more than slurm.max_failures = 0", "")
        # the batch shell's crash check after the refusal decides nothing more
        assert requeue.after_crash(cfg, again, d, 1) is None
    calls = len(fake_slurm.calls)
    startcheck.check_start(cfg, again, d)  # recorded once: the next start asks nothing
    assert len(fake_slurm.calls) == calls
    events = read_events(d) + [{"event": "start", "time": t + 100, "restart": 1, "job_id": "77",
                                  "resumed_step": 10}]
    assert summary.ledger(events)[0][0] == ("node_failure at step 10 (job 77), steps lost 3, slurm, "
                                         "resumed step 10 after 40 s")


def test_an_unseen_end_without_sacct_or_in_another_job(fake_slurm, tmp_path) -> None:
    cfg, d = run_dir(tmp_path, max_failures=0)
    started(d, "70", 0, 1_790_000_000.0)  # an earlier job of this run dir, then resubmitted by hand
    started(d, "77", 0, 1_790_000_500.0)  # this job's first start, SIGKILLed: sacct is down
    fake_slurm.answer("sacct -X -D -n -P -o State,Start,End -j 70",
                      f"FAILED|{sacct_time(1_789_999_990.0)}|{sacct_time(1_790_000_100.0)}\n")
    fake_slurm.answer("sacct -X -D -n -P -o State,Start,End -j 77", rc=1,
                      stderr="Slurm accounting storage is disabled")
    restart, why = startcheck.check_start(cfg, ClusterEnv(source="slurm", job_id="77", restart_count=1), d)
    old, mine = decisions(read_events(d))
    assert (old["reason"], old["requeued"]) == ("crash", False)  # not retried by anyone: free
    assert (mine["reason"], mine["requeued_by"]) == ("killed", "slurm")
    assert "sacct did not answer (sacct -X -D failed: Slurm accounting storage is disabled)" in mine["note"]
    assert (restart, why) == (1, None) and budget.used(read_events(d), "77") == (1, 0)


def test_a_commands_attempt_killed_after_gracetime_is_recorded_at_the_next_start(fake_slurm, tmp_path) -> None:
    """A [train] command whose program logs no steps has only its `launch` record until it ends;
    SLURM's SIGKILL after GraceTime leaves nothing else. The next start of the requeued job
    records that attempt's end from sacct and runs as a new attempt (it ran as the same one)."""
    cfg, d = run_dir(tmp_path)
    cfg = jobfile.from_dict({"name": "t", "slurm": {"max_requeues": 3}, "train": {"command": ["python", "x.py"]}})
    t = 1_790_000_000.0
    fileio.append_jsonl(d / "events.jsonl", {"event": "launch", "time": t, "restart": 0, "job_id": "77",
                                             "source": "slurm", "world_size": 2, "host": "n1"})
    fake_slurm.answer("sacct -X -D -n -P -o State,Start,End -j 77",
                      f"PREEMPTED|{sacct_time(t - 5)}|{sacct_time(t + 60)}\nRUNNING|{sacct_time(t + 90)}|Unknown\n")
    restart, why = startcheck.check_start(cfg, ClusterEnv(source="slurm", job_id="77", restart_count=1), d)
    (stop,) = decisions(read_events(d))
    assert (stop["reason"], stop["restart"], stop["requeued_by"], stop["unseen"]) == ("preemption", 0, "slurm", True)
    assert stop.get("step") is None, stop  # the program said nothing of its steps: not "step 0"
    assert (restart, why) == (1, None)


def test_a_node_failure_seen_by_the_living_ranks_is_recorded_at_their_stop(fake_slurm, tmp_path) -> None:
    # `scontrol update nodename=n2 state=down` with the ranks alive: SLURM ends the attempt
    # NODE_FAIL, requeues the job itself (Restarts 0 -> 1) and the ranks get SIGTERM.
    cfg, d = run_dir(tmp_path, max_failures=1)
    t = 1_790_000_000.0
    fake_slurm.answer("scontrol show job", "JobId=77 JobState=PENDING Reason=BeginTime Restarts=1 PreemptTime=None")
    fake_slurm.answer("sacct", f"NODE_FAIL|{sacct_time(t - 30)}|{sacct_time(t)}\nPENDING|Unknown|Unknown\n")
    assert requeue.after_stop(cfg, ENV, d, preemption.PREEMPTED, 28, signal_step=27, signal_time=t) is True
    stop = last_stop(d)
    assert (stop["reason"], stop["requeued_by"], stop["steps_lost"]) == ("node_failure", "slurm", 0), stop
    assert budget.used(read_events(d), "77") == (0, 1)
    assert not fake_slurm.called("scontrol requeue")  # SLURM brought it back already
    # a scancel leaves Restarts alone: sacct is not even asked
    fake_slurm.answer("scontrol show job", "JobId=77 JobState=CANCELLED Restarts=0 PreemptTime=None")
    calls = len(fake_slurm.calls)
    requeue.after_stop(cfg, ENV, d, preemption.PREEMPTED, 30)
    assert last_stop(d)["reason"] == "signal" and not any(c.args[0] == "sacct" for c in fake_slurm.calls[calls:])


def test_budgets_count_the_job_chain_so_a_new_submission_starts_fresh(fake_slurm, tmp_path) -> None:
    cfg, d = run_dir(tmp_path, max_failures=0)
    for rec in ({"event": "stop", "reason": "node_failure", "requeued": True, "job_id": "70", "restart": 0},
                {"event": "stop", "reason": "preemption", "requeued": True, "requeued_by": "successor",
                 "next_job_id": "71", "job_id": "70", "restart": 1},
                {"event": "stop", "reason": "crash", "requeued": True, "job_id": "71", "restart": 2}):
        fileio.append_jsonl(d / "events.jsonl", rec)
    assert budget.used(read_events(d), "71") == (1, 2)  # 71 succeeds 70: one chain
    assert budget.used(read_events(d), "90") == (0, 0)  # `ddpjob resume` submitted 90: fresh budgets
    # its attempt goes on from the run's: 3, not 0 again (ledger/attempts.py)
    assert startcheck.check_start(cfg, ClusterEnv(source="local", job_id="90", restart_count=0), d) == (3, None)
