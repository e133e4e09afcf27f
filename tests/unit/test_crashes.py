"""ddpjob/crashes.py and the in-allocation decision that uses it (rank/requeue.py): who failed
first and where (srun's own lines, the rank's recorded error), the per-host failure ledger and
its quarantine, the no-progress streak that ends a crash loop, and the layout the batch script
gets for its next srun. Pure functions and the decision against the scripted fake SLURM; the
same paths run on the real cluster in tests/cluster/test_crashes_slurm.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import fake_checkpoint

from ddpjob import config, exitcodes, fileio, jobfile
from ddpjob.ledger import budget, crashes, requests
from ddpjob.launch import summary
from ddpjob.rank import requeue
from ddpjob.node.cluster import ClusterEnv
from ddpjob.ledger.events import read as read_events
from runlogs import decisions

ENV = ClusterEnv(source="slurm", job_id="77", restart_count=0, hosts=("n1", "n2"), num_nodes=2)
KILLED = ("ddpjob: attempt 0: ranks on 2 node(s)\n"
          "srun: error: n2: task 2: Killed\n"
          "srun: Job step aborted: Waiting up to 7 seconds for job step to finish.\n"
          "slurmstepd: error: *** STEP 77.0 ON n1 CANCELLED AT 2026-11-26T12:00:00 ***\n"
          "srun: error: n1: tasks 0-1: Killed\n"
          "srun: error: n2: task 3: Exited with exit code 1\n")


def test_srun_names_the_task_that_failed_first_and_whether_it_is_the_hosts_fault() -> None:
    assert crashes.from_srun(KILLED) == crashes.Culprit(2, "n2", "Killed", True)
    exited = crashes.from_srun("srun: error: n1: tasks 0-1: Exited with exit code 1\n")
    assert exited == crashes.Culprit(0, "n1", "Exited with exit code 1", False)  # the program's own end
    assert crashes.from_srun("srun: error: n1: task 1: Segmentation fault (core dumped)\n").host_fault
    assert crashes.from_srun("srun: error: Unable to create step for job 77\n") is None
    assert crashes.from_srun("") is None
    # a hostname that could be shell is no hostname: the line is not srun's
    assert crashes.from_srun("srun: error: n1;rm -rf /: task 1: Killed\n") is None


def test_a_task_srun_terminated_is_the_steps_end_not_its_cause() -> None:
    # --kill-on-bad-exit: rank 0 died of srun's SIGTERM after rank 1 was killed; the line order
    # is srun's, either way the cause is rank 1
    both = "srun: error: n1: task 0: Terminated\nsrun: error: n2: task 1: Killed\n"
    assert crashes.from_srun(both) == crashes.Culprit(1, "n2", "Killed", True)
    # only SIGTERM ends (a `scancel --signal=TERM` of the steps, a `kill` of a rank): that is the culprit
    term = crashes.from_srun("srun: error: n1: tasks 0-1: Terminated\n")
    assert term == crashes.Culprit(0, "n1", "Terminated", True) and crashes.terminated(term.how)


def test_the_ranks_own_error_tells_the_story_and_never_blames_the_host() -> None:
    evs = [{"event": "stop", "reason": "crash", "rank": 1, "host": "n1", "job_id": "77", "restart": 0,
            "error": "ddpjob: error: rank 1: RuntimeError: boom (train.py:12). Hint: it is yours."},
           {"event": "stop", "reason": "crash", "rank": 0, "host": "n1", "job_id": "77", "restart": 0,
            "error": "ddpjob: error: rank 0: peer gone."}]
    srun = crashes.from_srun("srun: error: n1: task 1: Exited with exit code 1\n")
    assert crashes.with_rank_error(srun, evs, "77", 0) == crashes.Culprit(
        1, "n1", "RuntimeError: boom (train.py:12)", False)
    # no srun line (the local backend, a custom template): the first recorded error names the rank
    assert crashes.with_rank_error(None, evs, "77", 0).rank == 1
    assert crashes.with_rank_error(None, evs, "77", 1) is None  # another attempt's records
    assert crashes.from_returncode(3, "box", -9) == crashes.Culprit(3, "box", "killed by SIGKILL", True)
    assert crashes.from_returncode(0, "box", 1) == crashes.Culprit(0, "box", "exited with status 1", False)


def crash(job: str, restart: int, step: int, host: str | None = None, fault: bool = True) -> dict:
    return {"event": "stop", "reason": "crash", "job_id": job, "restart": restart, "step": step,
            "requeued": True, "requeued_by": "in_allocation", "failed_host": host, "host_fault": fault}


def start(job: str, restart: int, resumed: int | None) -> dict:
    return {"event": "start", "job_id": job, "restart": restart, "resumed_step": resumed}


def test_a_stop_on_srun_s_sigterm_after_a_peer_s_crash_record_is_that_crash() -> None:
    """command.py asks this before it records a stop: the peer's crash of this attempt, never its
    own record, an earlier attempt's, or a decision (a stop without `rank`)."""
    def crash(rank: int, restart: int = 1, job: str = "77") -> dict:
        return {"event": "stop", "reason": "crash", "rank": rank, "job_id": job, "restart": restart, "error": "x"}

    evs = [crash(1, restart=0), {"event": "stop", "reason": "crash", "job_id": "77", "restart": 1},
           crash(0), crash(1, job="78")]
    assert crashes.peer_crash(evs, "77", 1, 0) is None  # only its own record, the older attempt's, another job's
    assert crashes.peer_crash([*evs, crash(2), crash(3)], "77", 1, 0) == crash(2)  # the first peer's
    assert crashes.peer_crash(evs, "77", 0, 0) == crash(1, restart=0)


