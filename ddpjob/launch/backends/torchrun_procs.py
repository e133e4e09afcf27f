"""Runs that `torchrun ... -m ddpjob run JOB.toml` (or a script on the API under torchrun) started:
no scheduler knows them, so their state is read from the run dir's records and from whether
torchrun's agent, which rank 0 recorded in job.json at the first start (rank/start.py), still lives.

Login side, never imports torch. Nothing to submit or resume through: torchrun starts them.
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path
from typing import Any

from ddpjob import rundir
from ddpjob.config import JobConfig
from ddpjob.errors import DDPJobError
from ddpjob.launch.backends import JobState
from ddpjob.launch.backends.local_procs import pid_alive
from ddpjob.ledger import events
from ddpjob.slurm import Incarnation

AGENTS = ("torchrun", "torch.distributed.run")  # the agent's command line, `torchrun` or `python -m`
_HINT = "run it under torchrun again: `torchrun ... -m ddpjob run RUN_DIR` resumes from its newest checkpoint"


def _agent_alive(job: dict[str, Any]) -> bool:
    pid = job.get("pid")
    return isinstance(pid, int) and any(pid_alive(pid, marker) for marker in AGENTS)


def _run_stops(run_dir: Path) -> tuple[int, dict[str, Any] | None]:
    """(attempts: the distinct start records, the run's last stop after the last start or None)."""
    starts, last = set(), None
    for e in events.read(run_dir):
        if e.get("event") == "start":
            starts.add((str(e.get("job_id")), e.get("restart"), e.get("time")))
            last = None
        elif events.is_stop(e) and (last is None or events.is_decision(e)):
            last = e  # the run's own decision (no `rank`) over a rank's crash record
    return len(starts), last


class TorchrunBackend:
    """A run torchrun's agent drives; job.json: backend "torchrun", job_id, pid (the agent), host."""

    name = "torchrun"
    on_slurm = False
    can_stop = False  # the agent would die of the checkpoint signal, or start the ranks again after it

    def preflight(self, cfg: JobConfig, root: Path) -> None:
        """`ddpjob resume` of such a run: refused before anything is written."""
        raise DDPJobError(f"'{root}' was started by torchrun, which ddpjob cannot start again, "
                          "expected a run of the local or slurm backend", _HINT)

    def dry_run(self, cfg: JobConfig, job: str, root: Path, run_dirs: list[Path]) -> None:
        self.preflight(cfg, root)

    def submit(self, cfgs: list[JobConfig], run_dirs: list[Path], log_dir: Path,
               command: list[str]) -> list[dict[str, Any]]:
        self.preflight(cfgs[0], run_dirs[0])
        return []

    def states(self, job_ids: list[str]) -> dict[str, dict[str, Any]]:
        return {}  # each run's records say it

    def incarnations(self, job_ids: list[str]) -> dict[str, list[Incarnation]]:
        return {}  # no queue

    def state(self, run_dir: Path, job: dict[str, Any], known: dict[str, dict[str, Any]] | None) -> JobState:
        host = job.get("host")
        remote = isinstance(host, str) and host not in (socket.gethostname(), "localhost")
        # the agent's life before the records, as local_procs.state: a run that ends between the
        # two reads is then read with its end, not as an agent gone without one
        alive = not remote and _agent_alive(job)
        attempts, last = _run_stops(run_dir)
        restarts = max(0, attempts - 1)
        if rundir.completed(run_dir) is not None:
            return JobState("COMPLETED", "", restarts)
        if remote:
            if last is None:  # only that host can see whether the agent lives
                return JobState("UNKNOWN", f"torchrun runs on {host}: `ddpjob status` there tells", restarts)
        elif alive:
            return JobState("RUNNING", f"torchrun's agent is pid {job.get('pid')}", restarts)
        if last is None:
            return JobState("FAILED", "torchrun ended without a stop recorded (killed?); see its output", restarts)
        at = f"{last.get('reason')}" + (f" at step {last['step']}" if isinstance(last.get("step"), int) else "")
        if last.get("reason") in ("crash", "budget") or "rank" in last:
            return JobState("FAILED", at, restarts)
        return JobState("STOPPED", f"{at}, checkpoint written", restarts)

    def cancel(self, run_dir: Path, job: dict[str, Any], state: str) -> None:
        if _agent_alive(job):
            os.kill(int(job["pid"]), signal.SIGTERM)  # the agent ends its ranks

    def stop(self, run_dir: Path, job: dict[str, Any], state: str) -> str:
        raise AssertionError("`ddpjob stop` refuses a torchrun run before it gets here (can_stop)")

    def log_files(self, run_dir: Path, rank: int, job: dict[str, Any]) -> list[Path]:
        return [run_dir / rundir.LOGS / f"rank-{rank}.log"]  # each rank's copy (node/teelog.py)

    def log_pattern(self, run_dir: Path, record: dict[str, Any]) -> str:
        return f"{run_dir / rundir.LOGS}/rank-<rank>.log"
