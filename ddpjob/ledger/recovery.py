"""A crash's or a stop's recovery, one procedure for every decider: gather the facts from the
run's ledger, ask the one policy (policy.decide), and, for a crash, write the one decision record.

A crash (settle: decide, carry out, record, say): the batch shell after srun failed
(rank/requeue.after_crash), the local supervisor (launch/local.Supervisor.retry_crash) and the
next round of a torchrun (rank/rounds.py) differ only in what they saw (srun's line, an exit code,
nothing), whether they still hold the ranks' machines (`here`) and how they carry the verdict out
(srun again, Popen again, the round going on: carried_here; `scontrol requeue`; the end).

A stop (decide_stop: every rank stopped for a requeue, after a time limit, a preemption or
`ddpjob stop`): rank 0 (rank/requeue.after_stop, which writes the stop record with its own
fields) and the local supervisor (launch/local.Supervisor.after_stop, from rank 0's record's
reason) differ only in how they carry the verdict out (`scontrol requeue` or a successor job;
Popen again; the end).

Torch-free and free of the store: the caller passes what its snapshots hold (`saved`), read
with store/memsnap.newest_saved on the machine that has them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpjob import commandpaths
from ddpjob.config import JobConfig
from ddpjob.ledger import budget, crashes, events, policy, progress, requests


@dataclass(frozen=True)
class Stop:
    """A stop for a requeue decided: the facts the policy read and its verdict."""

    facts: policy.Facts
    verdict: policy.Verdict

    @property
    def retry(self) -> bool:
        return self.verdict.action != policy.END


@dataclass(frozen=True)
class Crash(Stop):
    """A crash decided: a Stop's facts and verdict, and the decision record's fields that come
    from them (the resume point, its evidence, the culprit, the verdict)."""

    fields: dict[str, Any] = field(default_factory=dict)

    def line(self, run_dir: Path) -> str:
        """The verdict's one line for the job's log (policy.said)."""
        return policy.said(self.verdict, self.facts, str(run_dir / "logs"))


def decide(cfg: JobConfig, run_dir: Path, evs: Sequence[dict[str, Any]], job_id: Any, restart: int,
           culprit: crashes.Culprit | None, *, here: bool, saved: tuple[int | None, bool] = (None, False),
           lost_hosts: Sequence[str] = (), hosts_left: bool = True, exclude_after: int = 0) -> Crash:
    """The verdict on attempt (job_id, restart), ended by a crash. `culprit`: who the decider saw
    fail (None: nobody named); `here`: the decider still holds the machines, so a retry runs the
    ranks again now; `saved`: (the newest step the ranks' snapshots or checkpoints hold, whether
    a snapshot's) from store/memsnap.newest_saved, for a run on ddpjob's own checkpoints. A
    [train] command resumes from its own checkpoint: its progress is what ddpjob saw of it."""
    culprit = crashes.with_rank_error(culprit, list(evs), job_id, restart)
    if cfg.train.command:
        at = progress.point(run_dir, evs, job_id, restart, culprit_rank=culprit.rank if culprit else None,
                            progress_path=commandpaths.progress_path(cfg, run_dir, restart))
        point, point_fields = at.facts(), at.fields()
    else:
        resume_at, lost = crashes.resume_point(run_dir, saved[0])
        point, point_fields = {"resume_at": resume_at, "steps_lost": lost, "from_snapshot": saved[1]}, {}
    facts = crashes.facts(list(evs), job_id, restart, culprit, **point, here=here, hosts_left=hosts_left,
                          lost_hosts=lost_hosts, run=str(run_dir),
                          stop_requested=requests.stop_requested(run_dir, job_id), exclude_after=exclude_after)
    verdict = policy.decide(facts, policy.Limits.of(cfg))
    fields = {"reason": facts.reason, "step": facts.resume_at, "steps_lost": facts.steps_lost,
              "no_progress": facts.streak, **point_fields, **({"lost_hosts": list(lost_hosts)} if lost_hosts else {}),
              **({"where": facts.where} if facts.where else {}), **(culprit.fields() if culprit else {}),
              **verdict.fields()}
    return Crash(facts, verdict, fields)


def decide_stop(cfg: JobConfig, run_dir: Path, evs: Sequence[dict[str, Any]], job_id: Any, reason: str,
                **straggler: Any) -> Stop:
    """The verdict on job `job_id`'s stop for `reason` (policy.STOPS: a time limit, a preemption;
    "user_stop", "signal": the end; policy.STRAGGLER, with `straggler`'s facts: what, leave_out,
    here, resume_at): the requeues and failures its submission spent (ledger/budget.py), whether
    `ddpjob stop` asked (requests.stop_requested, read from the run dir) and whether `ddpjob
    cancel` was recorded (in `evs`)."""
    requeues, failures = budget.used(evs, job_id)
    facts = policy.Facts(reason, stop_requested=requests.stop_requested(run_dir, job_id), requeues=requeues,
                         failures=failures, run=str(run_dir), cancelled=requests.cancelled(evs, job_id), **straggler)
    return Stop(facts, policy.decide(facts, policy.Limits.of(cfg)))


def record(run_dir: Path, crash: Crash, *, job_id: Any, restart: int, **how: Any) -> None:
    """The decision record of `crash` (events.jsonl: a `stop` without `rank`), with how the
    decider carried it out (`requeued`, `requeued_by`, `note`, `source`, ...): its fields win."""
    fields = {**crash.fields, **how}
    events.decision(run_dir, fields.pop("reason"), job_id=job_id, restart=restart, **fields)


def settle(cfg: JobConfig, run_dir: Path, evs: Sequence[dict[str, Any]], job_id: Any, restart: int,
           culprit: crashes.Culprit | None, carry_out: Callable[[Crash], dict[str, Any]],
           say: Callable[[str], None], **seen: Any) -> tuple[Crash, dict[str, Any]]:
    """The one procedure after a crash, whoever saw it (the batch shell, the local supervisor,
    torchrun's next round): decide (`seen`: decide's facts beyond the ledger), carry the verdict
    out (`carry_out`: the backend's own way; it returns the record's fields of how), record the
    decision, say its line (`say`: the decider's log). Returns the crash and how it was carried out."""
    crash = decide(cfg, run_dir, evs, job_id, restart, culprit, **seen)
    how = carry_out(crash)
    record(run_dir, crash, job_id=job_id, restart=restart, **how)
    say(crash.line(run_dir))
    return crash, how


def carried_here(verdict: policy.Verdict, by: str, why: str | None = None) -> dict[str, Any]:
    """The record's fields of a verdict its decider carries out where it stands, the ranks' own
    machines: a retry starts them again there (`by`: budget.IN_PLACE, SUPERVISOR, TORCHRUN), an
    end needs nothing. `why`: what the decider saw, said before the verdict's line."""
    done = {"requeued": True, "requeued_by": by} if verdict.action != policy.END else {"requeued": None}
    return {**done, "note": "; ".join(x for x in (why, verdict.line) if x), **verdict.fields()}
