"""What one rank's step loop leaves on record and says, for the Job (job.py): the attempt's start
and first step, each checkpoint's hold on the loop, the stop with its requeue decision
(StopForRequeue), the signal that reached the rank, the finish and the exit (events.jsonl; the
recovery's phases and the goodput ledger read them: ledger/phases.py, ledger/goodput.py). The Job
decides when; this says what, so that `Job.steps()` reads as the loop alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddpjob import console, exitcodes
from ddpjob.config import JobConfig
from ddpjob.ledger import events, requests
from ddpjob.node.cluster import ClusterEnv
from ddpjob.rank.usertable import UserTable


class StopForRequeue(SystemExit):
    """Raised out of `job.steps()` once every rank agreed to stop and the checkpoint is written:
    the process ends with exitcodes.REQUEUE (3), or exitcodes.RESTART (4) for a straggler's
    exclusion ([slurm] on_straggler = "exclude"), which the batch shell's restart loop runs again
    without its host. A SystemExit, so `except Exception` in user code lets it through and
    `finally` blocks still run."""

    def __init__(self, step: int, code: int = exitcodes.REQUEUE) -> None:
        super().__init__(code)
        self.step, self.status = step, code


class LoopEvents:
    """One rank's records and lines around the loop. Rank 0 writes the run's records; every
    rank its own signal record. `stop`: the rank's stop flag (node/preemption.py); `control`: the
    control group's collectives (dist.Control)."""

    def __init__(self, cfg: JobConfig, env: ClusterEnv, run_dir: Path, stop: Any, control: Any,
                 user: UserTable, *, restart: int) -> None:
        self._cfg, self._env, self._run_dir, self._stop, self._control = cfg, env, run_dir, stop, control
        self._user, self._restart = user, restart
        self._checked_user = False  # the [user] keys never read: said once, before the first checkpoint
        self._first_step = False  # rank 0 records when the first step of this attempt ends (started())
        self.snapshot_s = 0.0  # the in-memory snapshots' hold on the loop since the last checkpoint record
        self._signalled = ""  # the signal this rank had when its stop was decided (signal())

    def _record(self, kind: str, **fields: Any) -> None:
        events.record(self._run_dir, kind, job_id=self._env.job_id, restart=self._restart, **fields)

    def started(self, step: int, load_s: float | None, info: dict[str, Any]) -> None:
        """Rank 0: this attempt's start record, as the loop begins at `step`."""
        self._first_step = self._env.is_rank0  # each loop's first step is recorded as it ends
        if not self._env.is_rank0:
            return
        from ddpjob.node import warmserver
        from ddpjob.node.cluster import process_started

        env = self._env
        if warmserver.FORKED in env.ddpjob_vars:  # forked by the node's warm-start server
            info = {"warm": True, **info}
        self._record("start", world_size=env.world_size, source=env.source, host=env.hostname,
                     resumed_step=step or None, launched_time=process_started(), load_s=load_s, **info)

    def stepped(self, step: int) -> None:
        """After each step: the first one of this attempt ends the recovery's last phase
        (ledger/phases.py)."""
        if not self._first_step:
            return
        from ddpjob.node import compilecache

        graphs = compilecache.graphs()  # torch.compile's work is in this first step
        self._record("first_step", step=step, **({"graphs": graphs} if graphs else {}))
        self._first_step = False

    def before_checkpoint(self) -> None:
        """Rank 0, before the first checkpoint: the [user] keys the script has not read by now
        change nothing (a typo trains at the script's default), said while there is time to stop."""
        if self._checked_user or not self._env.is_rank0:
            return
        self._checked_user = True
        from ddpjob.rank import checks

        line = checks.unread_user_keys(dict.keys(self._user), self._user.read)
        if line:
            console.warn(line)

    def checkpoint(self, step: int, block_s: float) -> None:
        """Rank 0, after a save: how long it held the loop, and the in-memory snapshots' hold
        since the last record (the goodput ledger, ledger/goodput.py). One line per checkpoint,
        nothing per step."""
        if self._env.is_rank0:
            self._record("checkpoint", step=step, block_s=round(block_s, 4), snapshot_s=round(self.snapshot_s, 4))
        self.snapshot_s = 0.0

    def stop_for_requeue(self, step: int, code: int, *, lag: int, **times: float) -> None:
        """Every rank stopped at `step` with the checkpoint written: say why, rank 0 decides the
        requeue (requeue.after_stop), and the rank leaves through StopForRequeue."""
        from ddpjob.node import preemption
        from ddpjob.rank import requeue

        stop, env, run_dir = self._stop, self._env, self._run_dir
        mine = f"; this rank got {self._signalled}" if self._signalled else ""
        if env.is_rank0 and code == preemption.REQUEUE and requests.stop_requested(run_dir, env.job_id):
            # the checkpoint signal came from `ddpjob stop`: no requeue follows (requeue.after_stop)
            console.print0(f"stopping at step {step} (`ddpjob stop`{mine}): checkpoint written, not requeued")
        else:
            console.print0(f"stopping at step {step} ({preemption.REASONS[code]}{mine}): checkpoint written")
        if env.is_rank0:
            requeue.after_stop(self._cfg, env, run_dir, code, step, restart=self._restart,
                               signal_step=stop.signal_step, signal_time=stop.time, lag=lag, times=times,
                               detail=stop.detail)
        # nobody exits (srun --kill-on-bad-exit) before rank 0 requeued
        self._control.barrier("the barrier after the requeue decision")
        # every rank knows the code from the vote: a straggler's exclusion in place is the batch
        # shell's to carry out (rank/requeue.main reads rank 0's decision)
        in_place = code == preemption.STRAGGLER and self._cfg.slurm.on_straggler == "exclude"
        raise StopForRequeue(step, exitcodes.RESTART if in_place else exitcodes.REQUEUE)

    def signal(self, step: int) -> None:
        """Per rank, when the vote said stop (or at the end): which signal reached it, and when
        (nothing when none did). Not later: a signal that comes while the stop is being carried
        out (the requeue's own SIGTERM) is not what stopped the run."""
        import signal

        stop = self._stop
        if stop.signum is not None:
            self._signalled = stop.describe()
            events.record(self._run_dir, "signal", rank=self._env.rank, signal=signal.Signals(stop.signum).name,
                          at_step=stop.signal_step, stop_step=step, signal_time=stop.time,
                          job_id=self._env.job_id, restart=self._restart)

    def finished(self, step: int, info: dict[str, Any]) -> None:
        """Rank 0: the run's end (job.finish()); `accuracy` in `info` joins the record."""
        if self._env.is_rank0:
            events.decision(self._run_dir, "finished", job_id=self._env.job_id, restart=self._restart, step=step,
                            **{k: v for k, v in info.items() if k == "accuracy"})

    def exited(self, stopped_at: int | None) -> None:
        """Rank 0, at close() after a stop: the end of the recovery's exit phase."""
        if self._env.is_rank0 and stopped_at is not None:
            self._record("exit", step=stopped_at)
