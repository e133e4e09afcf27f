"""`ddpjob run JOB.toml|RUN_DIR`: the node-side entry point, one process per rank.

ClusterEnv (cluster.py) -> process group (dist.py) -> fit() (trainer.py) -> exit code:
0 finished (or nothing left to do), 1 error, 2 usage, 3 stopped for a requeue with a checkpoint
written. Under SLURM a stop asked for by the time-limit signal (or the deadline watch) also runs
`scontrol requeue`; so does a SIGTERM while SLURM is preempting the job (SLURM itself requeues
only jobs that outlive GraceTime), but not a plain scancel. Every (re)start and stop is an event
in RUN_DIR/events.jsonl.
"""

from __future__ import annotations

import argparse
import gc
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpjob import config, console, rundir
from ddpjob.config import JobConfig
from ddpjob.errors import DDPJobError, UsageError
from ddpjob.node.cluster import ClusterEnv

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_REQUEUE = 0, 1, 2, 3
_FLAGS = ("nodes", "tasks_per_node", "gpus_per_node", "partition", "account", "qos", "time", "name")


def cmd_run(args: argparse.Namespace) -> int:
    """The CLI command; errors propagate to cli.main, which prints them as one line."""
    target = Path(args.target)
    flags = {k: getattr(args, k, None) for k in _FLAGS}
    if target.is_dir():
        if args.overrides or any(v is not None for v in flags.values()):
            raise UsageError(f"'{target}' is a run directory, whose config.json is fixed, but "
                             "--set or resource flags were given, expected none",
                             "pass the job file (TOML) to change settings, or drop the flags")
        if args.run_dir and Path(args.run_dir).resolve() != target.resolve():
            raise UsageError(f"--run-dir {args.run_dir} differs from the run directory {target} given "
                             "as the target, expected one run directory", "drop --run-dir")
        rundir.require_run_dir(target)
        return _node(target, argv=None)
    if target.suffix != ".toml" and not target.is_file():
        raise UsageError(f"'{target}' is neither a job file nor a run directory, expected "
                         "JOB.toml or RUN_DIR", "e.g. `ddpjob run jobs/smoke.toml`")
    cfg = config.resolve(target, args.overrides, flags)
    return _train(cfg, None, Path(args.run_dir) if args.run_dir else None, argv=None)


def run_node(run_dir: str | Path, argv: Sequence[str] | None = None) -> int:
    """For `ddpjob submit`'s submitit task and the local backend: train RUN_DIR on this rank and
    return the exit code (a user error is printed as one line, not raised)."""
    try:
        return _node(Path(run_dir), argv=list(argv) if argv is not None else [])
    except DDPJobError as exc:
        print(exc.line(), file=sys.stderr, flush=True)
        return exc.exit_code


def _node(run_dir: Path, argv: Sequence[str] | None) -> int:
    # A job requeued after training finished: exit before importing torch or meeting peers.
    done = rundir.completed(run_dir)
    if done is not None:
        env = ClusterEnv.from_environ(argv=argv)  # only the rank, for printing
        if env.is_rank0:
            print(f"ddpjob: {run_dir} already completed at step {done.get('step')} "
                  f"(accuracy {done.get('accuracy')}): nothing to do", flush=True)
            rundir.record_event(run_dir, "noop", reason="completed", job_id=env.job_id,
                                restart=env.restart_count)
        return EXIT_OK
    return _train(config.read_run_config(run_dir), run_dir, None, argv=argv)


