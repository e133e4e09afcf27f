"""What both SLURM backends (submitit, `ddpjob sbatch`) do the same way once a job is queued:
its state from sacct/squeue, cancel and stop through scancel, the check before submitting.

Login side; every SLURM command goes through launch/slurm.py (one adapter, `Failed` results).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from ddpjob import jobfile, rundir, slurm
from ddpjob.config import JobConfig
from ddpjob.errors import DDPJobError
from ddpjob.launch.backends import TERMINAL, JobState
from ddpjob.slurm import Incarnation

_ARRAY = re.compile(r"(\d+)_\[([0-9,\-]+)(?:%\d+)?\]", re.ASCII)


def expand_array_id(job_id: str) -> list[str]:
    """sacct/squeue's `123_[0-2,5%4]` (pending array tasks) -> 123_0 123_1 123_2 123_5."""
    m = _ARRAY.fullmatch(job_id)
    if not m:
        return [job_id]
    out = []
    for part in m.group(2).split(","):
        lo, _, hi = part.partition("-")
        out += [f"{m.group(1)}_{i}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def slurm_states(job_ids: list[str]) -> dict[str, dict[str, Any]]:
    """{job id: {state, restarts, exit, nodes}} for jobs and array tasks, one sacct call.

    `sacct -D` lists every incarnation of a requeued job; the last one is current and the
    number before it is the restart count. squeue fills in jobs sacct does not know yet."""
    bases = sorted({j.split("_")[0] for j in job_ids if j})
    if not bases:
        return {}
    out: dict[str, dict[str, Any]] = {}
    # A failed sacct/squeue leaves what the other one (or the run dir) knows: status is a view.
    rows = slurm.sacct_states(bases)
    for parts in ([] if isinstance(rows, slurm.Failed) else rows):
        if len(parts) < 4:
            continue
        for jid in expand_array_id(parts[0]):
            prev = out.get(jid)
            out[jid] = {"state": (parts[1].split() or ["UNKNOWN"])[0], "exit": parts[2],
                        "nodes": parts[3], "restarts": 0 if prev is None else prev["restarts"] + 1}
    rows = slurm.squeue_states(bases)
    for parts in ([] if isinstance(rows, slurm.Failed) else rows):
        if len(parts) < 3:
            continue
        for jid in expand_array_id(parts[0]):
            rec = out.setdefault(jid, {"restarts": 0, "exit": "", "nodes": ""})
            rec["state"], rec["reason"] = parts[1], parts[2]  # the controller is the freshest source
    return out


def preflight_slurm(cfg: JobConfig) -> None:
    """Fail in one line before anything is written: no sbatch/srun, unknown partition."""
    for tool in ("sbatch", "srun"):
        if shutil.which(tool) is None:
            raise DDPJobError(f"--backend slurm needs `{tool}`, which is not on PATH",
                              "run on a SLURM login node, or use --backend local")
    parts = slurm.partitions()
    if isinstance(parts, slurm.Failed):
        raise DDPJobError(f"sinfo did not answer ({parts.why}), expected the partition list",
                          "is the SLURM controller up? try `sinfo`")
    if cfg.slurm.partition and cfg.slurm.partition not in parts:
        raise DDPJobError(f"partition '{cfg.slurm.partition}' does not exist on this cluster "
                          f"(sinfo lists: {', '.join(parts) or 'none'})",
                          "set slurm.partition (or --partition) to one of them")


class SlurmJobs:
    """The queued job's side of both SLURM backends (Backend's state, cancel, stop)."""

    name = "slurm"
    on_slurm = True
    can_stop = True

    def preflight(self, cfg: JobConfig, root: Path) -> None:
        preflight_slurm(cfg)

    def states(self, job_ids: list[str]) -> dict[str, dict[str, Any]]:
        return slurm_states(job_ids)

    def incarnations(self, job_ids: list[str]) -> dict[str, list[Incarnation]]:
        res = slurm.incarnations_of(job_ids)
        return {} if isinstance(res, slurm.Failed) else res  # no accounting: no queue wait, said as "other"

    def state(self, run_dir: Path, job: dict[str, Any], known: dict[str, dict[str, Any]] | None) -> JobState:
        job_id = str(job.get("job_id", ""))
        if not job_id:
            return JobState()
        rec = (known if known is not None else slurm_states([job_id])).get(job_id)
        if not rec:
            return JobState()
        out = JobState(state=rec.get("state", "UNKNOWN"), restarts=rec.get("restarts", 0), extra=rec,
                       reason=rec.get("reason", "") if rec.get("reason") not in ("None", None) else "")
        if out.state in TERMINAL and out.state != "COMPLETED" and rec.get("exit"):
            out.reason = out.reason or f"exit code {rec['exit']}"
        return out

    def cancel(self, run_dir: Path, job: dict[str, Any], state: str) -> None:
        job_id = str(job["job_id"])
        res = slurm.cancel(job_id)
        if not res.ok:
            raise DDPJobError(f"{res.error}, expected the job cancelled", "check `squeue -j "
                              f"{job_id}`; you may only cancel your own jobs")

    def stop(self, run_dir: Path, job: dict[str, Any], state: str) -> str:
        job_id = str(job["job_id"])
        if state == "PENDING":  # nothing runs: there is no step to checkpoint
            res = slurm.cancel(job_id)
            said = "it was pending, so it is cancelled"
        else:
            res = slurm.send_signal(job_id, jobfile.read_run_config(run_dir).slurm.signal)
            said = "the ranks write a checkpoint at their next step and end"
        if not res.ok:
            raise DDPJobError(f"{res.error}, expected the job signalled", "check `squeue -j "
                              f"{job_id}`; you may only stop your own jobs")
        return said

    def rank_logs(self, run_dir: Path, rank: int) -> list[Path]:
        """The rank log the template's srun writes (`ddpjob sbatch` runs)."""
        return [run_dir / rundir.LOGS / f"rank-{rank}.log"]
