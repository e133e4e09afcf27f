"""The backends a run's job goes through, as types: submitit on SLURM (submitit_slurm.py), a
`ddpjob sbatch` script on SLURM (sbatch_slurm.py), the local supervisor (local_procs.py).

Login side, never imports torch. `choose.py` picks the backend once, from --backend for a new
submission or from a run's job.json for everything after it (status, logs, cancel, stop, resume);
no other module compares backend names. This module holds what they share: the protocol and the
job state they report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ddpjob.config import JobConfig
from ddpjob.slurm import Incarnation

# SLURM states after which nothing more will happen (a requeued job goes back to PENDING).
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "STOPPED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                      "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT", "LOST"})


@dataclass
class JobState:
    """What the scheduler says about a run's job (status merges it with the run dir's records)."""
    state: str = "UNKNOWN"
    reason: str = ""
    restarts: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # sacct's row, for status --json


class Backend(Protocol):
    """One way to run a run dir's ranks: submit, dry-run, state, cancel/stop, log files."""

    name: str  # job.json's "backend", as status shows it: "slurm" or "local"
    on_slurm: bool  # the ranks run in a SLURM allocation (doctor's cluster checks apply)
    can_stop: bool  # `ddpjob stop` reaches the ranks with the checkpoint signal, and nothing restarts them

    def preflight(self, cfg: JobConfig, root: Path) -> None:
        """Refuse in one line, before anything is written, what the scheduler would refuse."""

    def dry_run(self, cfg: JobConfig, job: str, root: Path, run_dirs: list[Path]) -> None:
        """Print what would be submitted for the job file `job` (nothing is written)."""

    def submit(self, cfgs: list[JobConfig], run_dirs: list[Path], log_dir: Path,
               command: list[str]) -> list[dict[str, Any]]:
        """Submit the prepared run dirs (a sweep's points: one job array); one job.json record each."""

    def states(self, job_ids: list[str]) -> dict[str, dict[str, Any]]:
        """The scheduler's view of many jobs in one query (status of many runs)."""

    def state(self, run_dir: Path, job: dict[str, Any], known: dict[str, dict[str, Any]] | None) -> JobState:
        """The state of the run's job (job.json), from `known` (states()) if given."""

    def incarnations(self, job_ids: list[str]) -> dict[str, list[Incarnation]]:
        """Every start of each job with its queue times, in one query (the goodput ledger's queue
        wait); {} where there is no queue or the scheduler cannot say."""

    def cancel(self, run_dir: Path, job: dict[str, Any], state: str) -> None:
        """End the job now (the ranks get SIGTERM; a pending job never starts)."""

    def stop(self, run_dir: Path, job: dict[str, Any], state: str) -> str:
        """Send the ranks the job's checkpoint signal; says what happens next."""

    def log_files(self, run_dir: Path, rank: int, job: dict[str, Any]) -> list[Path]:
        """Candidate logs of one rank, in order (successor jobs' too)."""

    def log_pattern(self, run_dir: Path, record: dict[str, Any]) -> str:
        """Where the ranks' logs appear, for the submission's table."""