def _train(cfg: JobConfig, run_dir: Path | None, wanted_dir: Path | None,
           argv: Sequence[str] | None) -> int:
    env = ClusterEnv.from_environ(argv=argv)  # GPUs not counted yet: torch is slow to import
    console.set_rank(env.rank)
    if env.restart_count > cfg.slurm.max_requeues:
        if env.is_rank0 and run_dir is not None:
            rundir.record_event(run_dir, "stop", reason="failed", step=None, job_id=env.job_id,
                                restart=env.restart_count, error="max_requeues exceeded")
        raise DDPJobError(f"this is restart {env.restart_count} of job {env.job_id}, more than "
                          f"slurm.max_requeues = {cfg.slurm.max_requeues}",
                          "raise slurm.max_requeues, or find out why the job keeps stopping "
                          "(`ddpjob status RUN_DIR` lists every stop)")
    from ddpjob.node import preemption

    # Flag-only handlers first: a signal during the (slow) start must not kill the process.
    stop = preemption.StopFlag.install([cfg.slurm.signal, "TERM"])
    import torch

    from ddpjob.node import dist
    from ddpjob.train import trainer

    env = ClusterEnv.from_environ(argv=argv, num_gpus=torch.cuda.device_count())
    ctx = dist.init_process_group(env, backend=cfg.train.backend, timeout_s=cfg.train.dist_timeout_s,
                                  threads=cfg.train.threads)
    failed = False
    try:
        if run_dir is None:
            run_dir = _shared_run_dir(cfg, env, wanted_dir)
            if rundir.completed(run_dir) is not None:
                console.print0(f"ddpjob: {run_dir} already completed: nothing to do")
                return EXIT_OK
        console.print0(f"ddpjob run {run_dir}: {env.describe()}")
        deadline = preemption.DeadlineWatch(_end_time(env))
        result = trainer.fit(cfg, ctx, run_dir, stop, deadline=deadline)
        if stop.signum is not None:  # per rank: which signal reached this rank, and when
            rundir.record_event(run_dir, "signal", rank=env.rank, signal=signal_name(stop.signum),
                                at_step=stop.signal_step, stop_step=result.step,
                                job_id=env.job_id, restart=env.restart_count)
        if result.finished:
            if env.is_rank0:
                rundir.record_event(run_dir, "stop", reason="finished", step=result.step,
                                    job_id=env.job_id, restart=env.restart_count,
                                    accuracy=result.accuracy)
            return EXIT_OK
        _after_stop(cfg, env, run_dir, result.stop_code, result.step)
        dist.barrier()  # nobody exits (srun --kill-on-bad-exit) before rank 0 has requeued
        return EXIT_REQUEUE
    except BaseException as exc:
        failed = True
        if run_dir is not None and not isinstance(exc, SystemExit):
            why = exc.line() if isinstance(exc, DDPJobError) else _one_line(exc)
            rundir.record_event(run_dir, "stop", reason="failed", rank=env.rank, job_id=env.job_id,
                                restart=env.restart_count, error=why)
            if not isinstance(exc, (DDPJobError, KeyboardInterrupt)):
                traceback.print_exc()  # a bug: the log keeps the full story on every rank
        raise
    finally:
        # After a failure the peers are stuck in some collective, not in our exit barrier:
        # do not wait for them (their collective fails once this process is gone).
        ctx.destroy(barrier_timeout_s=1.0 if failed else 30.0)
        # The interpreter's final garbage collection walks torch's huge module graph: seconds
        # per rank at every exit (and every requeue). Everything is closed and flushed by now,
        # so let the exit skip it.
        gc.freeze()


def _after_stop(cfg: JobConfig, env: ClusterEnv, run_dir: Path, code: int, step: int) -> None:
    """Rank 0: record the stop and, where nobody else will, requeue the job."""
    from ddpjob.node import preemption

    if not env.is_rank0:
        return
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
        # SLURM requeues a preempted job only if it outlives GraceTime: we stopped within it,
        # so requeue it ourselves - unless this was a plain scancel (no PreemptTime) or the job
        # is already requeued (no longer RUNNING). Never twice.
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


def _shared_run_dir(cfg: JobConfig, env: ClusterEnv, wanted: Path | None) -> Path:
    """The same run dir on every rank: --run-dir, else runs/<name>-<job id> (so a requeued SLURM
    job finds its checkpoints), else a new folder that rank 0 creates and broadcasts."""
    from ddpjob.node import dist

    path: Any = None
    if env.is_rank0:
        if wanted is not None:
            path = wanted
        elif env.job_id:
            path = Path("runs") / f"{cfg.name}-{env.job_id}"
        else:
            path = rundir.new_run_dir("runs", cfg.name)
        path = Path(path).resolve()
        try:
            _prepare_run_dir(path, cfg)
        except DDPJobError as exc:
            path = exc  # tell the other ranks, so that they stop too instead of waiting
    path = dist.broadcast_object(path)
    if isinstance(path, DDPJobError):
        raise path
    return Path(path)


def _prepare_run_dir(path: Path, cfg: JobConfig) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if rundir.is_run_dir(path):
        old = config.read_run_config(path)
        if old.hash() != cfg.hash():
            raise UsageError(f"run directory {path} holds another job (config hash {old.hash()}, this "
                             f"job has {cfg.hash()}), expected the same model, data and optimizer",
                             "use a new --run-dir, or the job file that made this one")
        if old.to_json() == cfg.to_json():
            return
        console.print0(f"ddpjob: {path}/config.json updated (resources or length changed)")
    rundir.write_text_atomic(path / rundir.CONFIG, cfg.to_json())


def _end_time(env: ClusterEnv) -> float | None:
    """SLURM_JOB_END_TIME, else one `squeue` on rank 0 (broadcast): for the deadline watch."""
    from ddpjob.node import dist, preemption

    if env.end_time is not None:
        return env.end_time
    if env.source not in ("slurm", "torchrun") or not env.job_id:
        return None
    end = preemption.query_end_time(env.job_id) if env.is_rank0 else None
    return dist.broadcast_object(end)


def signal_name(signum: int) -> str:
    import signal

    return signal.Signals(signum).name


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