def test_two_host_failures_exclude_a_host_preemptions_and_exceptions_never_count() -> None:
    evs = [start("77", 0, None), crash("77", 0, 30, "n2"),
           {"event": "stop", "reason": "preemption", "job_id": "77", "restart": 1, "step": 40,
            "failed_host": "n1", "host_fault": True},
           crash("77", 2, 40, "n1", fault=False), crash("77", 3, 50, "n2")]
    assert crashes.host_failures(evs) == {"n2": 2}
    assert crashes.excluded(evs) == ["n2"]
    assert crashes.excluded(evs[:2]) == []
    assert crashes.excluded(evs, chain={"78"}) == []  # another submission of the run: a fresh ledger
    assert crashes.excluded(evs, after=3) == [] and crashes.excluded(evs, after=1) == ["n2"]
    assert crashes.excluded(evs, after=0) == []  # [slurm] exclude_after = 0: never
    bad = crash("77", 4, 60, "n2; reboot")  # a record edited by hand is no host name
    assert crashes.host_failures([*evs, bad]) == {"n2": 2}


def test_the_no_progress_streak_counts_attempts_that_got_nowhere_in_a_row() -> None:
    evs = [start("77", 0, None), crash("77", 0, 10),  # progress: 0 -> 10
           start("77", 1, 10), crash("77", 1, 10),  # nowhere
           start("77", 2, 10), crash("77", 2, 10)]  # nowhere
    assert crashes.no_progress(evs, None, None) == (2, 10)
    assert crashes.no_progress(evs, None, ("77", 3, 10)) == (3, 10)  # a third, not recorded yet
    assert crashes.no_progress(evs, None, ("77", 3, 20)) == (0, None)  # it got past 10
    # rank 0's signal stop that the batch shell's crash decision replaced is no stop of its own
    empty = {"event": "stop", "reason": "signal", "job_id": "77", "restart": 2, "step": 10, "requeued": None}
    assert crashes.no_progress([*evs[:5], empty, evs[5]], None, None) == (2, 10)
    # a preemption between them ends the streak: it is no crash loop
    pre = {"event": "stop", "reason": "preemption", "job_id": "77", "restart": 2, "step": 10}
    assert crashes.no_progress([*evs[:4], pre], None, ("77", 3, 10)) == (1, 10)
    # an attempt that died before its first step (no start record) began where the last ended
    assert crashes.no_progress(evs[:2], None, ("77", 1, 10)) == (1, 10)
    # from scratch, dying before the first checkpoint is no progress either
    assert crashes.no_progress([start("77", 0, None)], None, ("77", 0, 0)) == (1, 0)


def run_dir(tmp_path: Path, **slurm_keys) -> tuple[config.JobConfig, Path]:
    cfg = jobfile.from_dict({"name": "t", "slurm": {"nodes": 2, "tasks_per_node": 2, **slurm_keys}})
    fileio.write_text_atomic(tmp_path / "config.json", cfg.to_json())
    fileio.write_json_atomic(tmp_path / "job.json", {"backend": "slurm", "job_id": "77"})
    (tmp_path / "logs").mkdir()
    return cfg, tmp_path


def batch_log(d: Path, text: str) -> None:
    with open(d / "logs" / "batch-77.out", "a") as f:
        f.write(text)


@pytest.mark.parametrize("allocated, spare, layout", [(("n1", "n3"), 1, (2, [])), (("n1",), 0, (1, []))],
                         ids=["a-spare-takes-its-place", "the-survivor-alone"])
