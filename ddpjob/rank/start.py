"""How a process becomes one rank of the job: `init()` builds its ClusterEnv (once), the
stop handlers, the process group, the run dir and the Job (job.py).

`ddpjob run` (rank/runner.py) prepares the config and the run dir first and hands them over
explicitly: it runs the job file's `train.entry` inside `launched(Launch(...))`, and the entry's
`ddpjob.init()` takes them from there. Why not arguments: the entry is the user's script, whose
`ddpjob.init()` call is the same under `ddpjob run`, torchrun or alone. Without a launch (a
script started alone or under torchrun) init() resolves the job itself and chooses a new run dir
under ./runs/.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpjob import console, exitcodes, fileio, freeze, jobfile, rundir, runlock, slurm
from ddpjob.config import JobConfig
from ddpjob.errors import DDPJobError
from ddpjob.node.cluster import ClusterEnv
from ddpjob.rank.job import Job


class StartRefused(DDPJobError):
    """A start the budgets refuse (startcheck.check_start): its `budget` record is the attempt's
    decision already, so no rank records a crash for it (ownerror.report)."""

    on_record = True


class AlreadyCompleted(SystemExit):
    """Raised by `init()` when the run dir holds a finished run: nothing to do, exit 0."""

    def __init__(self) -> None:
        super().__init__(exitcodes.OK)


@dataclass
class Launch:
    """What `ddpjob run` hands to the entry's `init()` (through `launched()`): the resolved
    config, the run dir (None: choose one like a script started alone), argv for the legacy
    --local_rank, the stop flag installed before torch was imported, the rank's ClusterEnv."""

    cfg: JobConfig
    run_dir: Path | None = None
    wanted_dir: Path | None = None
    argv: Sequence[str] | None = None
    stop: Any = None
    allow_code_change: bool = False  # `ddpjob run --allow-code-change`
    from_scratch: bool = False  # `ddpjob run --from-scratch`
    env: ClusterEnv | None = None  # the runner's, read before torch (None: init() reads it)


# Written only by launched() and init()/Job.close() below: the one hand-over point.
_launch: Launch | None = None
_current: Job | None = None


@contextmanager
def launched(launch: Launch) -> Iterator[Launch]:
    """While the block runs (the entry, under `ddpjob run`), `init()` sets the rank up from
    `launch` and ignores its own arguments."""
    global _launch
    _launch = launch
    try:
        yield launch
    finally:
        _launch = None


def init(job: str | Path | JobConfig | None = None, *, overrides: Sequence[str] = (),
         run_dir: str | Path | None = None) -> Job:
    """Set this process up as one rank of the job and return its Job (once per process).

    Under `ddpjob run` the job file and run dir come from there and the arguments are ignored.
    Otherwise `job` is a job file (or JobConfig; default: every key at its default) with
    `--set`-style `overrides`, and `run_dir` an existing or new run directory (default: a new
    one under ./runs/, or runs/<name>-<job id> under SLURM so a requeued job finds it)."""
    global _current
    if _current is not None:
        return _current
    launch = _launch
    if launch is None:
        launch = Launch(_resolve(job, overrides), wanted_dir=Path(run_dir) if run_dir is not None else None,
                        argv=sys.argv[1:])
    cfg = launch.cfg
    # Read once per rank. GPUs not counted yet: torch is slow to import.
    env = launch.env or ClusterEnv.from_environ(argv=launch.argv)
    console.set_rank(env.rank)
    from ddpjob.node import compilecache, determinism, preemption

    # Flag-only handlers before torch loads: a signal during the slow start must not kill us.
    stop = launch.stop or preemption.StopFlag.install([cfg.slurm.signal, "TERM"])
    # Here, not in `ddpjob run`'s runner: every rank passes through init() (scripts started
    # alone and under torchrun too) before its first CUDA matmul, which is what cuBLAS needs.
    determinism.set_environ(cfg.train.deterministic, env)
    import torch

    from ddpjob.node import group

    env = env.with_gpus(torch.cuda.device_count())
    determinism.apply(cfg.train.deterministic)
    ctx = group.init_process_group(env, backend=cfg.train.backend, timeout_s=cfg.train.dist_timeout_s,
                                   threads=cfg.train.threads)
    try:
        path = launch.run_dir or _shared_run_dir(cfg, env, launch.wanted_dir)
    except BaseException:
        ctx.destroy(barrier_timeout_s=1.0)
        raise
    if rundir.completed(path) is not None:  # e.g. a job requeued after it finished
        console.print0(f"ddpjob: {path} already completed: nothing to do")
        ctx.destroy()
        raise AlreadyCompleted()
    restart, lock = _check_budget(cfg, env, path, ctx)
    if env.agent_pid is not None:  # torchrun: no scheduler knows the run, nobody else logs its ranks
        from ddpjob.node import teelog

        teelog.tee(path / rundir.LOGS / f"rank-{env.rank}.log")
        if env.is_rank0:
            _record_torchrun_job(env, path)
    # every rank, first in its log at each start: `ddpjob logs` marks the attempts there
    print(console.attempt_line(restart, env.rank, env.hostname, env.job_id), flush=True)
    compilecache.use_run_dir(path, env)  # before any model code: torch.compile reads it when compiling
    _current = Job(cfg, ctx, path, stop, standalone=_launch is None, restart=restart, lock=lock,
                   end_time=_end_time(env), code=lambda: freeze.running_hash(cfg, path),
                   allow_code_change=launch.allow_code_change, from_scratch=launch.from_scratch,
                   on_close=_forget)
    return _current


