"""ddpjob/ledger/policy.py: every combination of the facts of an attempt's end -> one verdict,
as a table; then the same crashes carried through both deciders that gather the facts (the SLURM
batch shell's, rank/requeue.after_crash, and the local supervisor's, launch/local.py), which must
take the same action. Pure and in-process: the real paths run in tests/ranks and tests/cluster."""

from __future__ import annotations

import itertools
import signal
from pathlib import Path

import pytest

import fake_checkpoint

from ddpjob import fileio, jobfile
from ddpjob.launch import local
from ddpjob.ledger import budget, crashes, policy
from ddpjob.ledger.events import read as read_events, record as record_event
from ddpjob.node import preemption
from ddpjob.node.cluster import ClusterEnv
from ddpjob.rank import requeue
from runlogs import decisions

P, R, E = policy.REQUEUE, policy.RESTART, policy.END
LIMITS = policy.Limits(requeue=True, max_requeues=2, max_failures=2, max_no_progress=3, retry_user_errors=False)


def verdict(reason: str, **facts: object) -> str:
    return policy.decide(policy.Facts(reason, **facts), LIMITS).action  # type: ignore[arg-type]


# (reason, facts) -> action. A preemption or time limit spends max_requeues only; what the
# cluster breaks is retried (here, or by a requeue where the decider holds no allocation) while
# max_failures lasts; the user's exception and ddpjob's own are not retried; loops end.
TABLE = [
    ("preemption", {}, P),
    ("time_limit", {}, P),
    ("time_limit", {"requeues": 2}, E),  # max_requeues spent
    ("preemption", {"failures": 2}, P),  # failures never spend the requeue budget
    ("preemption", {"stop_requested": True}, E),
    ("user_stop", {}, E),
    ("signal", {}, E),  # scancel / ddpjob cancel: not SLURM's
    ("crash", {"crash": policy.INFRASTRUCTURE, "here": True}, R),
    ("crash", {"crash": policy.INFRASTRUCTURE}, P),  # no allocation held: a requeue
    ("node_failure", {"crash": policy.INFRASTRUCTURE, "here": True}, R),
    ("crash", {"crash": policy.INFRASTRUCTURE, "here": True, "failures": 2}, E),  # max_failures spent
    ("crash", {"crash": policy.INFRASTRUCTURE, "here": True, "requeues": 2}, R),  # requeues don't count
    ("crash", {"crash": policy.INFRASTRUCTURE, "here": True, "stop_requested": True}, E),
    ("crash", {"crash": policy.INFRASTRUCTURE, "here": True, "hosts_left": False}, E),  # all quarantined
    ("crash", {"crash": policy.INFRASTRUCTURE, "here": True, "streak": 3}, E),  # crash loop
    ("crash", {"crash": policy.INFRASTRUCTURE, "here": True, "streak": 2}, R),
    ("crash", {"crash": policy.INFRASTRUCTURE, "here": True, "streak": 1, "again": True, "signal": "SIGKILL"}, E),
    ("crash", {"crash": policy.INFRASTRUCTURE, "here": True, "streak": 1, "again": True, "signal": "SIGSEGV"}, R),
    ("crash", {"crash": policy.USER, "here": True}, E),
    ("crash", {"crash": policy.INTERNAL, "here": True}, E),
    ("crash", {"crash": policy.TRANSIENT, "here": True}, R),  # once
    ("crash", {"crash": policy.TRANSIENT, "here": True, "again": True, "streak": 1}, E),  # twice at one place
    # `ddpjob cancel` recorded: nothing brings the job back (SLURM itself would requeue it)
    ("time_limit", {"cancelled": True}, E),
    ("preemption", {"cancelled": True}, E),
    ("crash", {"crash": policy.INFRASTRUCTURE, "here": True, "cancelled": True}, E),
    ("node_failure", {"crash": policy.INFRASTRUCTURE, "cancelled": True}, E),
]


@pytest.mark.parametrize("reason,facts,action", TABLE, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(TABLE)])
def test_the_policy_table(reason: str, facts: dict, action: str) -> None:
    assert verdict(reason, **facts) == action


