"""What a user asks of a running job through its run dir: `ddpjob stop` (a checkpoint, then the
end, no requeue) and `ddpjob cancel` (the end, nothing brought back). Written by the login side, read by rank 0's requeue decision and by the local
supervisor, so both backends end the job the same way; no torch here."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ddpjob.ledger import events

STOP = "stop_request"
CANCEL = "cancel"  # recorded by `ddpjob cancel` before its scancel


def ask_stop(run_dir: Path, job_id: str, restart: int) -> None:
    events.record(run_dir, STOP, by="user", job_id=job_id, restart=restart)


def stop_requested(run_dir: Path, job_id: str | None) -> bool:
    """Whether `ddpjob stop` asked this job to end and no stop of the job has answered it yet
    (an answered one does not hold a later attempt, which was resumed on purpose; a request made
    while the ranks were still starting holds)."""
    if not job_id:
        return False
    asked = False
    for e in events.read(run_dir):
        if str(e.get("job_id")) != str(job_id):
            continue
        if e.get("event") == STOP:
            asked = True
        elif events.is_decision(e) or e.get("event") == "local_end":
            asked = False
    return asked


def cancel(run_dir: Path, job_id: str, restart: int) -> None:
    events.record(run_dir, CANCEL, by="user", job_id=job_id, restart=restart)


def cancelled(evs: Iterable[dict[str, Any]], job_id: Any) -> bool:
    """Whether `ddpjob cancel` was recorded for this job: every decision about it then ends it
    (policy.Facts.cancelled). A later `ddpjob resume` is another job, which it does not hold."""
    return bool(job_id) and any(e.get("event") == CANCEL and str(e.get("job_id")) == str(job_id) for e in evs)
