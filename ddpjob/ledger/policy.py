"""The one crash and requeue policy: the facts of how an attempt ended in, one verdict out.

Pure: no files, no SLURM, no clock. Rank 0 (a stop with a checkpoint: rank/requeue.after_stop),
the batch shell's decision after srun failed (rank/requeue.after_crash, both SLURM paths) and the
local supervisor (launch/local.py) gather the facts from the run's ledger and carry the verdict
out: `scontrol requeue` or a successor job, srun again inside the allocation, Popen again, or
the end. tests/unit/test_policy.py holds the table of every combination.

Why crashes are sorted (docs/failures.md): retrying a bug in the user's code wastes the
allocation and hides the bug; retrying what the cluster broke (a rank killed by a signal, a lost
node, a peer gone, a stall the hang watch ended) costs seconds from the newest in-memory snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Verdicts: what happens next
REQUEUE = "requeue"  # the job goes back to the queue (SLURM) / the supervisor starts the ranks again
RESTART = "restart"  # the ranks run again inside the allocation, now
END = "end"  # the run ends here (FAILED, STOPPED, CANCELLED: the caller knows which)

# What stopped an attempt (events.jsonl's `reason`)
STOPS = ("preemption", "time_limit")  # announced: a checkpoint was written, a requeue spends max_requeues
FAILURES = ("crash", "node_failure")  # spend max_failures
USER_STOP = "user_stop"  # `ddpjob stop` sent the checkpoint signal: the end, STOPPED (not FAILED)
# a rank the straggler watch named ([slurm] on_straggler): every rank stopped with a checkpoint;
# restarted in place without its host (spends nothing), or requeued without it (a requeue)
STRAGGLER = "straggler"

# Crash classes: who broke it (the verdict's `verdict` field)
INFRASTRUCTURE = "infrastructure"  # a signal killed a rank, a node was lost, a peer died, a stall
USER = "user"  # an exception raised in the user's code (or the user's setting ddpjob refused)
TRANSIENT = "transient"  # the user's code met a passing I/O failure (a shared file system's EIO)
INTERNAL = "internal"  # an exception inside ddpjob: ddpjob's own bug
CLASSES = (INFRASTRUCTURE, USER, TRANSIENT, INTERNAL)


@dataclass(frozen=True)
class Limits:
    """The job file's [slurm] budgets and switches."""

    requeue: bool = True
    max_requeues: int = 20
    max_failures: int = 20
    max_no_progress: int = 3
    retry_user_errors: bool = False

    @classmethod
    def of(cls, cfg: Any) -> Limits:
        s = cfg.slurm
        return cls(s.requeue, s.max_requeues, s.max_failures, s.max_no_progress, s.retry_user_errors)


@dataclass(frozen=True)
class Facts:
    """How an attempt ended, as the ledger and the decider saw it."""

    reason: str  # preemption, time_limit, signal, user_stop, crash, node_failure
    crash: str | None = None  # for a crash: one of CLASSES (None: not a crash)
    what: str = ""  # the crash in words: "rank 1 on n2: killed by SIGKILL", "RuntimeError at train.py:291"
    stop_requested: bool = False  # `ddpjob stop` asked, and no stop answered it yet
    requeues: int = 0  # spent in this submission (ledger/budget.py)
    failures: int = 0
    streak: int = 0  # attempts in a row, this one included, that crashed without progress
    again: bool = False  # the same failure at the same step (and line) as the crash before, no progress
    here: bool = False  # the decider still holds the allocation: a retry runs the ranks again now
    hosts_left: bool = True  # after the quarantine, a node is left to restart on
    resume_at: int | None = None  # the step a retry resumes from (the newest snapshot or checkpoint)
    steps_lost: int | None = None  # steps trained past it
    from_snapshot: bool = False  # resume_at is an in-memory snapshot's
    run: str = "RUN"  # the run dir, for the lines' hints
    signal: str | None = None  # the signal that killed the culprit ("SIGKILL"), where one did
    where: str | None = None  # the user's file:line of the exception, where one was raised
    # `again` on the same host, where the decider can leave a host out (crashes.excluded): a
    # bad host's to answer for (the quarantine), not a loop of the job's own
    quarantine: bool = False
    own_checkpoint: bool = False  # a [train] command: it resumes from its own checkpoint (resume_at: its newest step)
    # `ddpjob cancel` was recorded for this job. SLURM 22.05 takes `scontrol requeue` of a job
    # still COMPLETING after its scancel and runs it again; so the policy, not SLURM, says no
    cancelled: bool = False
    # a command that logs no steps, its attempt judged by other evidence (ledger/progress.py):
    # what showed that it got nowhere ("its last line of output"), for the loop lines
    evidence: str = ""
    leave_out: str = ""  # a straggler's stop: the host the next start leaves out


