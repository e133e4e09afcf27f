"""At every start of an attempt, rank 0 (and a [train] command's rank 0) before the first step:
the stops nobody recorded (record_unseen), this attempt's number (attempt_of) and the budgets
(check_start). SLURM brings a job back by itself (after GraceTime, after a node failure) without
asking ddpjob, so an attempt that ended where no ddpjob code ran is found here and recorded from
sacct, and the budgets are checked again before the ranks train. The decisions at a stop or a
crash are requeue.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddpjob import console, slurm
from ddpjob.config import JobConfig
from ddpjob.ledger import attempts, budget, crashes, events, policy
from ddpjob.node.cluster import ClusterEnv
from ddpjob.rank import rounds
from ddpjob.store import memsnap


# How sacct's state of an attempt that ended unseen maps to the ledger's reasons.
UNSEEN = {"NODE_FAIL": "node_failure", "PREEMPTED": "preemption", "TIMEOUT": "time_limit",
          "FAILED": "crash", "OUT_OF_MEMORY": "crash", "BOOT_FAIL": "node_failure",
          "CANCELLED": "signal", "REQUEUED": "requeue", "DEADLINE": "time_limit"}


def record_unseen(run_dir: Path, job_id: str | None, *, command: bool = False) -> list[dict[str, Any]]:
    """Rank 0 at a start: the stops nobody recorded. An attempt that started and has no stop
    ended where no ddpjob code ran: its node failed (SLURM requeues a --requeue job by itself),
    SIGKILL after GraceTime, the OOM killer. sacct says how each ended; the stop is recorded
    now so the budgets count it (a node failure spends max_failures, not max_requeues) and
    status/plot show it. Returns the records written."""
    evs = events.read(run_dir)
    seen = {(str(e.get("job_id")), e.get("restart")) for e in evs
            if events.is_decision(e)}
    # an attempt's first record: the loop's start, or a [train] command's launch (a program that
    # logs no steps gets no start record before it ends: killed after GraceTime, it has only that)
    firsts: dict[tuple[str, Any], dict[str, Any]] = {}
    for e in evs:
        if e.get("event") in ("start", "launch") and e.get("source") in ("slurm", "torchrun"):
            firsts.setdefault((str(e.get("job_id")), e.get("restart")), e)
    unseen = [e for key, e in firsts.items() if key not in seen and slurm.JOB_ID.fullmatch(key[0])]
    written: list[dict[str, Any]] = []
    for start in unseen:
        old = str(start["job_id"])
        reason = "killed"
        fields: dict[str, Any] = {"unseen": True}
        runs = slurm.incarnations(old)
        if isinstance(runs, slurm.Failed):
            fields["note"] = f"no stop was recorded and sacct did not answer ({runs.why})"
        else:
            # The attempt is the last sacct start before its start event (sacct keeps seconds).
            t = float(start.get("time") or 0)
            match = [r for r in runs if r.start is not None and r.start <= t + 1]
            if match:
                reason = UNSEEN.get(match[-1].state, "killed")
                fields["signal_time"] = match[-1].end  # when it ended: the ledger times from it
                fields["note"] = f"no stop was recorded; sacct says {match[-1].state}"
            else:
                fields["note"] = "no stop was recorded and sacct does not list that start"
        if old == str(job_id):  # the same job started again: SLURM requeued it by itself
            fields.update(requeued=True, requeued_by="slurm")
        else:
            fields["requeued"] = False
        # a [train] command resumes from its own checkpoint: what its lines said of it
        fields["step"], fields["steps_lost"] = crashes.command_point(run_dir) if command else \
            crashes.resume_point(run_dir, memsnap.newest_saved(run_dir, None)[0])
        written.append(events.decision(run_dir, reason, job_id=old, restart=start.get("restart"), **fields))
    return written


def attempt_of(env: ClusterEnv, evs: list[dict[str, Any]], *, starting: bool = False) -> int:
    """This rank's attempt number (ledger/attempts.py): the one the local supervisor took for its
    ranks (DDPJOB_RESTART_COUNT), else the job's current one in the run's ledger (every rank
    reads the same: rank 0 decides it under the run lock at the start and broadcasts it)."""
    if "DDPJOB_RESTART_COUNT" in env.ddpjob_vars:
        return env.restart_count
    return attempts.current(evs, env.job_id, starting=starting)


def check_start(cfg: JobConfig, env: ClusterEnv, run_dir: Path) -> tuple[int, str | None]:
    """Rank 0 at a start: (this start's restart number within the run, why it must not run or
    None). The budgets are checked here too because SLURM brings a job back by itself (after
    GraceTime, after a node failure) without asking ddpjob."""
    if env.source in ("slurm", "torchrun") and slurm.JOB_ID.fullmatch(str(env.job_id)):
        for rec in record_unseen(run_dir, env.job_id, command=bool(cfg.train.command)):
            console.print0(f"ddpjob: the previous attempt ended unseen: {rec['reason']} ({rec['note']})")
    # torchrun's agent started the ranks again after a round failed: that round's verdict
    why = rounds.decide_unseen(cfg, env, run_dir) if env.source == "torchrun" else None
    evs = events.read(run_dir)  # after the unseen ends are on record: this attempt is a new one
    restart = attempt_of(env, evs, starting=True)
    if why is None:
        why = policy.start_refused(*budget.used(evs, env.job_id), policy.Limits.of(cfg))
    if why:
        events.decision(run_dir, "budget", job_id=env.job_id, restart=restart, step=None,
                        incarnation=env.restart_count, requeued=None, note=why)
    return restart, why
