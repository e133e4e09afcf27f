"""What a submission has spent of its budgets: requeues ([slurm] max_requeues: preemptions and
time limits) and failures ([slurm] max_failures: crashes and lost nodes retried). Counted from the
decisions in events.jsonl over the submission's job chain (the job and the successors it
submitted): a new submission of the run (`ddpjob resume`) starts with fresh budgets, and SLURM's
own restart count (which starts at 0 again in a successor) is never needed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ddpjob.ledger import events
from ddpjob.ledger.policy import FAILURES  # spend max_failures; every other requeue spends max_requeues

IN_PLACE = "in_allocation"  # requeued_by of a crash whose ranks ran again inside the allocation
SUPERVISOR = "supervisor"  # requeued_by of the local supervisor's restarts
TORCHRUN = "torchrun"  # requeued_by of a crash whose ranks torchrun's agent started again (rank/rounds.py)


def job_chain(evs: Iterable[Mapping[str, Any]], job_id: Any) -> set[str]:
    """The job and the jobs it succeeds: what a submission's budgets and crash ledger count over."""
    evs = list(evs)
    chain, cur = {str(job_id)}, str(job_id)
    while prev := next((str(e.get("job_id")) for e in evs if e.get("requeued_by") == "successor"
                        and str(e.get("next_job_id")) == cur and str(e.get("job_id")) not in chain), None):
        chain, cur = chain | {prev}, prev
    return chain


def used(evs: Iterable[Mapping[str, Any]], job_id: Any) -> tuple[int, int]:
    """(requeues, failures) the submission of `job_id` has spent: every decision of its chain that
    brought the job back (a requeue, a successor, SLURM's own requeue, a restart in place, the
    local supervisor's restart after a stop or a crash)."""
    evs = list(evs)
    chain = job_chain(evs, job_id)
    requeues = failures = 0
    for e in evs:
        if str(e.get("job_id")) not in chain:
            continue
        if events.is_decision(e) and e.get("requeued") is True:
            if e.get("reason") == "straggler" and e.get("requeued_by") == IN_PLACE:
                continue  # a straggler left out inside the allocation: nothing failed, nothing queued
            if e.get("reason") in FAILURES:
                failures += 1
            else:
                requeues += 1
    return requeues, failures