def test_a_node_lost_with_on_node_loss_continue_is_left_behind_inside_the_allocation(
        fake_slurm, tmp_path, allocated, spare, layout) -> None:
    """sbatch --no-kill: n2 failed and left the allocation (scontrol's NodeList no longer names
    it), the job did not end. The decision records a node_failure naming n2, spends one of
    max_failures and runs the ranks again on the nodes left: the spare keeps the world size,
    without one the survivor goes on alone; an ordinary crash later is a crash again."""
    env = ClusterEnv(source="slurm", job_id="77", restart_count=0, hosts=("n1", "n2", "n3")[:2 + spare],
                     num_nodes=2 + spare)
    cfg, d = run_dir(tmp_path, max_failures=3, on_node_loss="continue", spare_nodes=spare)
    nodelist = "n[1,3]" if spare else "n1"
    fake_slurm.answer("scontrol show job", f"JobId=77 JobState=RUNNING Restarts=0 PreemptTime=None NodeList={nodelist}")
    fake_checkpoint.committed(d, 30)
    fileio.append_jsonl(d / "events.jsonl", start("77", 0, None))
    batch_log(d, "ddpjob: attempt 0: ranks on 2 node(s)\nsrun: error: Node failure on n2\n"
                 "srun: error: n2: task 2: Killed\nsrun: error: n1: task 0: Killed\n")
    assert requeue.after_crash(cfg, env, d, 137, in_place=True) is True
    stop = decisions(read_events(d))[-1]
    assert (stop["reason"], stop["lost_hosts"], stop["requeued_by"]) == ("node_failure", ["n2"], "in_allocation")
    assert stop["note"].startswith("node(s) n2 left allocation 77; restarting in place from the checkpoint of step 30")
    # srun's "Node failure on n2" names the culprit, not the first task it then killed (on n1)
    assert (stop["failed_rank"], stop["failed_host"], stop["failed_how"]) == (None, "n2", "node failure")
    assert "node n2 failed" in "\n".join(summary.summary(d))
    assert requeue.restart_layout(d, env, cfg) == layout
    fileio.append_jsonl(d / "events.jsonl", start("77", 1, 30))
    batch_log(d, "ddpjob: attempt 1: ranks on 2 node(s)\nsrun: error: n1: task 1: Exited with exit code 1\n")
    assert requeue.after_crash(cfg, env, d, 1, in_place=True) is True
    assert [e["reason"] for e in decisions(read_events(d))] == ["node_failure", "crash"]


def test_the_node_loss_settings_refuse_what_cannot_work(tmp_path) -> None:
    for keys, says in (({"on_node_loss": "stay"}, "slurm.on_node_loss is 'stay', expected requeue or continue"),
                       ({"on_node_loss": "continue", "max_failures": 0}, "with max_failures = 0: a lost node would end the job"),
                       ({"spare_nodes": 1, "max_failures": 1}, "slurm.spare_nodes = 1 with on_node_loss = \"requeue\"")):
        with pytest.raises(Exception, match=re.escape(says)):
            jobfile.from_dict({"name": "t", "slurm": {"nodes": 2, **keys}})
    from ddpjob.launch import slurmopts

    cfg = jobfile.from_dict({"name": "t", "slurm": {"nodes": 2, "tasks_per_node": 2, "spare_nodes": 1,
                                                   "on_node_loss": "continue", "max_failures": 1}})
    own, _ = slurmopts.sbatch_options(cfg)
    assert ("nodes", 3) in own and ("no-kill", True) in own  # the spare is allocated, a lost node leaves
    import subprocess

    for alloc, ranks_on in (("3", "2"), ("2", "2"), ("1", "1"), (None, "2")):
        env = {"PATH": "/usr/bin:/bin", **({"SLURM_JOB_NUM_NODES": alloc} if alloc else {})}
        out = subprocess.run(["bash", "-c", f"echo {slurmopts.node_count(cfg)}"], env=env, capture_output=True,
                             text=True, timeout=30)
        assert out.stdout.strip() == ranks_on, (alloc, out)


