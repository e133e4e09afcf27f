"""The sbatch backend: runs made by `ddpjob sbatch` (templates/sbatch.sh.tmpl), which the user
submits with `sbatch`; job.json says `"via": "sbatch"` once ddpjob resubmits one (resume).

Login side. A resume renders the template again (new resources included) and submits it with
sbatch; status, cancel and stop are those of any SLURM job (slurmjobs.py).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from ddpjob import console, fileio, rundir, slurm
from ddpjob.config import JobConfig
from ddpjob.errors import DDPJobError, UsageError
from ddpjob.launch import render
from ddpjob.launch.backends.slurmjobs import SlurmJobs

SCRIPT = "job.sbatch"


class SbatchBackend(SlurmJobs):
    """A run dir whose job is RUN_DIR/job.sbatch, rendered from the template."""

    via = "sbatch"  # job.json's mark (its "backend" is "slurm", as for submitit)

    def script(self, cfg: JobConfig, run_dir: Path) -> str:
        # The interpreter that runs ddpjob here runs the ranks too (same venv on a shared filesystem).
        return render.render_sbatch(cfg, run_dir=run_dir.absolute(), python=os.path.abspath(sys.executable))

    def dry_run(self, cfg: JobConfig, job: str, root: Path, run_dirs: list[Path]) -> None:
        console.info(f"# sbatch script for {job} (nothing submitted)")
        console.info(self.script(cfg, root))

    def submit(self, cfgs: list[JobConfig], run_dirs: list[Path], log_dir: Path,
               command: list[str]) -> list[dict[str, Any]]:
        if len(run_dirs) != 1:
            raise UsageError("a `ddpjob sbatch` script runs one run dir, not a sweep",
                             "use `ddpjob submit --sweep` for a job array")
        run = run_dirs[0]
        fileio.write_text_atomic(run / SCRIPT, self.script(cfgs[0], run))
        return [self.sbatch(run, command)]

    def sbatch(self, run: Path, command: list[str]) -> dict[str, Any]:
        """Submit RUN_DIR/job.sbatch; the job.json record of the new job."""
        new = slurm.submit(run.absolute() / SCRIPT, cwd=run.absolute())
        if isinstance(new, slurm.Failed):
            raise DDPJobError(f"sbatch refused the job: {new.why}",
                              "check the [slurm] section; `ddpjob doctor` checks partitions and limits")
        return {"backend": self.name, "via": self.via, "job_id": new, "submitted_at": time.time(),
                "command": command}

    def resubmit(self, run: Path, cfg: JobConfig, job: dict[str, Any], command: list[str]) -> str:
        """`ddpjob resume` of such a run: the template again (new resources included), then
        sbatch; job.json keeps the run's earlier job ids. Returns the new job id."""
        state = rundir.check_reuse(run.absolute(), cfg)
        script = self.script(cfg, run)
        self.preflight(cfg, run)
        fileio.write_text_atomic(run / SCRIPT, script)
        if state != rundir.SAME:
            fileio.write_text_atomic(run / rundir.CONFIG, cfg.to_json())
        rec = self.sbatch(run, command)
        chain = [str(j) for j in (job.get("job_ids") or [job.get("job_id")]) if j]
        rec = {**rec, "job_ids": [*chain, rec["job_id"]]}
        fileio.write_json_atomic(run / rundir.JOB, {k: rec[k] for k in ("backend", "via", "job_id", "job_ids",
                                                                       "submitted_at", "command")})
        return str(rec["job_id"])

    def log_files(self, run_dir: Path, rank: int, job: dict[str, Any]) -> list[Path]:
        return self.rank_logs(run_dir, rank)  # the template's srun --output

    def log_pattern(self, run_dir: Path, record: dict[str, Any]) -> str:
        return f"{run_dir / rundir.LOGS}/rank-<rank>.log"
