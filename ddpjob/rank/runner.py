"""`ddpjob run JOB.toml|RUN_DIR`: the node-side entry point, one process per rank.

Resolves the config and run dir, installs the flag-only stop handlers, then runs the job file's
`train.entry` (the built-in trainer by default) whose `ddpjob.init()` builds the process group
and the Job (start.py, job.py). Exit codes: 0 finished (or nothing left to do), 1 error, 2 usage, 3
stopped for a requeue with a checkpoint written (the Job decided and did the requeue), 4 stopped
with a checkpoint for the batch shell to run the ranks again without a straggler's host. Every
(re)start and stop is an event in RUN_DIR/events.jsonl.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpjob import console, exitcodes, freeze, jobfile, rundir
from ddpjob.ledger import events
from ddpjob.config import JobConfig
from ddpjob.errors import DDPJobError, UsageError
from ddpjob.node.cluster import ClusterEnv
from ddpjob.rank import entry, ownerror, start
from ddpjob.rank.loopevents import StopForRequeue



def cmd_run(args: argparse.Namespace) -> int:
    """The CLI command; errors propagate to cli.main, which prints them as one line."""
    target = Path(args.target)
    flags = jobfile.cli_flags(args)
    if target.is_dir():
        if args.overrides or any(v is not None for v in flags.values()):
            raise UsageError(f"'{target}' is a run directory, whose config.json is fixed, but "
                             "--set or resource flags were given, expected none",
                             "pass the job file (TOML) to change settings, or drop the flags")
        if args.run_dir and Path(args.run_dir).resolve() != target.resolve():
            raise UsageError(f"--run-dir {args.run_dir} differs from the run directory {target} given "
                             "as the target, expected one run directory", "drop --run-dir")
        rundir.require_run_dir(target)
        return _node(target, argv=None, allow_code_change=args.allow_code_change, from_scratch=args.from_scratch)
    if target.suffix != ".toml" and not target.is_file():
        raise UsageError(f"'{target}' is neither a job file nor a run directory, expected "
                         "JOB.toml or RUN_DIR", "e.g. `ddpjob run jobs/smoke.toml`")
    cfg = jobfile.resolve(target, args.overrides, flags)
    return _train(cfg, None, Path(args.run_dir) if args.run_dir else None, argv=None,
                  allow_code_change=args.allow_code_change, from_scratch=args.from_scratch)


def run_node(run_dir: str | Path, argv: Sequence[str] | None = None) -> int:
    """For `ddpjob submit`'s submitit task and the local backend: train RUN_DIR on this rank and
    return the exit code (a user error is printed as one line, not raised)."""
    try:
        return _node(Path(run_dir), argv=list(argv) if argv is not None else [])
    except DDPJobError as exc:
        print(exc.line(), file=sys.stderr, flush=True)
        return exc.exit_code


def _node(run_dir: Path, argv: Sequence[str] | None, allow_code_change: bool = False,
          from_scratch: bool = False) -> int:
    # Before anything is read from it: a run dir others can write is code others can run as
    # us (config.json names the entry script; submitit's pickle lives in logs/).
    rundir.check_private(run_dir)
    # A job requeued after training finished: exit before importing torch or meeting peers.
    done = rundir.completed(run_dir)
    if done is not None:
        env = ClusterEnv.from_environ(argv=argv)  # only the rank, for printing
        if env.is_rank0:
            print(f"ddpjob: {run_dir} already completed at step {done.get('step')} "
                  f"(accuracy {done.get('accuracy')}): nothing to do", flush=True)
            events.record(run_dir, "noop", reason="completed", job_id=env.job_id,
                                restart=env.restart_count)
        return exitcodes.OK
    return _train(jobfile.read_run_config(run_dir), run_dir, None, argv=argv,
                  allow_code_change=allow_code_change, from_scratch=from_scratch)


def _train(cfg: JobConfig, run_dir: Path | None, wanted_dir: Path | None,
           argv: Sequence[str] | None, allow_code_change: bool = False, from_scratch: bool = False) -> int:
    rundir.private_umask(cfg.slurm.share_group)  # checkpoints, logs, caches: never others' to write
    # The entry replaces sys.argv: read the legacy --local_rank from ours first.
    argv = list(sys.argv[1:]) if argv is None else list(argv)
    env = ClusterEnv.from_environ(argv=argv)  # this rank's, read once: init() adds the GPU count
    console.set_rank(env.rank)
    from ddpjob.node import preemption

    # Flag-only handlers first: a signal during the (slow) start must not kill the process, and
    # is not lost: the entry's loop (or the command's watch) reads the flag when it begins
    stop = preemption.StopFlag.install([cfg.slurm.signal, "TERM"])
    if cfg.train.command:  # a plain program, not an entry: no torch, no process group of ours
        from ddpjob.rank import command

        return command.run(cfg, _command_dir(cfg, env, run_dir, wanted_dir), env, stop)
    launch = start.Launch(cfg, run_dir=run_dir, wanted_dir=wanted_dir, argv=argv, stop=stop,
                          allow_code_change=allow_code_change, from_scratch=from_scratch, env=env)
    with start.launched(launch):
        return _run_entry(cfg, run_dir, env, stop)


def _command_dir(cfg: JobConfig, env: ClusterEnv, run_dir: Path | None, wanted: Path | None) -> Path:
    """A command run's dir: the one given, else (one rank: nobody to agree with) a new one."""
    if run_dir is not None:
        return run_dir
    if env.world_size > 1:
        raise UsageError(f"train.command runs on {env.world_size} ranks without a run directory, expected "
                         "one every rank shares", "pass --run-dir RUN_DIR, or submit the job (`ddpjob submit`)")
    return rundir.prepare((wanted or rundir.new_run_dir("runs", cfg.name)).resolve(), cfg)


