"""`ddpjob sbatch JOB.toml -o FILE`: a standalone sbatch script plus its run directory.

Login node, after jobfile.py and render.py: resolves the job, renders the script (pure), then
writes RUN_DIR/config.json, RUN_DIR/logs/, RUN_DIR/job.sbatch and FILE. Every check runs before
the first write, and on a failure nothing half-written is left: no new run dir, FILE untouched.
"""

from __future__ import annotations

import argparse
import importlib.resources
import os
import shutil
import sys
from pathlib import Path

from ddpjob import commandpaths, config, console, fileio, freeze, jobfile, rundir
from ddpjob.errors import DDPJobError
from ddpjob.launch import commandcheck, entrycheck, render
from ddpjob.launch.backends.sbatch_slurm import SCRIPT  # RUN_DIR/job.sbatch, what a resume resubmits


def cmd_sbatch(args: argparse.Namespace) -> int:
    job = locate_job(args.job)
    flags = jobfile.cli_flags(args)
    cfg = commandpaths.pinned(jobfile.resolve(job, args.overrides, flags))
    rundir.private_umask(cfg.slurm.share_group)
    if not getattr(args, "no_data_check", False):
        _check_data(cfg)
    from ddpjob.launch import doctor

    # train.entry and init_from, as submit checks them: wrong now, wrong after the queue wait
    doctor.raise_on_failures(doctor.code_checks(cfg))
    commandcheck.check(cfg, strict=False)  # the script is looked for where sbatch will be typed
    for line in entrycheck.unused_overrides(cfg, list(args.overrides)):
        console.warn(line)
    template = render.load_template(args.template)
    to_stdout = args.output == "-"
    out = None if to_stdout else fileio.UserOutput(args.output)
    run_dir = Path(args.run_dir or rundir.new_run_dir("runs", cfg.name)).absolute()
    # The interpreter that runs ddpjob here runs the ranks too (same venv on a shared filesystem).
    script = render.render_sbatch(cfg, run_dir=run_dir, python=os.path.abspath(sys.executable),
                                  template=template)
    reuse = _check_run_dir(run_dir, cfg)

    if out is not None:
        out.stage(script.encode())  # a new or regular file: beside it, renamed over it last
    try:
        _write_run_dir(run_dir, cfg, script, reuse)
        if out is not None:
            out.commit()  # the commit point: FILE changes whole, or not at all
    finally:
        if out is not None:
            out.discard()

    if to_stdout:  # stdout holds the script: the report goes to stderr
        sys.stdout.write(script)
        sys.stdout.flush()
    s = cfg.slurm
    lines = [f"wrote {out.path if out is not None else 'the script to stdout'} "
             f"(copy in {run_dir / SCRIPT})",
             f"job {cfg.name}: {s.nodes} node(s) x {s.tasks_per_node} task(s), time {s.time}",
             f"run dir {run_dir}",
             f"logs {run_dir / rundir.LOGS}/batch-<job id>.out and rank-<R>.log",
             f"next: sbatch {out.path if out is not None else run_dir / SCRIPT}"]
    for line in lines:
        # the script went to stdout, or to a device or pipe that may be stdout (-o /dev/stdout)
        if to_stdout or (out is not None and out.in_place):
            print(f"ddpjob: {line}", file=sys.stderr, flush=True)
        else:
            console.info(line)
    return 0


def locate_job(job: str) -> Path:
    """The job file: a path that exists, else one of the examples shipped inside ddpjob, so a
    non-editable install still has them: `smoke`, `smoke.toml` and `jobs/smoke.toml` all name
    ddpjob's own jobs/smoke.toml when no such file exists here."""
    p = Path(job)
    if p.exists() or p.parent not in (Path("."), Path("jobs")):
        return p
    name = p.name if p.suffix == ".toml" else f"{p.name}.toml"
    bundled = importlib.resources.files("ddpjob.jobs").joinpath(name)
    if bundled.is_file():
        return Path(str(bundled))
    return p  # jobfile.resolve reports it as missing


def _check_data(cfg: config.JobConfig) -> None:
    """CIFAR-10 must be in place before the job waits in the queue (the nodes read data.root
    relative to this folder, sbatch's default working directory). The cheap form of the check
    doctor runs; --no-data-check skips it where the nodes see another filesystem."""
    if cfg.data.dataset != "cifar10":
        return
    from ddpjob.launch.dataprep import cifar10_problem

    problem = cifar10_problem(cfg.data.root, full=False)
    if problem is not None:
        raise DDPJobError(f"data.root '{cfg.data.root}' is not ready: {problem}, expected "
                          "CIFAR-10 in place before the job is queued",
                          f"run `ddpjob data cifar10 --root {cfg.data.root}`, or pass "
                          "--no-data-check if only the compute nodes see that path")


def _check_run_dir(run_dir: Path, cfg: config.JobConfig) -> bool:
    """True if `run_dir` is an existing run dir of this very config (it is reused as is)."""
    state = rundir.check_reuse(run_dir, cfg)
    if state != rundir.NEW:
        rundir.refuse_completed(run_dir)
    if state == rundir.RESIZED:
        # Same training, other resources or length (e.g. --nodes 1 after a preemption): the
        # checkpoints resume elastically, so the run dir takes the new resources.
        print(f"ddpjob: {run_dir}: same training, new resources/length: {rundir.CONFIG} updated; "
              "the job resumes from its newest checkpoint", file=sys.stderr)
    return state == rundir.SAME


def _write_run_dir(run_dir: Path, cfg: config.JobConfig, script: str, reuse: bool) -> None:
    """config.json (once, atomically), logs/, job.sbatch; removes what it created on failure."""
    top = next((p for p in [*reversed(run_dir.parents), run_dir] if not p.exists()), None)
    made: list[Path] = []
    try:
        rundir.make_dir(run_dir, cfg.slurm.share_group)  # 0700/0750 whatever the umask
        for path in (run_dir / rundir.LOGS,):
            if not path.exists():
                rundir.make_dir(path, cfg.slurm.share_group)
                made.append(path)
        fileio.write_text_atomic(run_dir / SCRIPT, script)
        if not (run_dir / freeze.RECORD).is_file():  # a reused run dir keeps its frozen code
            freeze.freeze(cfg, run_dir)
            made.append(run_dir / freeze.CODE)
            made.append(run_dir / freeze.RECORD)
        if not reuse:  # last: an existing config.json is replaced only once all else worked
            existed = (run_dir / rundir.CONFIG).exists()
            fileio.write_text_atomic(run_dir / rundir.CONFIG, cfg.to_json())
            if not existed:
                made.append(run_dir / rundir.CONFIG)
    except OSError as exc:
        _undo(top, made)
        raise DDPJobError(f"cannot create run dir '{run_dir}' ({exc.strerror}), expected a "
                          "writable folder", "choose a --run-dir on a writable shared filesystem"
                          ) from None
    except BaseException:
        _undo(top, made)
        raise


def _undo(top: Path | None, made: list[Path]) -> None:
    if top is not None:  # we created the run dir (and maybe parents): remove all of it
        shutil.rmtree(top, ignore_errors=True)
        return
    for path in reversed(made):  # an empty folder the user gave us: leave it empty again
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
