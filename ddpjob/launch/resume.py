"""`ddpjob resume RUN_DIR [--nodes N ...]`: bring a stopped, cancelled or failed run back.

The run's own config.json (not the job file, which may have changed since) with the given
overrides, through the backend that ran it: the submitit path or the local supervisor
(submit.launch), or, for a run made by `ddpjob sbatch`, the re-rendered template submitted with
sbatch. The run dir policy is the one of submit/sbatch/run (rundir.check_reuse): other resources
or length are fine (elastic resume), another training is refused. A queued or running job is
refused (two jobs must never train in one run dir), and so is a completed run. When the code
on disk has changed since the freeze, one line says that the frozen code runs and how to run
the new code (--allow-code-change).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ddpjob import config, console, freeze, jobfile, rundir
from ddpjob.errors import DDPJobError, UsageError
from ddpjob.launch import control, runs, submit
from ddpjob.launch.backends import choose
from ddpjob.launch.backends.sbatch_slurm import SbatchBackend


def resumed_config(run: Path, overrides: list[str], flags: dict[str, object]) -> config.JobConfig:
    raw = json.loads(jobfile.read_run_config(run).to_json())
    raw = jobfile.with_cli_flags(jobfile.apply_overrides(raw, overrides), flags)
    return jobfile.from_dict(raw, f"{run}/{rundir.CONFIG} with the given overrides")


def cmd_resume(args: argparse.Namespace) -> int:
    run = rundir.require_run_dir(args.run)
    if (run / runs.SWEEP).is_file():
        raise UsageError(f"'{run}' is a sweep, expected one run directory",
                         f"resume one point, e.g. `ddpjob resume {run}/0`")
    if rundir.completed(run) is not None:
        raise DDPJobError(f"run '{run}' has completed, expected a stopped, cancelled or failed run",
                          "start a new run with `ddpjob submit`")
    cfg = resumed_config(run, list(args.overrides), jobfile.cli_flags(args))
    if args.allow_code_change:  # the code on disk now, accepting the old code's checkpoints
        runs.check_idle(run)  # never under a running job
        old = freeze.record(run)
        accepts = tuple(str(h) for h in [*(old.get("accepts") or []), old.get("hash")] if h)
        rec = freeze.freeze(cfg, run, accepts=accepts)
        console.info(f"{run}: code frozen again ({rec['hash']}), resuming checkpoints of {', '.join(accepts) or '-'}")
    elif runs.code_state(run).get("changed_on_disk"):  # said where it matters, not only in `status`
        console.info(f"ddpjob: the code on disk has changed since {run} was submitted: this resume runs "
                     f"the frozen code ({freeze.record(run).get('hash')}); to run the code on disk instead: "
                     f"ddpjob resume {run} --allow-code-change")
    job = runs.job_record(run)
    backend = choose.of_record(job) or choose.for_request("auto")
    command = ["ddpjob", "resume", str(run), *jobfile.cli_flag_words(args)]  # for job.json: what was run
    for item in args.overrides:
        command += ["--set", item]
    if isinstance(backend, SbatchBackend):  # a `ddpjob sbatch` run: its template again, then sbatch
        runs.check_idle(run)
        since = {run: control.log_offsets(run)}  # --wait: the new job's lines only
        new = backend.resubmit(run, cfg, job, command)
        console.info(f"resumed {run} as job {new} ({cfg.slurm.nodes} node(s) x {cfg.slurm.tasks_per_node} "
                     f"task(s)); it continues from its newest checkpoint")
        return submit.wait([run], since) if args.wait else 0
    return submit.launch([cfg], [], backend, run, command, f"{run}/{rundir.CONFIG}", wait_for=args.wait)