def test_a_host_that_failed_twice_is_left_out_of_the_next_srun(fake_slurm, tmp_path) -> None:
    cfg, d = run_dir(tmp_path, max_failures=5)
    fake_slurm.answer("scontrol show job", "JobId=77 JobState=RUNNING Restarts=0 PreemptTime=None")
    fake_checkpoint.committed(d, 30)
    fileio.append_jsonl(d / "events.jsonl", start("77", 0, None))
    batch_log(d, "ddpjob: attempt 0: ranks on 2 node(s)\nsrun: error: n2: task 2: Killed\n")
    assert requeue.after_crash(cfg, ENV, d, 137, in_place=True) is True
    first = decisions(read_events(d))[-1]
    assert (first["failed_rank"], first["failed_host"], first["host_fault"]) == (2, "n2", True)
    assert requeue.restart_layout(d, ENV, cfg) == (2, [])  # once is not yet the host
    fake_checkpoint.committed(d, 60)
    fileio.append_jsonl(d / "events.jsonl", start("77", 1, 30))
    # the first attempt's line is still in the log: only the newest attempt's lines count
    batch_log(d, "ddpjob: attempt 1: ranks on 2 node(s)\nsrun: error: n2: task 3: Bus error\n")
    assert requeue.after_crash(cfg, ENV, d, 135, in_place=True) is True
    assert [e.get("failed_rank") for e in decisions(read_events(d))] == [2, 3]
    assert requeue.restart_layout(d, ENV, cfg) == (1, ["n2"])
    # what `ddpjob status` shows while job 77 runs: its next restart leaves n2 out
    lines = "\n".join(summary.summary(d, live_job="77"))
    assert "hosts       n2 2 failures (excluded from job 77)" in lines and "rank 3 on n2: Bus error" in lines, lines
    # once the job has ended (or for another job: a successor of a resume) nothing is excluded
    lines = "\n".join(summary.summary(d))
    assert "hosts       n2 2 failures" in lines and "excluded" not in lines, lines
    # [slurm] exclude_after = 3: two failures are not yet the host, for the decision and status
    cfg3 = jobfile.from_dict({"name": "t", "slurm": {"nodes": 2, "tasks_per_node": 2, "exclude_after": 3}})
    fileio.write_text_atomic(d / "config.json", cfg3.to_json())
    assert requeue.restart_layout(d, ENV, cfg3) == (2, [])
    lines = "\n".join(summary.summary(d, live_job="77"))
    assert "n2 2 failures" in lines and "excluded" not in lines, lines


@pytest.mark.parametrize("srun_says, decided", [
    ("srun: error: n2: task 1: Killed\nsrun: error: n1: task 0: Terminated\n", True),
    ("srun: error: n1: tasks 0-1: Terminated\n", False)], ids=["a-peer-killed", "a-scancel-signal"])
def test_rank_0s_stop_that_decided_nothing_gives_way_to_the_task_srun_saw_die(
        fake_slurm, tmp_path, srun_says, decided) -> None:
    """Rank 0 stopped on SIGTERM and found the job not being preempted (a "signal" stop, nothing
    decided); the batch shell, which got no signal, decides srun's culprit as that attempt's crash
    when a task died another way (its `ddpjob run` was killed: no crash record), and leaves the
    stop standing when SIGTERM ended every task (`scancel --signal=TERM` of the steps)."""
    cfg, d = run_dir(tmp_path, max_failures=5)
    fake_slurm.answer("scontrol show job", "JobId=77 JobState=RUNNING Restarts=0 PreemptTime=None")
    fake_checkpoint.committed(d, 30)
    fileio.append_jsonl(d / "events.jsonl", start("77", 0, None))
    fileio.append_jsonl(d / "events.jsonl", {"event": "stop", "reason": "signal", "job_id": "77", "restart": 0,
                                             "incarnation": 0, "step": 30, "requeued": None,
                                             "note": "not being preempted (scancel, or already requeued): not requeueing"})
    batch_log(d, "ddpjob: attempt 0: ranks on 2 node(s)\n" + srun_says)
    assert requeue.after_crash(cfg, ENV, d, 143, in_place=True) is (True if decided else None)
    stops = decisions(read_events(d))
    if decided:  # the same attempt's crash: restarted in place, the next attempt is 1
        assert [(e["reason"], e["restart"], e.get("failed_rank")) for e in stops] == [
            ("signal", 0, None), ("crash", 0, 1)], stops
        assert stops[1]["verdict"] == "infrastructure" and stops[1]["action"] == "restart", stops
        shown = [line for line, _ in summary.ledger(read_events(d))]
        assert len(shown) == 1 and shown[0].startswith("crash at step 30"), shown  # status: one stop
    else:
        assert [e["reason"] for e in stops] == ["signal"], stops


