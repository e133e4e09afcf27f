"""Which backend: chosen once, from --backend for a new submission (for_request) or from a
run's job.json for everything after it (of_record). The only place backend names are compared.
"""

from __future__ import annotations

import shutil
from typing import Any

from ddpjob.errors import DDPJobError
from ddpjob.launch.backends import Backend
from ddpjob.launch.backends.local_procs import LocalBackend
from ddpjob.launch.backends.sbatch_slurm import SbatchBackend
from ddpjob.launch.backends.submitit_slurm import SubmititBackend
from ddpjob.launch.backends.torchrun_procs import TorchrunBackend

SUBMITIT, SBATCH, LOCAL, TORCHRUN = SubmititBackend(), SbatchBackend(), LocalBackend(), TorchrunBackend()


def for_request(requested: str) -> Backend:
    """`--backend auto|slurm|local` of submit (auto: SLURM where sbatch is on PATH)."""
    if requested == "auto":
        return SUBMITIT if shutil.which("sbatch") else LOCAL
    if requested == "slurm" and shutil.which("sbatch") is None:
        raise DDPJobError("--backend slurm needs `sbatch`, which is not on PATH",
                          "run on a SLURM login node, or use --backend local")
    return SUBMITIT if requested == "slurm" else LOCAL


def of_record(job: dict[str, Any]) -> Backend | None:
    """The backend of a run's job.json record (runs.job_record); None for none or an
    unknown one (status shows it as UNKNOWN)."""
    if job.get("backend") == "local":
        return LOCAL
    if job.get("backend") == "torchrun":
        return TORCHRUN
    if job.get("backend") == "slurm":
        return SBATCH if job.get("via") == SBATCH.via else SUBMITIT
    return None
