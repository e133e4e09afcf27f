"""ledger/recovery.py's stop for a requeue (decide_stop), on a run dir's ledger written here: a
time limit with requeues left is requeued, max_requeues spent ends it, a `ddpjob stop` or a
recorded `ddpjob cancel` is never requeued. The callers' sides (rank 0 under the fake SLURM,
the local supervisor) are in tests/unit/test_requeue.py and tests/ranks/test_preemption_local.py."""

from __future__ import annotations

from pathlib import Path

from ddpjob import jobfile
from ddpjob.ledger import policy, recovery, requests
from ddpjob.ledger.events import read as read_events, record

JOB = "77"
CFG = jobfile.from_dict({"name": "t", "slurm": {"max_requeues": 2}})


def requeued(run: Path, restart: int, reason: str = "time_limit") -> None:
    """A decision that brought the job back (rank 0's stop record after `scontrol requeue`)."""
    record(run, "stop", reason=reason, step=10 * (restart + 1), job_id=JOB, restart=restart,
           requeued=True, requeued_by="scontrol", action=policy.REQUEUE)


def test_a_time_limit_with_requeues_left_is_requeued(tmp_path: Path) -> None:
    stop = recovery.decide_stop(CFG, tmp_path, read_events(tmp_path), JOB, "time_limit")
    assert stop.retry and stop.verdict.action == policy.REQUEUE
    assert stop.verdict.line == "requeueing (time limit, requeue 1 of max_requeues = 2)"
    assert (stop.facts.requeues, stop.facts.failures, stop.facts.run) == (0, 0, str(tmp_path))
    requeued(tmp_path, 0)
    stop = recovery.decide_stop(CFG, tmp_path, read_events(tmp_path), JOB, "preemption")
    assert stop.retry and stop.verdict.line == "requeueing (preemption, requeue 2 of max_requeues = 2)"
    # another submission's requeues are not this one's
    assert recovery.decide_stop(CFG, tmp_path, read_events(tmp_path), "78", "time_limit").facts.requeues == 0


def test_max_requeues_spent_ends_it(tmp_path: Path) -> None:
    requeued(tmp_path, 0)
    requeued(tmp_path, 1, "preemption")
    stop = recovery.decide_stop(CFG, tmp_path, read_events(tmp_path), JOB, "time_limit")
    assert not stop.retry and stop.verdict.action == policy.END
    assert stop.facts.requeues == 2
    assert stop.verdict.line == "max_requeues = 2 reached: not requeueing"
    # slurm.requeue = false: never requeued
    off = jobfile.from_dict({"name": "t", "slurm": {"requeue": False}})
    assert recovery.decide_stop(off, tmp_path, [], JOB, "time_limit").verdict.line == \
        "slurm.requeue = false: not requeueing"


def test_a_ddpjob_stop_is_not_requeued(tmp_path: Path) -> None:
    # rank 0 said it as what it is: user_stop
    stop = recovery.decide_stop(CFG, tmp_path, read_events(tmp_path), JOB, "user_stop")
    assert not stop.retry and "stopped by `ddpjob stop`" in stop.verdict.line
    # a request not yet answered holds a time limit's stop too
    requests.ask_stop(tmp_path, JOB, 0)
    stop = recovery.decide_stop(CFG, tmp_path, read_events(tmp_path), JOB, "time_limit")
    assert stop.facts.stop_requested and not stop.retry
    assert stop.verdict.line == "stopped by `ddpjob stop`: not requeueing (`ddpjob resume RUN_DIR` continues)"
    # answered by a decision: a later attempt, resumed on purpose, is requeued again
    requeued(tmp_path, 0)
    assert recovery.decide_stop(CFG, tmp_path, read_events(tmp_path), JOB, "time_limit").retry


def test_a_recorded_cancel_is_not_requeued(tmp_path: Path) -> None:
    requests.cancel(tmp_path, JOB, 0)  # what `ddpjob cancel` records before its scancel
    stop = recovery.decide_stop(CFG, tmp_path, read_events(tmp_path), JOB, "preemption")
    assert stop.facts.cancelled and not stop.retry
    assert stop.verdict.line.startswith("cancelled by `ddpjob cancel`: not requeued")
    # the cancel is read from the events passed in, and holds this job only
    assert recovery.decide_stop(CFG, tmp_path, [], JOB, "preemption").retry
    assert recovery.decide_stop(CFG, tmp_path, read_events(tmp_path), "78", "preemption").retry