@dataclass(frozen=True)
class Verdict:
    action: str  # REQUEUE, RESTART, END
    line: str  # what happens next, in one line ("restarting in place from the snapshot of step 238 ...")
    crash: str | None = None  # the crash's class, where there was one
    error: bool = False  # a crash loop, or no node left: its line is an error line
    asked: bool = False  # the end `ddpjob stop` asked for: the run ends STOPPED, not FAILED

    def fields(self) -> dict[str, Any]:
        """For the decision's stop record (events.jsonl)."""
        return {"action": self.action, **({"verdict": self.crash, "line": self.line} if self.crash else {}),
                **({"asked": True} if self.asked else {})}


_STOPPED = "stopped by `ddpjob stop`: not requeueing (`ddpjob resume RUN_DIR` continues)"


def _resumes(f: Facts) -> str:
    if f.own_checkpoint:
        return "from the command's own checkpoint" + ("" if f.resume_at is None else f" (it had logged step {f.resume_at})")
    if f.resume_at is None:
        return "from the newest checkpoint"
    where = "the snapshot" if f.from_snapshot else "the checkpoint"
    src = f"from {where} of step {f.resume_at}" if f.resume_at else "from the start (no checkpoint yet)"
    return src + ("" if f.steps_lost is None else f" ({f.steps_lost} steps lost)")


def decide(f: Facts, limits: Limits) -> Verdict:
    """The verdict for an attempt that ended as `f` says."""
    if f.cancelled:
        return Verdict(END, "cancelled by `ddpjob cancel`: not requeued, not restarted "
                            "(`ddpjob resume RUN_DIR` continues)", f.crash)
    if f.reason not in (*STOPS, *FAILURES, STRAGGLER):
        # `ddpjob stop`, a plain scancel / `ddpjob cancel`, or a signal that is not SLURM's
        if f.reason == USER_STOP:
            return Verdict(END, _STOPPED, asked=True)
        # SIGTERM while SLURM was not preempting the job (rank/requeue.after_stop asked scontrol)
        return Verdict(END, "not being preempted (scancel, or already requeued): not requeueing")
    if f.stop_requested:
        return Verdict(END, _STOPPED, f.crash, asked=True)
    if not limits.requeue:
        return Verdict(END, "slurm.requeue = false: not requeueing", f.crash)
    if f.reason == STRAGGLER:
        return _straggler(f, limits)
    if f.reason in STOPS:
        if f.requeues >= limits.max_requeues:
            return Verdict(END, f"max_requeues = {limits.max_requeues} reached: not requeueing")
        return Verdict(REQUEUE, f"requeueing ({f.reason.replace('_', ' ')}, requeue {f.requeues + 1} of "
                                f"max_requeues = {limits.max_requeues})")
    return _crash(f, limits)


def _straggler(f: Facts, limits: Limits) -> Verdict:
    """A straggler's stop (`what`: who, why, by how much): in place (`here`, the batch shell's
    restart loop) without its host, spending nothing; else a requeue without it."""
    if f.here:
        return Verdict(RESTART, f"{f.what}: restarting in place without {f.leave_out} {_resumes(f)}")
    if f.requeues >= limits.max_requeues:
        return Verdict(END, f"{f.what}: max_requeues = {limits.max_requeues} reached: not requeueing")
    return Verdict(REQUEUE, f"{f.what}: requeueing without {f.leave_out} {_resumes(f)} (requeue "
                            f"{f.requeues + 1} of max_requeues = {limits.max_requeues})")


