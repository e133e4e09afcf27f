"""`ddpjob run JOB.toml|RUN_DIR`: the node-side entry point, one process per rank.

Resolves the config and run dir, installs the flag-only stop handlers, then runs the job file's
`train.entry` (the built-in trainer by default) whose `ddpjob.init()` builds the process group
and the Job (start.py, job.py). Exit codes: 0 finished (or nothing left to do), 1 error, 2 usage, 3
stopped for a requeue with a checkpoint written (the Job decided and did the requeue). Every
(re)start and stop is an event in RUN_DIR/events.jsonl.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpjob import console, exitcodes, freeze, jobfile, rundir
from ddpjob.ledger import events, policy
from ddpjob.config import JobConfig
from ddpjob.errors import ClusterFailure, DDPJobError, UsageError
from ddpjob.node.cluster import ClusterEnv
from ddpjob.rank import entry, requeue, start
from ddpjob.rank.job import StopForRequeue
from ddpjob.rank.usertable import MissingUserKey



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
    if cfg.train.command:  # a plain program, not an entry: no torch, no process group of ours
        from ddpjob.rank import command

        return command.run(cfg, _command_dir(cfg, env, run_dir, wanted_dir), env)
    from ddpjob.node import preemption

    # Flag-only handlers first: a signal during the (slow) start must not kill the process.
    stop = preemption.StopFlag.install([cfg.slurm.signal, "TERM"])
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
        except StopForRequeue:
            return exitcodes.REQUEUE
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
        # A collective that failed in the user's code (DDP's all-reduce) becomes the hang
        # watch's line naming the ranks that did not arrive; other errors are told to the peers.
        reported = job.explain(raised) if job is not None else raised
        if reported is raised:
            reported = _out_of_memory(raised, env.rank)  # the machine's limit, not a bug
        if reported is raised:
            reported = _theirs(raised, env.rank, run_dir)  # an error in the user's own code is theirs
            if reported is not raised:
                traceback.print_exc()  # the rank's log keeps the whole story
        where = job.run_dir if job is not None else run_dir
        if where is not None and not isinstance(reported, (SystemExit, start.StartRefused)):
            why = reported.line() if isinstance(reported, DDPJobError) else _one_line(reported)
            step = job.current_step if job is not None else None
            events.record(where, "stop", reason="crash", rank=env.rank, host=env.hostname, job_id=env.job_id,
                          restart=job.restart if job is not None else requeue.attempt_of(env, events.read(where)),
                          error=why, step=step, **_error_kind(raised, reported, run_dir))
            if not isinstance(reported, (DDPJobError, KeyboardInterrupt)):
                traceback.print_exc()  # a bug: the log keeps the full story on every rank
        if reported is not raised:
            raise reported from raised
        raise
    finally:
        job = start.current()
        if job is not None:
            job.close(failed=failed)
        stop.uninstall()


def _user_frame(exc: BaseException) -> tuple[str, int] | None:
    """(file, line) where the exception comes from, if that is the user's code: the innermost
    frame outside the interpreter's library and installed packages (torch, numpy) is the
    user's, not ddpjob's. A syntax error's place is its own. None: ddpjob's own bug."""
    import sysconfig

    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the ddpjob package
    library = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}

    def under(path: str, folders: set[str] | list[str]) -> bool:
        full = os.path.abspath(path)
        return any(full == d or full.startswith(d.rstrip(os.sep) + os.sep) for d in folders)

    if isinstance(exc, SyntaxError) and exc.filename and not exc.filename.startswith("<"):
        return (str(exc.filename), int(exc.lineno or 0)) if not under(exc.filename, [ours, *library]) else None
    # the innermost frame that is not library code: ddpjob's or the user's (for a key missing
    # from job.user, raised in ddpjob on purpose: the user's line that asked for it)
    theirs = isinstance(exc, MissingUserKey)
    innermost = None
    for frame, line in traceback.walk_tb(exc.__traceback__):
        path = frame.f_code.co_filename
        if not path.startswith("<") and not under(path, library) and not (theirs and under(path, [ours])):
            innermost = (path, line)
    return innermost if innermost is not None and not under(innermost[0], [ours]) else None


def _theirs(exc: BaseException, rank: int, run_dir: Path | None = None) -> BaseException:
    """An exception raised in the user's own code, as one line that says so: the rank, the
    exception and their line, in their file rather than the run's frozen copy of it ("internal
    error" is for ddpjob's own bugs)."""
    if isinstance(exc, DDPJobError) or not isinstance(exc, Exception):
        return exc
    place = _user_frame(exc)
    if place is None:
        return exc
    file, line = freeze.source_of(run_dir, place[0]), place[1]
    what = exc.msg if isinstance(exc, SyntaxError) else str(exc)
    kind = type(exc).__name__
    if isinstance(exc, MissingUserKey):  # a KeyError to the user, its message unquoted
        kind, what = "KeyError", str(exc.args[0])
    return DDPJobError(f"rank {rank}: your code raised {kind}: {' '.join(what.split())[:300]} "
                       f"at {os.path.basename(file)}:{line}",
                       f"fix it in {file}; the traceback is in this rank's log")


