"""`ddpjob stop RUN`: every rank stops at the same step and writes a checkpoint, and the job
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

from ddpjob import config, console, requests
from ddpjob.errors import DDPJobError
from ddpjob.launch import control, slurm


def cmd_stop(args: argparse.Namespace) -> int:
    for i in control.live_runs(args.run, "stop"):
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
            if control.skip_if_pending(i, "stopped before it started"):
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