def test_a_crash_after_ddpjob_cancel_is_not_restarted(fake_slurm, tmp_path, capsys) -> None:
    """`ddpjob cancel` records its cancel, then scancel ends the ranks: their crash is decided
    with the cancel known, so the batch shell runs no srun again in the job being cancelled."""
    cfg, d = run_dir(tmp_path, max_failures=5)
    fake_slurm.answer("scontrol show job", "JobId=77 JobState=COMPLETING Restarts=0 PreemptTime=None")
    fake_checkpoint.committed(d, 30)
    fileio.append_jsonl(d / "events.jsonl", start("77", 0, None))
    requests.cancel(d, "77", 0)
    batch_log(d, "ddpjob: attempt 0: ranks on 2 node(s)\nsrun: error: n2: task 2: Killed\n")
    assert requeue.after_crash(cfg, ENV, d, 137, in_place=True) is None  # not brought back
    decision = decisions(read_events(d))[-1]
    assert decision["action"] == "end" and "cancelled by `ddpjob cancel`" in decision["line"], decision
    assert "cancelled by `ddpjob cancel`: not requeued, not restarted" in capsys.readouterr().err
    assert fake_slurm.called("scontrol requeue") == []


def test_the_decision_prints_the_layout_for_the_batch_script(fake_slurm, tmp_path, monkeypatch,
                                                              capsys) -> None:
    """`python -m ddpjob.rank.requeue RUN STATUS` as the template runs it: exit RESTART and, on
    stdout's last line, "NODES HOSTS" for `read`; the crash's story goes to the batch log."""
    cfg, d = run_dir(tmp_path, max_failures=5)
    for restart in (0, 1):
        fileio.append_jsonl(d / "events.jsonl", {**crash("77", restart, 10, "n1"), "failed_rank": 0})
    fileio.append_jsonl(d / "events.jsonl", start("77", 2, 10))
    fake_checkpoint.committed(d, 20)
    batch_log(d, "ddpjob: attempt 2: ranks on 2 node(s)\nsrun: error: n2: task 2: Killed\n")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    fake_slurm.answer("scontrol show job", "JobId=77 JobState=RUNNING Restarts=0 PreemptTime=None")
    assert requeue.main([str(d), "137"]) == exitcodes.RESTART
    out = capsys.readouterr()
    assert out.out.splitlines()[-1] == "1 n1", out.out
    assert "excluding n1" in out.err and "rank 2 on n2: Killed" in out.err, out.err
    # with n2 failing twice as well, no node is left: the crash is not retried in the allocation
    fileio.append_jsonl(d / "events.jsonl", {**crash("77", 3, 20, "n2"), "failed_rank": 2})
    batch_log(d, "ddpjob: attempt 3: ranks on 1 node(s), excluding n1\nsrun: error: n2: task 0: Killed\n")
    assert requeue.main([str(d), "137"]) == 137
    assert ("ddpjob: error: every node of the allocation is excluded after failing, expected one left to "
            "restart on. Hint: `ddpjob resume") in capsys.readouterr().err


def test_a_crash_loop_ends_the_job_with_one_line(fake_slurm, tmp_path, capsys) -> None:
    """A rank segfaults in every attempt past the checkpoint it resumed from: retried (what the
    cluster breaks is), until slurm.max_no_progress attempts in a row got nowhere."""
    cfg, d = run_dir(tmp_path, max_failures=10, max_no_progress=3, exclude_after=0)
    fake_slurm.answer("scontrol show job", "JobId=77 JobState=RUNNING Restarts=0 PreemptTime=None")
    fake_checkpoint.committed(d, 10)
    fileio.append_jsonl(d / "metrics.jsonl", {"kind": "train", "step": 15})
    fileio.append_jsonl(d / "events.jsonl", start("77", 0, None))
    answers = []
    for restart in range(4):
        if restart:
            fileio.append_jsonl(d / "events.jsonl", start("77", restart, 10))
        batch_log(d, f"ddpjob: attempt {restart}: ranks on 2 node(s)\n"
                     "srun: error: n1: task 0: Segmentation fault\n")
        answers.append(requeue.after_crash(cfg, ENV, d, 139, in_place=True))
    # the first attempt got from 0 to 10; the next three got nowhere: the third of them ends it
    assert answers == [True, True, True, None]
    stops = decisions(read_events(d))
    assert [s["no_progress"] for s in stops] == [0, 1, 2, 3]
    assert [s["verdict"] for s in stops] == ["infrastructure"] * 4
    assert budget.used(read_events(d), "77")[1] == 3  # 7 retries of max_failures were left
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("ddpjob: error: crash loop: 3 attempts in a row crashed without getting past "
                          "the checkpoint at step 10, the last after step 15 (rank 0 on n1: "
                          "Segmentation fault); not retrying (slurm.max_no_progress = 3). "
                          "Hint: the rank logs in "), err
    assert "slurm.max_no_progress = 3" in stops[-1]["note"]