# An OSError of these kinds in the user's code is a passing failure of the machine, most often a
# shared file system (NFS, Lustre, GPFS) timing out or a server restarting: retried once, not
# again at the same step and line (ledger/policy.py)
_TRANSIENT = frozenset({errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED,
                        errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN,
                        errno.EREMOTEIO, errno.EAGAIN, errno.EBUSY})


def _error_kind(raised: BaseException, reported: BaseException, run_dir: Path | None) -> dict[str, Any]:
    """The crash record's verdict inputs (ledger/crashes.classify): whose error it is
    (policy.USER, TRANSIENT, INTERNAL or INFRASTRUCTURE), the exception's name and the user's
    file:line where it was raised in their code."""
    if isinstance(reported, ClusterFailure) or isinstance(raised, KeyboardInterrupt):
        return {"error_class": policy.INFRASTRUCTURE}  # a peer died, a stall, a node out of reach
    place = _user_frame(raised)
    where = None if place is None else f"{os.path.basename(freeze.source_of(run_dir, place[0]))}:{place[1]}"
    kind = {"exception": type(raised).__name__, **({"where": where} if where else {})}
    if place is not None:  # raised in the user's code
        passing = isinstance(raised, (ConnectionError, TimeoutError)) or (
            isinstance(raised, OSError) and raised.errno in _TRANSIENT)
        return {"error_class": policy.TRANSIENT if passing else policy.USER, **kind}
    if isinstance(reported, DDPJobError):  # ddpjob refused what the user can fix: a setting, a file, memory
        return {"error_class": policy.USER, **kind}
    return {"error_class": policy.INTERNAL, **kind}  # ddpjob's own bug


def _out_of_memory(exc: BaseException, rank: int) -> BaseException:
    """Running out of host or GPU memory is neither the user's bug nor ddpjob's: one line that says
    which memory and what to change. (The kernel's OOM killer sends SIGKILL instead: nothing runs
    here, and srun/the supervisor report the killed rank.)"""
    text = " ".join(str(exc).split())
    gpu = type(exc).__name__ == "OutOfMemoryError" or "CUDA out of memory" in text
    host = isinstance(exc, MemoryError) or "can't allocate memory" in text or "DefaultCPUAllocator" in text
    if not (gpu or host):
        return exc
    which = "GPU" if gpu else "host"
    place = _user_frame(exc)
    at = f" at {os.path.basename(place[0])}:{place[1]}" if place else ""
    return DDPJobError(f"rank {rank} ran out of {which} memory{at} ({type(exc).__name__}: {text[:160]})",
                       "lower train.batch_size (train.accumulation_steps keeps the global batch)"
                       + ("" if gpu else ", or ask for more memory: [slurm] mem"))


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