def _run_entry(cfg: JobConfig, run_dir: Path | None, env: ClusterEnv, stop: Any) -> int:
    """Run train.entry inside the launch; its ending as an exit code, or one error line."""
    failed = False
    try:
        try:
            # a run dir's frozen copy of a script entry, not the file as it is on disk now
            script = freeze.frozen_entry(run_dir, cfg) if run_dir is not None else cfg.train.entry
            # Plugins in the working directory stay importable, after the frozen code (the
            # scripts set PYTHONSAFEPATH so that `python -m` does not put it first).
            if os.getcwd() not in sys.path:
                sys.path.append(os.getcwd())
            entry.run(script, cfg.train.args)
        except StopForRequeue as stopped:
            return stopped.status
        except start.AlreadyCompleted:
            return exitcodes.OK
        except SystemExit as exc:  # the user's own sys.exit()
            if exc.code not in (0, None):
                raise DDPJobError(f"train.entry {entry.describe(cfg.train.entry)} exited with "
                                  f"status {exc.code}, expected it to return after job.finish()",
                                  "look at this rank's log above for why") from None
        job = start.current()
        if job is None:
            raise DDPJobError(f"train.entry {entry.describe(cfg.train.entry)} returned without "
                              "calling ddpjob.init(), expected a script that trains through ddpjob",
                              "call job = ddpjob.init() first (see docs/api.md)")
        if not job.finished:
            raise DDPJobError(f"train.entry {entry.describe(cfg.train.entry)} returned without "
                              "job.finish(), expected the training to end with it (the run would "
                              "never be marked completed)", "call job.finish(model) after the loop")
        return exitcodes.OK
    except BaseException as raised:
        failed = True
        job = start.current()
        reported = ownerror.report(raised, job, env, run_dir)
        if reported is not raised:
            raise reported from raised
        raise
    finally:
        job = start.current()
        if job is not None:
            job.close(failed=failed)
        stop.uninstall()