def test_every_combination_gets_exactly_one_verdict_and_its_line() -> None:
    """The whole product of the facts: one verdict each, a line that says what happens next, and
    the rules that hold whatever else is true."""
    reasons = ("preemption", "time_limit", "signal", "user_stop", "crash", "node_failure")
    for reason, cls, here, spent, streak, again, asked, hosts, cancelled in itertools.product(
            reasons, (*policy.CLASSES, None), (True, False), (0, 2), (0, 1, 3), (False, True), (False, True),
            (True, False), (False, True)):
        f = policy.Facts(reason, cls if reason in policy.FAILURES else None, "rank 1 on n2: killed by SIGKILL",
                         stop_requested=asked, requeues=spent, failures=spent, streak=streak, again=again,
                         here=here, hosts_left=hosts, signal="SIGKILL", run="runs/x", cancelled=cancelled)
        v = policy.decide(f, LIMITS)
        assert v.action in (P, R, E) and v.line and "\n" not in v.line
        if cancelled:
            assert v.action == E and "cancelled by `ddpjob cancel`" in v.line
            continue
        if asked or reason in ("signal", "user_stop"):
            assert v.action == E
        # the end `ddpjob stop` asked for (the local run ends STOPPED), and only that end
        assert v.asked == (v.action == E and (asked or reason == "user_stop") and "`ddpjob stop`" in v.line)
        assert v.asked == (reason == "user_stop" or (asked and reason != "signal"))
        if v.action == R:
            assert here and reason in policy.FAILURES and "restarting in place" in v.line
        if reason in policy.FAILURES and cls in (policy.USER, policy.INTERNAL) and not asked:
            assert v.action == E and "not retried" in v.line
        if reason in policy.STOPS and not asked and spent < LIMITS.max_requeues:
            assert v.action == P  # a preemption is never held against the failure budget
    assert not policy.decide(policy.Facts("crash", policy.USER), policy.Limits(retry_user_errors=True,
                                                                              max_failures=1)).action == E


def test_the_lines_say_what_happens_next() -> None:
    restart = policy.decide(policy.Facts("crash", policy.INFRASTRUCTURE, "rank 1 on n2: killed by SIGKILL",
                                         here=True, resume_at=238, steps_lost=11, from_snapshot=True), LIMITS)
    assert restart.line == ("restarting in place from the snapshot of step 238 (11 steps lost); "
                            "failure 1 of max_failures = 2")
    user = policy.decide(policy.Facts("crash", policy.USER, "rank 0's RuntimeError at train.py:291 at step 100",
                                      here=True, run="runs/gpt"), LIMITS)
    assert user.line == ("not retried: rank 0's RuntimeError at train.py:291 at step 100 is the code's own; fix "
                         "it, then `ddpjob resume runs/gpt` (slurm.retry_user_errors = true retries it)")
    oom = policy.decide(policy.Facts("crash", policy.INFRASTRUCTURE, "rank 1 on n2: killed by SIGKILL", here=True,
                                     streak=1, again=True, signal="SIGKILL"), LIMITS)
    assert oom.error and oom.line.startswith("crash loop: rank 1 on n2: killed by SIGKILL again at the same "
                                             "step: likely the kernel's OOM killer")
    internal = policy.decide(policy.Facts("crash", policy.INTERNAL, "rank 0's AttributeError", here=True), LIMITS)
    assert "internal error of ddpjob" in internal.line
    assert internal.fields() == {"action": E, "verdict": "internal", "line": internal.line}