def _crash(f: Facts, limits: Limits) -> Verdict:
    kind = f.crash or INFRASTRUCTURE
    fix = f"fix it, then `ddpjob resume {f.run}`"
    if kind == INTERNAL:
        return Verdict(END, f"not retried: {f.what or 'an exception'} is an internal error of ddpjob; "
                            f"please report it with the rank's log, then `ddpjob resume {f.run}`", kind)
    if kind == USER and not limits.retry_user_errors:
        return Verdict(END, f"not retried: {f.what or 'the exception'} is the code's own; {fix} "
                            "(slurm.retry_user_errors = true retries it)", kind)
    if kind == TRANSIENT and f.again:
        return Verdict(END, f"not retried: {f.what or 'the I/O error'} came again at the same step and line; "
                            f"it is not passing: {fix}", kind)
    if f.again and kind == INFRASTRUCTURE and f.signal == "SIGKILL" and not f.quarantine:
        where = f"at the same point ({f.evidence} unchanged)" if f.evidence else "at the same step"
        lower = ("Lower the program's batch size (its own arguments in train.command)" if f.own_checkpoint
                 else "Lower train.batch_size")
        return Verdict(END, f"crash loop: {f.what} again {where}: likely the kernel's OOM killer "
                            f"on the job's own memory, not the host; not retrying. {lower} or "
                            "ask for more memory ([slurm] mem)", kind, error=True)
    if f.streak >= limits.max_no_progress:
        if f.evidence:
            point = f"getting anywhere ({f.evidence} unchanged)"
        else:
            died = "" if f.steps_lost is None else f", the last after step {(f.resume_at or 0) + f.steps_lost}"
            point = f"getting past the checkpoint at step {f.resume_at or 0}{died}"
        return Verdict(END, f"crash loop: {f.streak} attempts in a row crashed without {point}"
                            f"{f' ({f.what})' if f.what else ''}; "
                            f"not retrying (slurm.max_no_progress = {limits.max_no_progress})", kind, error=True)
    if f.failures >= limits.max_failures:
        return Verdict(END, f"max_failures = {limits.max_failures} reached: not retrying", kind)
    if f.here and not f.hosts_left:
        return Verdict(END, "every node of the allocation is excluded after failing, expected one left to "
                            f"restart on. Hint: `ddpjob resume {f.run}` submits the run again on other nodes",
                       kind, error=True)
    budget = f"failure {f.failures + 1} of max_failures = {limits.max_failures}"
    if f.here:
        return Verdict(RESTART, f"restarting in place {_resumes(f)}; {budget}", kind)
    return Verdict(REQUEUE, f"requeueing {_resumes(f)}; {budget}", kind)


def start_refused(requeues: int, failures: int, limits: Limits) -> str | None:
    """Why a start of the job must not run (None: it may), from the budgets its submission spent.
    Every verdict of decide() keeps within them (a retry only below the limit), so a start past
    one was SLURM's own doing: it brings a job back by itself (after GraceTime, after a node
    failure) without asking ddpjob, and the start is where ddpjob sees it."""
    if requeues > limits.max_requeues:
        return f"{requeues} requeues, more than slurm.max_requeues = {limits.max_requeues}"
    if failures > limits.max_failures:
        return f"{failures} failure(s) retried, more than slurm.max_failures = {limits.max_failures}"
    return None


def said(verdict: Verdict, f: Facts, logs: str) -> str:
    """The one line a crash's verdict gets in the job's log (and, as the stop's note, in status),
    whoever decided it: who broke it, then what happens next. `logs`: the folder of the rank logs,
    which an error line's hint points to."""
    if verdict.error:
        hint = "" if " Hint: " in verdict.line else (
            f". Hint: the rank logs in {logs} say why; fix it and `ddpjob resume {f.run}`")
        return f"ddpjob: error: {verdict.line}{hint}"
    return f"ddpjob: crash verdict: {verdict.crash or f.crash} ({f.what}): {verdict.line}"