def _resolve(job: str | Path | JobConfig | None, overrides: Sequence[str]) -> JobConfig:
    """The config of a script started alone or under torchrun."""
    if isinstance(job, JobConfig):
        return job
    if job is not None:
        # What runs is this script: the job file's train.entry, relative to the directory
        # `ddpjob` is started from, need not resolve from wherever torchrun was started.
        me = Path(sys.argv[0])
        pin = [f"train.entry={json.dumps(str(me.resolve()))}"] if me.suffix == ".py" and me.is_file() else []
        return jobfile.resolve(Path(job), [*overrides, *pin], {})
    return jobfile.from_dict(jobfile.apply_overrides({}, overrides), "--set")


def _forget(job: Job) -> None:
    """Job.close(): a later init() in this process starts afresh."""
    global _current
    if _current is job:
        _current = None


def _check_budget(cfg: JobConfig, env: ClusterEnv, path: Path, ctx: Any) -> tuple[int, runlock.RunLock | None]:
    """This start's restart number within the run (successor jobs included). Rank 0 takes the
    run dir's lock (one job per run dir), records what ended the previous attempt unseen and
    checks the budgets; every rank gets its answer (one reader: the file may be changing under
    the others)."""
    from ddpjob.node import dist
    from ddpjob.rank import startcheck

    lock: runlock.RunLock | None = None
    answer: tuple[int, str | None, tuple[str, str] | None] | None = None
    if env.is_rank0:
        try:
            lock = runlock.RunLock.take(path, f"{env.source} job {env.job_id or '-'} (rank 0)")
            answer = (*startcheck.check_start(cfg, env, path), None)
        except runlock.Busy as exc:
            answer = (0, None, (exc.message, exc.hint))
    restart, why, busy = dist.broadcast_object(answer, what="the start's budget check")
    if busy:
        ctx.destroy(barrier_timeout_s=1.0)
        raise runlock.Busy(*busy)
    if why:
        ctx.destroy(barrier_timeout_s=1.0)
        raise StartRefused(f"this is restart {restart} of run {path.name}: {why}",
                          "raise the budget in [slurm], or find out why the job keeps stopping "
                          "(`ddpjob status RUN_DIR` lists every stop)")
    return int(restart), lock


def _record_torchrun_job(env: ClusterEnv, path: Path) -> None:
    """job.json of a run torchrun started: its backend, its job and the agent whose life is the
    job's (launch/backends/torchrun_procs.py reads it). A later torchrun given the same run dir
    adds its job; a run submitted through another backend keeps its own record."""
    job = fileio.read_record(path / rundir.JOB)
    if job and job.get("backend") != "torchrun":
        return
    if job.get("job_id") == env.job_id and job.get("pid") == env.agent_pid:
        return  # a restart round of the same agent
    ids = [str(j) for j in job.get("job_ids") or [] if j != env.job_id]
    fileio.write_json_atomic(path / rundir.JOB, {"backend": "torchrun", "job_id": env.job_id,
                                                 "job_ids": [*ids, env.job_id], "pid": env.agent_pid,
                                                 "host": env.hostname})


def current() -> Job | None:
    return _current


def _shared_run_dir(cfg: JobConfig, env: ClusterEnv, wanted: Path | None) -> Path:
    """The same run dir on every rank: the one asked for, else runs/<name>-<job id> (so a
    requeued SLURM job finds its checkpoints), else a new folder that rank 0 creates."""
    from ddpjob.node import dist

    def choose() -> Path:
        if wanted is not None:
            path = wanted
        elif env.job_id:
            path = Path("runs") / f"{cfg.name}-{env.job_id}"
        else:
            path = rundir.new_run_dir("runs", cfg.name)
        return rundir.prepare(Path(path).resolve(), cfg)

    return Path(dist.rank0_decides(env.is_rank0, choose, what="the choice of the run directory"))


def _end_time(env: ClusterEnv) -> float | None:
    """SLURM_JOB_END_TIME, else one `squeue` on rank 0 (broadcast): for the deadline watch."""
    from ddpjob.node import dist

    if env.end_time is not None:
        return env.end_time
    if env.source not in ("slurm", "torchrun") or not env.job_id:
        return None
    end = slurm.end_time(env.job_id) if env.is_rank0 else None
    # No answer just means no deadline watch: the warning signal still comes.
    return dist.broadcast_object(None if isinstance(end, slurm.Failed) else end, what="the end time's broadcast")