# ------------------------------------------------------------------ both deciders agree
def _run(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    cfg = jobfile.from_dict({"name": "t", "slurm": {"nodes": 1, "tasks_per_node": 2, "max_failures": 2,
                                                   "exclude_after": 0}})
    fileio.write_text_atomic(d / "config.json", cfg.to_json())
    fake_checkpoint.committed(d, 10)
    return d


def _rank_error(d: Path, job_id: str, error_class: str) -> None:
    fileio.append_jsonl(d / "events.jsonl", {
        "event": "stop", "reason": "crash", "rank": 1, "host": "n1", "job_id": job_id, "restart": 0,
        "error": "ddpjob: error: rank 1: your code raised RuntimeError: boom at train.py:9", "step": 12,
        "error_class": error_class, "exception": "RuntimeError", "where": "train.py:9"})


# How the rank ended: (srun's line for it, the local supervisor's Popen returncode, its own record)
ENDINGS = {
    "kill -9": ("Killed", -signal.SIGKILL, None),
    "segfault": ("Segmentation fault", -signal.SIGSEGV, None),
    "user's exception": ("Exited with exit code 1", 1, policy.USER),
    "ddpjob's exception": ("Exited with exit code 1", 1, policy.INTERNAL),
    "a peer gone": ("Exited with exit code 1", 1, policy.INFRASTRUCTURE),
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_the_slurm_and_local_deciders_agree(ending: str, fake_slurm, tmp_path: Path) -> None:
    srun_says, code, error_class = ENDINGS[ending]
    # SLURM: the batch shell's decision after srun failed, inside the allocation
    slurm_dir = _run(tmp_path, "slurm")
    fileio.append_jsonl(slurm_dir / "events.jsonl", {"event": "start", "job_id": "77", "restart": 0,
                                                    "time": 1.0, "source": "slurm"})
    if error_class:
        _rank_error(slurm_dir, "77", error_class)
    (slurm_dir / "logs").mkdir()
    (slurm_dir / "logs" / "batch-77.out").write_text(f"ddpjob: attempt 0: ranks on 1 node(s)\n"
                                                     f"srun: error: n1: task 1: {srun_says}\n")
    fake_slurm.answer("scontrol show job", "JobId=77 JobState=RUNNING Restarts=0 PreemptTime=None")
    env = ClusterEnv(source="slurm", job_id="77", restart_count=0, hosts=("n1",), num_nodes=1)
    cfg = jobfile.read_run_config(slurm_dir)
    requeue.after_crash(cfg, env, slurm_dir, 1 if code > 0 else 128 - code, in_place=True)
    # local: the supervisor saw rank 1 end with `code`
    local_dir = _run(tmp_path, "local")
    sup = local.Supervisor(local_dir, "local-1")
    fileio.append_jsonl(local_dir / "events.jsonl", {"event": "start", "job_id": "local-1", "restart": 0,
                                                    "time": 1.0, "source": "local"})
    if error_class:
        _rank_error(local_dir, "local-1", error_class)
    sup.first_bad = (1, code)
    sup.retry_crash([-signal.SIGKILL, code])
    slurm_stop, local_stop = (decisions(read_events(d))[-1]
                              for d in (slurm_dir, local_dir))
    assert slurm_stop["action"] == local_stop["action"], (slurm_stop, local_stop)
    assert slurm_stop.get("verdict") == local_stop.get("verdict") == (error_class or policy.INFRASTRUCTURE)
    retried = error_class in (None, policy.INFRASTRUCTURE)
    assert slurm_stop["action"] == (policy.RESTART if retried else policy.END)
    assert budget.used(read_events(slurm_dir), "77") == budget.used(read_events(local_dir), "local-1") == (
        (0, 1) if retried else (0, 0))
    assert crashes.HOST.fullmatch(str(slurm_stop["failed_host"]))


# How rank 0's checkpointed stop came about: (its stop code, a `ddpjob stop` asked first, the
# requeues the submission spent) -> whether the job comes back
STOPS = {
    "time limit": (preemption.REQUEUE, False, 0, True),  # the job's warning signal
    "preemption": (preemption.PREEMPTED, False, 0, True),  # while SLURM preempts the job
    "ddpjob stop": (preemption.REQUEUE, True, 0, False),
    "max_requeues spent": (preemption.REQUEUE, False, 2, False),
}


@pytest.mark.parametrize("case", list(STOPS))
def test_both_backends_bring_a_stopped_job_back_alike(case: str, fake_slurm, tmp_path: Path) -> None:
    """A stop with a checkpoint: rank 0 decides on both backends (rank/requeue.after_stop), the
    local supervisor carries out the verdict it recorded (launch/local.Supervisor.after_stop);
    the same facts give the same answer through the one policy."""
    from ddpjob.ledger import requests

    code, asked, spent, back = STOPS[case]
    dirs = {}
    for name, job_id in (("slurm", "77"), ("local", "local-1")):
        d = tmp_path / name
        d.mkdir()
        cfg = jobfile.from_dict({"name": "t", "slurm": {"max_requeues": 2}})
        fileio.write_text_atomic(d / "config.json", cfg.to_json())
        for n in range(spent):
            record_event(d, "stop", reason="preemption", job_id=job_id, restart=n, requeued=True,
                         requeued_by="scontrol")
        if asked:
            requests.ask_stop(d, job_id, spent)
        dirs[name] = d
    fake_slurm.answer("scontrol show job", "JobId=77 JobState=RUNNING PreemptTime=2026-01-01T00:00:00")
    fake_slurm.answer("scontrol requeue")
    env = ClusterEnv(source="slurm", job_id="77", restart_count=0)
    slurm_back = requeue.after_stop(jobfile.read_run_config(dirs["slurm"]), env, dirs["slurm"], code, 9,
                                    restart=spent)
    # the local run: rank 0 decides and records, then the supervisor reads what to carry out
    local_env = ClusterEnv(source="local", job_id="local-1", restart_count=spent)
    requeue.after_stop(jobfile.read_run_config(dirs["local"]), local_env, dirs["local"], code, 9, restart=spent)
    sup = local.Supervisor(dirs["local"], "local-1")
    sup.attempt = spent
    local_back = sup.after_stop().action == policy.REQUEUE
    assert (slurm_back is True) == local_back == back, (slurm_back, local_back)


def test_a_start_past_a_budget_is_refused_and_one_within_it_runs() -> None:
    """decide() retries only below a limit; a start past it (SLURM brought the job back by
    itself) is refused with the budget's line, at the limit it runs."""
    limits = policy.Limits(max_requeues=2, max_failures=3)
    assert policy.start_refused(2, 3, limits) is None
    assert policy.start_refused(3, 0, limits) == "3 requeues, more than slurm.max_requeues = 2"
    assert policy.start_refused(0, 4, limits) == "4 failure(s) retried, more than slurm.max_failures = 3"
    # the stop that spent the last requeue ends the run: no start past it by ddpjob's hand
    assert policy.decide(policy.Facts("time_limit", requeues=2), limits).action == policy.END
