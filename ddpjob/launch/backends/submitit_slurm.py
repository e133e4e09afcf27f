"""The submitit backend (`ddpjob submit` on SLURM): one SlurmExecutor job, or one job array for a
sweep, whose pickled callable is NodeTask(run_dir) (ddpjob/rank/task.py).

Login side. slurm_parameters maps the job to submitit's parameters through the one [slurm] ->
sbatch mapping (launch/slurmopts.py); the guard lines open the script body submitit writes.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import math
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpjob import console, fileio, freeze, rundir, scriptsafe, validate
from ddpjob.config import JobConfig
from ddpjob.errors import DDPJobError
from ddpjob.launch import container
from ddpjob.launch import slurmopts
from ddpjob.launch.backends.slurmjobs import SlurmJobs

# Options submitit writes itself under these parameter names (job_name: its default would be
# "submitit"); any other option goes through additional_parameters, which submitit writes last,
# over its own defaults (time in whole minutes, USR2@signal_delay_s).
_NAMED = {"job-name": "job_name", "ntasks-per-node": "ntasks_per_node", "cpus-per-task": "cpus_per_task",
          "gpus-per-node": "gpus_per_node"}
# The node-side callable, by module path: the login side never imports the rank layer.
NODE_TASK = "ddpjob.rank.task"


def slurm_parameters(cfg: JobConfig, folder: Path | None = None, *,
                     run_dirs: Sequence[Path] = ()) -> dict[str, Any]:
    """SlurmExecutor.update_parameters(...) for a job: the pure mapping from [slurm].

    `folder` is submitit's log (and pickle) folder, RUN_DIR/logs (a sweep's: SWEEP/logs): given,
    the script first refuses to start if it or the run dir is writable by others, and puts each
    run dir's frozen code first on PYTHONPATH (see guard_lines); `run_dirs` are the runs the
    script serves (default: folder's parent; a sweep's points: one job array)."""
    s = cfg.slurm
    own, extra = slurmopts.sbatch_options(cfg)
    params: dict[str, Any] = {
        # submitit wants whole minutes (it also times its own timeout logic with them); the
        # exact limit still reaches sbatch through additional_parameters ("time").
        "time": max(1, math.ceil(validate.parse_time_s(s.time) / 60)),
        "signal_delay_s": s.signal_lead_s,
        # As in the template: one failed rank ends the step instead of leaving the others
        # hanging in a collective until the time limit.
        "srun_args": ["--kill-on-bad-exit=1"],
    }
    params.update({_NAMED[k]: v for k, v in own if k in _NAMED})
    if folder is not None:  # [slurm] container, pyxis: srun's options (apptainer: see _python)
        params["srun_args"] += container.srun_options(cfg, str(folder.parent), sys.executable)
    # submitit writes setup lines right after the #SBATCH block, where sbatch still reads
    # directives: the guard's first line is a command, which ends that scan (and the
    # scriptsafe checks refuse setup lines starting with '#' anyway: sbatch_options ran them).
    params["setup"] = [*guard_lines(cfg, folder, run_dirs), *s.setup,
                       *(slurmopts.warm_server_lines(cfg, shlex.quote(sys.executable), _run_dir(folder, run_dirs),
                                                   "command srun") if folder is not None else [])]
    params["additional_parameters"] = {k: v for k, v in [*own, *extra] if k not in _NAMED}
    return params


def guard_lines(cfg: JobConfig, folder: Path | None, run_dirs: Sequence[Path] = ()) -> list[str]:
    """Shell lines that open submitit's script body (before srun).

    The trap and the one srun restart loop (slurmopts.batch_shell_lines, as in the template):
    submitit's own srun line goes through `ddpjob_srun`, which runs srun on the allocation's
    nodes (the task count recomputed from the allocation: after an elastic shrink of the pending
    job SLURM_NTASKS still holds the submission's) and again after a crash the policy retries in
    place. Without a folder (no script to serve), only the task count. The frozen code: each run the script serves froze its code into
    its own run dir; a sweep's job array has one script for all its points, SWEEP/<array index>
    (SweepPoint.id), so the index picks the point's. The permission guard: submitit unpickles
    RUN_DIR/logs/*_submitted.pkl at every start, so whoever can write that folder runs code as
    the job's user. Run dirs are created 0700 (0750 with slurm.share_group); this refuses a
    folder someone loosened since, before the pickle is read."""
    lines = [f"DDPJOB_NODES={slurmopts.node_count(cfg)}",
             f"export SLURM_NTASKS={slurmopts.task_count(cfg, 'DDPJOB_NODES')} "
             f"SLURM_NPROCS={slurmopts.task_count(cfg, 'DDPJOB_NODES')}"]
    if folder is None:
        return lines
    # the trap and the one restart loop (as in the template); submitit's own srun line runs through it
    lines = [*slurmopts.batch_shell_lines(cfg, shlex.quote(sys.executable), _run_dir(folder, run_dirs)),
             'srun() { ddpjob_srun "$@"; }']
    lines.append(f"export PYTHONPATH={_code_path(folder, run_dirs)}${{PYTHONPATH:+:$PYTHONPATH}} PYTHONSAFEPATH=1")
    dirs = " ".join(shlex.quote(str(d)) for d in (folder.parent, folder))
    lines.append(f"for DDPJOB_D in {dirs}; do if [ -n \"$(find \"$DDPJOB_D\" -maxdepth 0 "
                 "\\( -perm /022 -o ! -user \"$(id -u)\" \\) 2>/dev/null)\" ]; then echo "
                 "\"ddpjob: $DDPJOB_D is writable by others or not owned by $(id -un): refusing "
                 "to unpickle the job from it (chmod go-w it, then resubmit)\" >&2; exit 1; fi; "
                 "done")
    # the pickles too: a group-writable one in a 0750 folder is still code others wrote
    logs = shlex.quote(str(folder))
    lines.append(f"for DDPJOB_F in {logs}/*.pkl; do if [ -e \"$DDPJOB_F\" ] && [ -n \"$(find "
                 "\"$DDPJOB_F\" -maxdepth 0 \\( -perm /022 -o ! -user \"$(id -u)\" \\) 2>/dev/null)\" ]; "
                 "then echo \"ddpjob: $DDPJOB_F is writable by others or not owned by $(id -un): refusing "
                 "to unpickle it (resubmit)\" >&2; exit 1; fi; done")
    return lines


def _run_dir(folder: Path, run_dirs: Sequence[Path]) -> str:
    """The run dir the script serves, quoted for the shell (a sweep's: by its array index)."""
    return (f"{shlex.quote(str(folder.parent))}/\"$SLURM_ARRAY_TASK_ID\"" if len(run_dirs) > 1
            else shlex.quote(str(run_dirs[0] if run_dirs else folder.parent)))


def _code_path(folder: Path, run_dirs: Sequence[Path]) -> str:
    """The frozen code's folder (launch/freeze.py) of the run this job (array task) serves,
    quoted for the shell: never the log folder's parent for a sweep, which froze nothing."""
    if len(run_dirs) > 1:  # SLURM sets the index: digits only, quoted all the same
        point = freeze.python_path(Path("POINT")).relative_to("POINT")
        return f"{shlex.quote(str(folder.parent))}/\"$SLURM_ARRAY_TASK_ID\"/{shlex.quote(str(point))}"
    return shlex.quote(str(freeze.python_path(run_dirs[0] if run_dirs else folder.parent)))


def _python(cfg: JobConfig, folder: Path) -> str:
    """The interpreter command submitit runs under srun: inside `apptainer exec ...` with
    [slurm] container (submitit's `python` parameter exists for exactly this), through the
    node's warm-start server with slurmopts.warm_start."""
    words = [*container.exec_prefix(cfg, str(folder.parent), sys.executable),
             container.interpreter(cfg, sys.executable)]
    if slurmopts.warm_start(cfg):  # submitit appends `-u -m submitit.core._submit FOLDER`
        words += slurmopts.WARM_CLIENT.split()
    return " ".join(shlex.quote(w) for w in words)


def submitit_command(cfg: JobConfig, folder: Path) -> str:
    """What submitit runs under srun (SlurmExecutor._submitit_command_str)."""
    return f"{_python(cfg, folder)} -u -m submitit.core._submit {shlex.quote(str(folder))}"


def sbatch_text(cfg: JobConfig, folder: Path, run_dirs: Sequence[Path] = ()) -> str:
    """The script submitit would submit, without submitting (for --dry-run).

    submitit has no public way to render its script without submitting, so this calls the
    private function SlurmExecutor itself renders with: the dry run prints byte for byte what a
    submission writes. A script of our own would drift from submitit's; tests/unit/test_submit.py's
    sbatch_text tests fail first if a submitit release renames or changes it."""
    from submitit.slurm.slurm import _make_sbatch_string

    scriptsafe.run_dir(str(folder), submitit=True)
    return _make_sbatch_string(command=submitit_command(cfg, folder), folder=folder,
                               map_count=len(run_dirs) if len(run_dirs) > 1 else None,
                               **slurm_parameters(cfg, folder, run_dirs=run_dirs))


class SubmititBackend(SlurmJobs):
    """`ddpjob submit --backend slurm`: submitit's SlurmExecutor."""

    def preflight(self, cfg: JobConfig, root: Path) -> None:
        super().preflight(cfg, root)
        # the same checks as `ddpjob sbatch`, before anything is written
        scriptsafe.run_dir(str(root.absolute() / rundir.LOGS), submitit=True)

    def dry_run(self, cfg: JobConfig, job: str, root: Path, run_dirs: list[Path]) -> None:
        text = sbatch_text(cfg, root / rundir.LOGS, run_dirs)  # a refused value prints nothing but its error
        console.info(f"# sbatch script submitit would submit for {job} (nothing submitted)")
        console.info(text)

    def submit(self, cfgs: list[JobConfig], run_dirs: list[Path], log_dir: Path,
               command: list[str]) -> list[dict[str, Any]]:
        """One job, or one job array for a sweep. Returns the job.json records (one per run dir)."""
        import submitit
        from submitit.core.utils import FailedJobError

        log_folder = log_dir.resolve()
        cfg = cfgs[0]  # resources are the same for every point; a sweep varies the training
        ex = submitit.SlurmExecutor(folder=log_folder, max_num_timeout=cfg.slurm.max_requeues,
                                    python=_python(cfg, log_folder))
        scriptsafe.run_dir(str(log_folder), submitit=True)
        ex.update_parameters(**slurm_parameters(cfg, log_folder, run_dirs=run_dirs))
        # By name: the pickle refers to ddpjob.rank.task.NodeTask, which the nodes import.
        task = importlib.import_module(NODE_TASK).NodeTask
        try:
            # submitit echoes sbatch's stderr on failure; we report it in our one line instead.
            with contextlib.redirect_stderr(io.StringIO()):
                if len(run_dirs) == 1:
                    jobs = [ex.submit(task(run_dirs[0]))]
                else:
                    jobs = ex.submit_array([task(d) for d in run_dirs])
        except FailedJobError as exc:
            lines = [ln for ln in str(exc).splitlines() if ln.strip()]
            why = " ".join((lines[-1] if lines else str(exc)).split()).removeprefix("sbatch: error: ")
            hint = ("check slurm.partition against `sinfo`" if "partition" in why.lower() else
                    "check slurm.constraint against `sinfo -o '%N %f'`" if "feature" in why.lower() else
                    "check the [slurm] section; `ddpjob submit --dry-run` prints the script")
            raise DDPJobError(f"sbatch refused the job: {why}", hint) from None
        script = Path(jobs[0].paths.submission_file).read_text()
        records = []
        for i, (job, d) in enumerate(zip(jobs, run_dirs)):
            fileio.write_text_atomic(d / "job.sbatch", script)
            rec = {"backend": self.name, "job_id": job.job_id, "submitted_at": time.time(),
                   "command": command, "log_folder": str(log_folder), "array": None}
            if len(run_dirs) > 1:
                rec["array"] = {"job_id": job.job_id.split("_")[0], "index": i, "count": len(run_dirs)}
            records.append(rec)
        return records

    def log_files(self, run_dir: Path, rank: int, job: dict[str, Any]) -> list[Path]:
        """logs/rank-R.log, then submitit's <job id>_<R>_log.out/.err of each job of the run
        (successor jobs: each id's logs, in order; same names across requeues: --open-mode=append)."""
        files = self.rank_logs(run_dir, rank)
        if job.get("job_id"):
            folder = Path(job.get("log_folder") or run_dir / rundir.LOGS)
            for jid in job.get("job_ids") or [job["job_id"]]:
                files += [folder / f"{jid}_{rank}_log.{ext}" for ext in ("out", "err")]
        return files

    def log_pattern(self, run_dir: Path, record: dict[str, Any]) -> str:
        return f"{record['log_folder']}/{record['job_id']}_<rank>_log.out"
