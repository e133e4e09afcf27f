"""`ddpjob resume RUN_DIR [--nodes N ...]`: bring a stopped, cancelled or failed run back.

The run's own config.json (not the job file, which may have changed since) with the given
overrides, through the backend that ran it: the submitit path or the local supervisor
(submit.launch), or, for a run made by `ddpjob sbatch`, the re-rendered template submitted with
sbatch. The run dir policy is the one of submit/sbatch/run (rundir.check_reuse): other resources
or length are fine (elastic resume), another training is refused. A queued or running job is
refused (two jobs must never train in one run dir), and so is a completed run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ddpjob import config, console, rundir
from ddpjob.errors import DDPJobError, UsageError
from ddpjob import freeze, slurm
from ddpjob.launch import control, render, submit


def resumed_config(run: Path, overrides: list[str], flags: dict[str, object]) -> config.JobConfig:
    raw = json.loads(config.read_run_config(run).to_json())
    raw = config.with_cli_flags(config.apply_overrides(raw, overrides), flags)
    return config.from_dict(raw, f"{run}/{rundir.CONFIG} with the given overrides")


def cmd_resume(args: argparse.Namespace) -> int:
    run = rundir.require_run_dir(args.run)
    if (run / control.SWEEP).is_file():
        raise UsageError(f"'{run}' is a sweep, expected one run directory",
                         f"resume one point, e.g. `ddpjob resume {run}/0`")
    if rundir.completed(run) is not None:
        raise DDPJobError(f"run '{run}' has completed, expected a stopped, cancelled or failed run",
                          "start a new run with `ddpjob submit`")
    cfg = resumed_config(run, list(args.overrides), config.cli_flags(args))
    if args.allow_code_change:  # the code on disk now, accepting the old code's checkpoints
        submit._check_idle(run)  # never under a running job
        old = freeze.record(run)
        accepts = tuple(str(h) for h in [*(old.get("accepts") or []), old.get("hash")] if h)
        rec = freeze.freeze(cfg, run, accepts=accepts)
        console.info(f"{run}: code frozen again ({rec['hash']}), resuming checkpoints of {', '.join(accepts) or '-'}")
    job = control.job_record(run)
    backend = str(job.get("backend") or "")
    if backend not in ("slurm", "local"):
        backend = submit.choose_backend("auto")
    command = ["ddpjob", "resume", str(run), *config.cli_flag_words(args)]  # for job.json: what was run
    for item in args.overrides:
        command += ["--set", item]
    if backend == "slurm" and job.get("via") == "sbatch":
        return _sbatch_again(run, cfg, job, command, args.wait)
    return submit.launch([cfg], [], backend, run, command, f"{run}/{rundir.CONFIG}", wait_for=args.wait)


def _sbatch_again(run: Path, cfg: config.JobConfig, job: dict, command: list[str], wait: bool) -> int:
    """A `ddpjob sbatch` run: the template again (new resources included), then sbatch."""
    state = rundir.check_reuse(run.absolute(), cfg)
    submit._check_idle(run)
    script = render.render_sbatch(cfg, run_dir=run.absolute(), python=os.path.abspath(sys.executable))
    submit.preflight_slurm(cfg)
    rundir.write_text_atomic(run / "job.sbatch", script)
    if state != rundir.SAME:
        rundir.write_text_atomic(run / rundir.CONFIG, cfg.to_json())
    new = slurm.submit(run.absolute() / "job.sbatch", cwd=run.absolute())
    if isinstance(new, slurm.Failed):
        raise DDPJobError(f"sbatch refused the job: {new.why}",
                          "check the [slurm] section; `ddpjob doctor` checks partitions and limits")
    chain = [str(j) for j in (job.get("job_ids") or [job.get("job_id")]) if j]
    rundir.write_json_atomic(run / rundir.JOB, {"backend": "slurm", "via": "sbatch", "job_id": new,
                                                "job_ids": [*chain, new], "submitted_at": time.time(),
                                                "command": command})
    console.info(f"resumed {run} as job {new} ({cfg.slurm.nodes} node(s) x {cfg.slurm.tasks_per_node} "
                 f"task(s)); it continues from its newest checkpoint")
    return submit.wait([run]) if wait else 0
