"""The local backend (`ddpjob submit --backend local`): the detached supervisor of
launch/local.py plays SLURM's part on this machine; its state is RUN_DIR/local.json.

Login side: starts the supervisor, reads its state, signals it (it forwards to the ranks).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ddpjob import console, fileio, rundir
from ddpjob.config import JobConfig
from ddpjob.errors import DDPJobError
from ddpjob.launch.backends import TERMINAL, JobState
from ddpjob.slurm import Incarnation
from ddpjob.launch.local import LOCAL, rank_command  # the supervisor's state file, what each rank runs

SUPERVISOR = "ddpjob.launch.local"
EXEC_WAIT_S = 2.0  # the longest a started process may show no command line (pid_alive)


def pid_alive(pid: int | None, marker: str = SUPERVISOR) -> bool:
    """Alive, not a zombie, and still our supervisor (pids are reused).

    A process in the middle of its exec has no command line yet: the kernel closes the
    parent's CLOEXEC pipe, so Popen returns, before it lays out the new argv. A reader right
    after a submit (verify, `status`) saw that empty line as "gone" on a loaded machine; it
    waits out the exec instead (35 ms at most, measured on the 2-core test VM)."""
    if not pid:
        return False
    deadline = time.monotonic() + EXEC_WAIT_S
    while True:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        if stat.rsplit(")", 1)[-1].split()[0] == "Z":
            return False
        if raw or time.monotonic() > deadline:  # a kernel thread's line stays empty: not ours
            return marker in raw.replace(b"\0", b" ").decode(errors="replace")
        time.sleep(0.005)


def submit_local(run_dirs: list[Path], log_dir: Path, command: list[str],
                 rank_command: str | None = None) -> list[dict[str, Any]]:
    """Start the supervisor in its own session (it outlives this command) and return.
    `rank_command` replaces `ddpjob run` (tests drive the supervisor with fake ranks)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", SUPERVISOR, *[str(d.resolve()) for d in run_dirs]]
    if rank_command:
        argv += ["--rank-command", rank_command]
    with open(log_dir / "supervisor.log", "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base, n = f"local-{proc.pid}", len(run_dirs)
    return [{"backend": "local", "job_id": base if n == 1 else f"{base}_{i}",
             "pid": proc.pid, "submitted_at": time.time(), "command": command,
             "supervisor_log": str(log_dir / "supervisor.log"),
             "array": None if n == 1 else {"job_id": base, "index": i, "count": n}}
            for i in range(n)]


def skip_if_pending(run_dir: Path, state: str, reason: str) -> bool:
    """A sweep point not started yet: marked CANCELLED, which its supervisor skips."""
    if state != "PENDING" or not (run_dir / LOCAL).is_file():
        return False
    rec = fileio.read_record(run_dir / LOCAL)
    fileio.write_json_atomic(run_dir / LOCAL, {**rec, "state": "CANCELLED", "reason": reason})
    return True


class LocalBackend:
    """The supervisor's processes on this machine (launch/local.py)."""

    name = "local"
    on_slurm = False
    can_stop = True

    def preflight(self, cfg: JobConfig, root: Path) -> None:
        return None  # nothing to ask: doctor's local checks run for every backend

    def dry_run(self, cfg: JobConfig, job: str, root: Path, run_dirs: list[Path]) -> None:
        console.info(f"# local backend: a supervisor would start {cfg.slurm.world_size} rank(s), each:")
        console.info(shlex.join(rank_command(root)))

    def submit(self, cfgs: list[JobConfig], run_dirs: list[Path], log_dir: Path,
               command: list[str]) -> list[dict[str, Any]]:
        return submit_local(run_dirs, log_dir, command)

    def states(self, job_ids: list[str]) -> dict[str, dict[str, Any]]:
        return {}  # each run's local.json says it

    def incarnations(self, job_ids: list[str]) -> dict[str, list[Incarnation]]:
        return {}  # no queue: the supervisor starts the ranks at once

    def state(self, run_dir: Path, job: dict[str, Any], known: dict[str, dict[str, Any]] | None) -> JobState:
        # the supervisor's life first, its record second: it writes its end into local.json before
        # it exits, so a record read after the pid is gone is its last. The other order read a
        # record from before the end and a pid from after it, and took a finished run for one
        # whose supervisor died (`submit --wait` ended 1 on a COMPLETED run, CI 2026-11-29)
        alive = pid_alive(job.get("pid"))
        rec = fileio.read_record(run_dir / LOCAL) or None
        if rec is None:
            return JobState("PENDING" if alive else "FAILED",
                            "" if alive else "the supervisor is gone; see logs/supervisor.log")
        out = JobState(rec.get("state", "UNKNOWN"), rec.get("reason", ""), int(rec.get("restarts", 0)))
        if out.state not in TERMINAL and not alive:
            out.state, out.reason = "FAILED", "the supervisor died; see logs/supervisor.log"
        return out

    def cancel(self, run_dir: Path, job: dict[str, Any], state: str) -> None:
        if not skip_if_pending(run_dir, state, "cancelled before it started") and pid_alive(job.get("pid")):
            os.kill(int(job["pid"]), signal.SIGTERM)  # the supervisor forwards it to the ranks

    def stop(self, run_dir: Path, job: dict[str, Any], state: str) -> str:
        if skip_if_pending(run_dir, state, "stopped before it started"):
            return "it had not started, so it will not"
        if pid_alive(job.get("pid")):
            os.kill(int(job["pid"]), signal.SIGUSR2)  # the supervisor forwards it to the ranks
            return "the ranks write a checkpoint at their next step and end"
        raise DDPJobError(f"the supervisor of '{run_dir}' is not running, expected a live local run",
                          f"`ddpjob status {run_dir}` shows how it ended")

    def log_files(self, run_dir: Path, rank: int, job: dict[str, Any]) -> list[Path]:
        return [run_dir / rundir.LOGS / f"rank-{rank}.log"]

    def log_pattern(self, run_dir: Path, record: dict[str, Any]) -> str:
        return f"{run_dir / rundir.LOGS}/rank-<rank>.log"
