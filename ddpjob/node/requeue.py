"""The requeue decision, made once, by rank 0, after every rank stopped at the same step with a
checkpoint written (api.Job.steps).

SLURM requeues by itself only a job that outlives GraceTime after a preemption, or one that
`scontrol requeue` was run on. So: a stop asked for by the time-limit signal (or the deadline
watch) runs `scontrol requeue`; so does a SIGTERM while SLURM is preempting the job (we stopped
within GraceTime, and 22.05 would end it FAILED), but not a plain scancel, and never twice.
"""

from __future__ import annotations

from pathlib import Path

from ddpjob import console, rundir
from ddpjob.node import preemption
from ddpjob.node.cluster import ClusterEnv
from ddpjob.config import JobConfig


def after_stop(cfg: JobConfig, env: ClusterEnv, run_dir: Path, code: int, step: int) -> bool | None:
    """Rank 0: record the stop and, where nobody else will, requeue the job. Returns whether it
    requeued (None: it was not asked to)."""
    reason = preemption.REASONS[code]
    under_slurm = env.source in ("slurm", "torchrun") and bool(env.job_id)
    requeued = None
    note = ""
    if code in (preemption.REQUEUE, preemption.DEADLINE) and under_slurm:
        if not cfg.slurm.requeue:
            note = "slurm.requeue = false: not requeueing"
        elif env.restart_count >= cfg.slurm.max_requeues:
            note = f"max_requeues = {cfg.slurm.max_requeues} reached: not requeueing"
        else:
            failure = preemption.requeue(str(env.job_id))
            requeued = failure is None
            note = f"requeued job {env.job_id}" if requeued else str(failure)
    elif code == preemption.PREEMPTED and under_slurm:
        if not preemption.being_preempted(str(env.job_id)):
            note = "not being preempted (scancel, or already requeued): not requeueing"
        elif not cfg.slurm.requeue or env.restart_count >= cfg.slurm.max_requeues:
            note = "preempted, but slurm.requeue is off or max_requeues is reached: not requeueing"
        else:
            failure = preemption.requeue(str(env.job_id))
            requeued = failure is None
            note = (f"preempted within GraceTime: requeued job {env.job_id}" if requeued
                    else str(failure))
    rundir.record_event(run_dir, "stop", reason=reason, step=step, job_id=env.job_id,
                        restart=env.restart_count, requeued=requeued, note=note or None)
    console.print0(f"ddpjob: stopped at step {step} ({reason}); checkpoint written"
                   + (f"; {note}" if note else ""))
    return requeued
