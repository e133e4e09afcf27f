"""`ddpjob cancel RUN` and `ddpjob stop RUN`, the two ways to end a run's job.

`ddpjob stop`: every rank stops at the same step and writes a checkpoint, and the job
ends without a requeue; `ddpjob resume RUN` continues it, at any resources.

The stop is asked in the run dir first (requests.ask_stop: rank 0's requeue decision and the
local supervisor read it), then the job's checkpoint signal (slurm.signal, USR2 by default) is
sent the way SLURM's time-limit warning comes: to the ranks on SLURM, to the supervisor that
forwards it on the local backend. Unlike `ddpjob cancel` (SIGTERM, then SIGKILL after SLURM's
KillWait) nothing has to finish within a grace time: the ranks stop at their next step.
"""

from __future__ import annotations

import argparse
import os
import signal

from ddpjob import config, console, requests, rundir
from ddpjob.errors import DDPJobError
from ddpjob import slurm
from ddpjob.launch import control


def live_runs(target: str, verb: str) -> list[control.RunInfo]:
    """The runs of `target` (a run, a sweep or a job id) that a cancel or stop can reach."""
    path, is_sweep = control.resolve(target)
    runs = control.sweep_points(path) if is_sweep else [(path, "")]
    live = [i for i in control.infos(runs) if not i.finished]
    never = [i for i in live if not i.job_id]
    if never:  # a cancel event would only block its first requeue later
        raise DDPJobError(f"'{never[0].run_dir}' has no job id (no job.json, no start recorded), expected a "
                          "submitted run", "a script of `ddpjob sbatch` that you submitted yourself and that "
                          "has not started yet is cancelled with `scancel JOBID`")
    if not live:
        raise DDPJobError(f"'{target}' has already finished, nothing to {verb}",
                          f"`ddpjob status {target}` shows how it ended")
    return live


def skip_if_pending(i: control.RunInfo, reason: str) -> bool:
    """A local sweep point not started yet: marked CANCELLED, which its supervisor skips."""
    if i.state != "PENDING" or not (i.run_dir / control.LOCAL).is_file():
        return False
    rec = rundir.read_record(i.run_dir / control.LOCAL)
    rundir.write_json_atomic(i.run_dir / control.LOCAL, {**rec, "state": "CANCELLED", "reason": reason})
    return True


def cmd_cancel(args: argparse.Namespace) -> int:
    for i in live_runs(args.run, "cancel"):
        # Recorded first: a rank deciding its requeue meanwhile must see it (no successor).
        rundir.record_event(i.run_dir, "cancel", by="user", job_id=i.job_id, restart=i.restarts)
        if i.backend == "slurm":
            res = slurm.cancel(i.job_id)
            if not res.ok:
                raise DDPJobError(f"{res.error}, expected the job cancelled", "check `squeue -j "
                                  f"{i.job_id}`; you may only cancel your own jobs")
        elif i.backend == "local":
            job = control.job_record(i.run_dir)
            if not skip_if_pending(i, "cancelled before it started") and control.pid_alive(job.get("pid")):
                os.kill(int(job["pid"]), signal.SIGTERM)  # the supervisor forwards it to the ranks
        console.info(f"cancelled {i.job_id} ({i.run_dir})")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    for i in live_runs(args.run, "stop"):
        requests.ask_stop(i.run_dir, i.job_id, i.restarts)  # before the signal: rank 0 reads it
        if i.backend == "slurm":
            if i.state == "PENDING":  # nothing runs: there is no step to checkpoint
                res = slurm.cancel(i.job_id)
                said = "it was pending, so it is cancelled"
            else:
                res = slurm.send_signal(i.job_id, config.read_run_config(i.run_dir).slurm.signal)
                said = "the ranks write a checkpoint at their next step and end"
            if not res.ok:
                raise DDPJobError(f"{res.error}, expected the job signalled", "check `squeue -j "
                                  f"{i.job_id}`; you may only stop your own jobs")
        elif i.backend == "local":
            job = control.job_record(i.run_dir)
            if skip_if_pending(i, "stopped before it started"):
                said = "it had not started, so it will not"
            elif control.pid_alive(job.get("pid")):
                os.kill(int(job["pid"]), signal.SIGUSR2)  # the supervisor forwards it to the ranks
                said = "the ranks write a checkpoint at their next step and end"
            else:
                raise DDPJobError(f"the supervisor of '{i.run_dir}' is not running, expected a live local run",
                                  f"`ddpjob status {i.run_dir}` shows how it ended")
        else:
            raise DDPJobError(f"'{i.run_dir}' has backend {i.backend!r}, expected slurm or local",
                              f"`ddpjob status {i.run_dir}`")
        console.info(f"stopping {i.job_id} ({i.run_dir}): {said}; `ddpjob resume {i.run_dir}` continues")
    return 0
