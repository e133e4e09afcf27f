"""`ddpjob submit JOB.toml`: resolved config -> run dir(s) -> the chosen backend.

Login-node side, after jobfile.py: writes RUN_DIR/config.json once, freezes the code, then hands
the run dir(s) to the backend chosen once from --backend (launch/backends/): submitit on SLURM (a
job array for a sweep, launch/sweep.py), or the detached local supervisor. Writes job.json;
status/logs/cancel/resume (control.py, stop.py, resume.py) read it back and find the backend again.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
from pathlib import Path
from typing import Any

from ddpjob import commandpaths, config, console, fileio, freeze, jobfile, rundir
from ddpjob.rank import entry
from ddpjob.config import JobConfig
from ddpjob.errors import DDPJobError, UsageError
from ddpjob.launch import commandcheck, control, entrycheck, local, runs
from ddpjob.launch.backends import Backend, choose
from ddpjob.launch.sweep import SweepPoint, expand_sweep


def __getattr__(name: str) -> Any:
    """`ddpjob.launch.submit.NodeTask`: where jobs queued before ddpjob/rank/task.py existed
    pickled their callable, and the nodes unpickle it by this name. Resolved only when asked
    (pickle's lookup), so importing this module never imports the rank layer (or torch)."""
    if name == "NodeTask":
        import importlib

        return importlib.import_module("ddpjob.rank.task").NodeTask
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def rank_rows(cfg: JobConfig, backend: Backend, limit: int = 64) -> list[list[Any]]:
    """Per-rank view: where each rank runs and what batch it trains with (the first `limit`
    ranks and the last one: a table of a million ranks helps nobody)."""
    s, t = cfg.slurm, cfg.train
    accum = config.accumulation_for(cfg, s.world_size)
    master = ("<first node>:<15000 + job id % 15000>" if backend.on_slurm
              else "127.0.0.1:<free port at start>")
    rows = []
    shown = range(s.world_size) if s.world_size <= limit else [*range(limit - 1), s.world_size - 1]
    for rank in shown:
        node, local = divmod(rank, s.tasks_per_node)
        device = f"cuda:{local}" if s.gpus_per_node > 0 else "cpu"
        rows.append([rank, f"node {node}" if backend.on_slurm else "localhost", local, device, master,
                     # a [train] command's batch is its own business: the trainer's keys do not apply
                     *([] if t.command else [t.batch_size, accum, t.batch_size * accum * s.world_size])])
    return rows


RANK_COLUMNS = ["rank", "node", "local rank", "device", "MASTER_ADDR:PORT", "batch/rank",
                "accumulation", "global batch"]


def rank_columns(cfg: JobConfig) -> list[str]:
    return RANK_COLUMNS[:5] if cfg.train.command else RANK_COLUMNS


def dry_run(cfgs: list[JobConfig], points: list[SweepPoint], backend: Backend, job: str,
            run_dir: str | None) -> int:
    cfg = cfgs[0]
    where = Path(run_dir or Path("runs") / f"{cfg.name}{'-sweep' if points else ''}-<time>").absolute()
    # The job's own checks, as submit runs them (an entry that does not parse, a missing
    # init_from, the dataset): a dry run that passes must not hide what submit then refuses.
    # The scheduler's (sinfo, scontrol: partition, limits, signal lead) stay submit's: a dry
    # run shows the script where the scheduler is not reachable (a laptop, CI).
    _doctor_checks(cfgs, where, on_slurm=False)
    backend.dry_run(cfg, job, where, [where / p.id for p in points])  # the script first
    # what each rank then runs: a wrong script is the first thing to spot before submitting
    if cfg.train.command:  # shown as a shell would need it typed; it runs without one
        console.info(f"# train.command (each rank, no shell): {shlex.join(cfg.train.command)}")
    else:
        console.info(f"# train.entry: {entry.describe(cfg.train.entry)}; train.args: "
                     f"{shlex.join(cfg.train.args) or '(none)'}")
    console.table("per-rank view", rank_columns(cfg), rank_rows(cfg, backend))
    if points:
        console.table("sweep points", ["point", "values"],
                      [[p.id, " ".join(p.overrides)] for p in points])
    return 0


def _make_root(path: Path, share_group: bool = False) -> Path | None:
    """Create the run (or sweep) dir; returns the topmost folder this created (removed again
    if the submission fails), None if the dir was there already (empty)."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise DDPJobError(f"run directory '{path}' already exists and is not empty",
                          "pass a new --run-dir, or leave it out for a fresh one under runs/")
    top = None
    for p in [path.absolute(), *path.absolute().parents]:
        if p.exists():
            break
        top = p
    try:
        rundir.make_dir(path, share_group)  # 0700/0750: see rundir.dir_mode
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise DDPJobError(f"cannot create run directory '{path}' ({exc.strerror})",
                          "pass a writable --run-dir") from None
    return top


def _doctor_checks(cfgs: list[JobConfig], root: Path, *, on_slurm: bool) -> None:
    """`ddpjob doctor`'s cheap checks (the entry, init_from, dataset; on SLURM also partition
    limits, GPUs vs tasks, signal routing, port window): a job that would fail on the nodes
    fails here, in one line, before anything is written. Warnings are printed and do not stop
    the submission."""
    from ddpjob.launch import doctor

    checks = []
    for cfg in cfgs:
        # the run dir itself is checked (with a more precise message) when it is created
        checks = [c for c in doctor.cheap_checks(cfg, on_slurm=on_slurm, runs_root=root.parent)
                  if c.name != "run dir"]
        doctor.raise_on_failures(checks)
        commandcheck.check(cfg, strict=True)
    for c in checks:
        if c.status == doctor.WARN:
            console.warn(f"preflight '{c.name}': {c.detail}" + (f" (hint: {c.hint})" if c.hint else ""))


def cmd_submit(args: argparse.Namespace) -> int:
    from ddpjob.launch.sbatch import locate_job  # `smoke` and jobs/smoke.toml also name the bundled jobs

    job = locate_job(args.job)
    flags = jobfile.cli_flags(args)
    points = expand_sweep(list(args.sweep))
    # Every point is validated before anything is written or submitted.
    cfgs = [commandpaths.pinned(jobfile.resolve(job, [*args.overrides, *p.overrides], flags)) for p in points] or \
        [commandpaths.pinned(jobfile.resolve(job, args.overrides, flags))]
    if any(c.slurm != cfgs[0].slurm for c in cfgs):
        raise UsageError("the sweep varies [slurm] settings, but one job array shares one set of "
                         "resources", "sweep [train]/[data]/[checkpoint] keys; submit separate jobs "
                         "for different resources")
    for line in entrycheck.unused_overrides(cfgs[0], [*args.overrides, *(o for p in points for o in p.overrides)]):
        console.warn(line)
    backend = choose.for_request(args.backend)
    if args.dry_run:
        return dry_run(cfgs, points, backend, str(job), args.run_dir)
    name = cfgs[0].name + ("-sweep" if points else "")
    root = Path(args.run_dir) if args.run_dir else rundir.new_run_dir("runs", name)
    return launch(cfgs, points, backend, root, _command(args, str(job), backend), str(job),
                  wait_for=args.wait)


def launch(cfgs: list[JobConfig], points: list[SweepPoint], backend: Backend, root: Path,
           command: list[str], job: str, *, wait_for: bool = False) -> int:
    """Validate, prepare the run dir(s) and submit (`ddpjob submit`, `ddpjob resume`)."""
    backend.preflight(cfgs[0], root)
    # One run: a run dir of the same training is reused (elastic resume at other resources),
    # as `ddpjob sbatch` and `ddpjob run` do. A sweep's folder must be new.
    state = rundir.NEW if points else rundir.check_reuse(root, cfgs[0])
    if state != rundir.NEW:
        rundir.refuse_completed(root)
        runs.check_idle(root)
        console.info(f"ddpjob: {root}: " + ("the same job again" if state == rundir.SAME else
                     f"same training, new resources/length: {rundir.CONFIG} updated")
                     + "; it resumes from its newest checkpoint")
    _doctor_checks(cfgs, root, on_slurm=backend.on_slurm)
    share = cfgs[0].slurm.share_group
    rundir.private_umask(share)  # the pickle submitit writes and the job's SLURM_UMASK too
    created = _make_root(root, share) if state == rundir.NEW else None
    try:
        run_dirs = [root / p.id for p in points] if points else [root]
        earlier = fileio.read_record(root / rundir.JOB) if state != rundir.NEW else {}
        if earlier:  # the earlier job's supervisor state would read as this job's (its events stay)
            (root / local.LOCAL).unlink(missing_ok=True)
        for d, cfg in zip(run_dirs, cfgs):
            rundir.make_dir(d, share)
            rundir.make_dir(d / rundir.LOGS, share)
            if state != rundir.SAME:
                fileio.write_text_atomic(d / rundir.CONFIG, cfg.to_json())
            if not (d / freeze.RECORD).is_file():  # a resubmission keeps the code it was frozen with
                freeze.freeze(cfg, d)
        log_dir = root / rundir.LOGS
        since = {d: control.log_offsets(d) for d in run_dirs}  # --wait: this job's lines only
        records = backend.submit(cfgs, run_dirs, log_dir, command)
        if earlier:  # the run's earlier jobs stay in its chain (status --json: job_ids)
            chain = [str(j) for j in (earlier.get("job_ids") or [earlier.get("job_id")]) if j]
            records[0]["job_ids"] = [*chain, records[0]["job_id"]]
        for d, rec in zip(run_dirs, records):
            fileio.write_json_atomic(d / rundir.JOB, rec)
        if points:
            fileio.write_json_atomic(root / "sweep.json", {
                "job": str(job), "backend": backend.name,
                "job_id": (records[0]["array"] or records[0])["job_id"],
                "axes": {k: [p.values[k] for p in points] for k in points[0].values},
                "points": [{"id": p.id, "index": p.index, "values": p.values} for p in points]})
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    _print_submitted(cfgs[0], backend, run_dirs, records)
    if wait_for:
        return wait(run_dirs, since)
    return 0


def _command(args: argparse.Namespace, job: str, backend: Backend) -> list[str]:
    """The submit command line, for job.json (what to rerun to get the same job)."""
    cmd = ["ddpjob", "submit", job, "--backend", backend.name, *jobfile.cli_flag_words(args)]
    for item in args.overrides:
        cmd += ["--set", item]
    for item in args.sweep:
        cmd += ["--sweep", item]
    return cmd


def _print_submitted(cfg: JobConfig, backend: Backend, run_dirs: list[Path], records: list[dict]) -> None:
    s = cfg.slurm
    rows = []
    for d, rec in zip(run_dirs, records):
        logs = backend.log_pattern(d, rec)
        rows.append([rec["job_id"], str(d), logs, f"{s.nodes} x {s.tasks_per_node}",
                     s.partition or ("(default)" if backend.on_slurm else "-")])
    console.table(f"submitted ({backend.name})", ["job id", "run dir", "logs", "nodes x tasks", "partition"],
                  rows)


def wait(run_dirs: list[Path], since: dict[Path, dict[Path, int]]) -> int:
    """--wait: stream rank 0's log of each run, from where it was at submission (`since`:
    control.log_offsets), until it ends; 0 only if every run completed."""
    ok = True
    for d in run_dirs:
        try:
            info = control.follow(d, rank=0, since=since.get(d))
        except KeyboardInterrupt:
            console.warn(f"stopped waiting; the job goes on (`ddpjob status {d}`, "
                         f"`ddpjob cancel {d}` to stop it)")
            return 130
        console.info(f"ddpjob: {d}: {info.state}" + (f" ({info.reason})" if info.reason else ""))
        ok = ok and info.state == "COMPLETED"
    return 0 if ok else 1

