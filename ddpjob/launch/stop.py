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
from pathlib import Path

from ddpjob import console, jobfile
from ddpjob.ledger import requests
from ddpjob.errors import DDPJobError
from ddpjob.launch import runs
from ddpjob.launch.backends import choose


def live_runs(target: str, verb: str) -> list[runs.RunInfo]:
    """The runs of `target` (a run, a sweep or a job id) that a cancel or stop can reach."""
    path, is_sweep = runs.resolve(target)
    found = runs.sweep_points(path) if is_sweep else [(path, "")]
    live = [i for i in runs.infos(found) if not i.finished]
    never = [i for i in live if not i.job_id]
    if never:  # a cancel event would only block its first requeue later
        raise DDPJobError(f"'{never[0].run_dir}' has no job id (no job.json, no start recorded), expected a "
                          "submitted run", "a script of `ddpjob sbatch` that you submitted yourself and that "
                          "has not started yet is cancelled with `scancel JOBID`")
    if not live:
        raise DDPJobError(f"'{target}' has already finished, nothing to {verb}",
                          f"`ddpjob status {target}` shows how it ended")
    return live


def cmd_cancel(args: argparse.Namespace) -> int:
    for i in live_runs(args.run, "cancel"):
        # Recorded first: a rank deciding its requeue meanwhile must see it (no successor).
        requests.cancel(i.run_dir, i.job_id, i.restarts)
        job = runs.job_record(i.run_dir)
        backend = choose.of_record(job)
        if backend is not None:
            backend.cancel(i.run_dir, job, i.state)
        console.info(f"cancelled {i.job_id} ({i.run_dir})")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    for i in live_runs(args.run, "stop"):
        job = runs.job_record(i.run_dir)
        backend = choose.of_record(job)
        if backend is None:
            raise DDPJobError(f"'{i.run_dir}' has backend {i.backend!r}, expected slurm or local",
                              f"`ddpjob status {i.run_dir}`")
        if not backend.can_stop:  # refused before a request is recorded that nothing would answer
            raise DDPJobError(f"'{i.run_dir}' runs under {backend.name}, which `ddpjob stop` cannot stop, "
                              "expected a run of the local or slurm backend",
                              f"`ddpjob cancel {i.run_dir}` ends it (its newest checkpoint stays)")
        requests.ask_stop(i.run_dir, i.job_id, i.attempts[-1] if i.attempts else 0)  # before the signal: rank 0 reads it
        said = backend.stop(i.run_dir, job, i.state)
        signal_name = _command_signal(i.run_dir)
        if signal_name and "checkpoint at their next step" in said:
            # a [train] command: ddpjob writes no checkpoint, the program does what its handler does
            said = (f"each rank's program gets SIG{signal_name}: it saves what its own handler saves "
                    "and ends, or dies of it without a handler (docs/commands.md)")
        console.info(f"stopping {i.job_id} ({i.run_dir}): {said}; `ddpjob resume {i.run_dir}` continues")
    return 0


def _command_signal(run_dir: Path) -> str | None:
    """A [train] command run's command_signal ("TERM"), None for a run of the API."""
    try:
        cfg = jobfile.read_run_config(run_dir)
    except DDPJobError:
        return None
    return cfg.train.command_signal if cfg.train.command else None
