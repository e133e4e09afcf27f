"""The few SLURM commands P11 needs: submit, ask a job's state, release a requeued job, cancel.

bench/ is not allowed to import tests/ (slurmtools.py lives there), and ddpjob.launch.slurm
speaks for users' jobs, not for a benchmark driver, so these are the bench's own thin wrappers
over the real commands. Every query names one job id: the cluster is shared.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

# A requeueable job that was preempted goes back to PENDING: PREEMPTED is final only otherwise.
FINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "PREEMPTED", "BOOT_FAIL", "DEADLINE"})


class SlurmError(RuntimeError):
    pass


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without a surrounding job's SLURM_*/DDPJOB_* variables
    (sbatch would pass them on and the ranks would read them)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDPJOB_"))}
    env.update(extra)
    return env


def _run(args: list[str], stdin: str | None = None, cwd: Path | None = None,
         env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    for attempt in range(3):  # a busy slurmctld answers "Socket timed out": worth a retry
        proc = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=60,
                              cwd=cwd, env=env)
        if proc.returncode == 0 or "timed out" not in proc.stderr or attempt == 2:
            break
        time.sleep(2)
    if check and proc.returncode != 0:
        raise SlurmError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def up() -> bool:
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def sbatch(script: Path | str, *args: str, cwd: Path, env: dict[str, str]) -> str:
    """`sbatch --parsable`; `script` is a file, or the script's text (contains a newline)."""
    text = script if isinstance(script, str) and "\n" in script else None
    argv = ["sbatch", "--parsable", *args] + ([] if text is not None else [str(script)])
    out = _run(argv, stdin=text, cwd=cwd, env=env).stdout.strip().split(";")[0]
    if not out.isdigit():
        raise SlurmError(f"sbatch printed {out!r}, expected a job id")
    return out


def state(job_id: str) -> str | None:
    """JobState from slurmctld, or from accounting once slurmctld has forgotten the job."""
    out = _run(["scontrol", "show", "job", "-o", job_id], check=False).stdout
    for word in out.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    acct = _run(["sacct", "-n", "-X", "-P", "-o", "JobIDRaw,State", "-j", job_id], check=False).stdout
    for line in acct.splitlines():
        raw, _, st = line.partition("|")
        if raw == job_id and st:
            return st.split()[0]
    return None


def wait_state(job_id: str, wanted: Iterable[str], timeout: float) -> str:
    wanted = set(wanted)
    deadline = time.monotonic() + timeout
    while True:
        st = state(job_id)
        if st in wanted:
            return st
        if st in FINAL and st != "PREEMPTED":
            raise SlurmError(f"job {job_id} ended {st} while waiting for {sorted(wanted)}")
        if time.monotonic() > deadline:
            raise SlurmError(f"job {job_id} not in {sorted(wanted)} after {timeout:.0f} s (state {st})")
        time.sleep(0.25)


def wait_done(job_id: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while (st := state(job_id)) not in FINAL or st == "PREEMPTED" and _requeueable(job_id):
        if time.monotonic() > deadline:
            raise SlurmError(f"job {job_id} had not ended after {timeout:.0f} s (state {st})")
        time.sleep(0.5)
    return str(st)


def _requeueable(job_id: str) -> bool:
    out = _run(["scontrol", "show", "job", "-o", job_id], check=False).stdout
    return "Requeue=1" in out


def release(job_id: str) -> None:
    """Start a requeued job now instead of after its BeginTime hold (cred_expire + 1 s)."""
    _run(["scontrol", "update", f"jobid={job_id}", "starttime=now"])


def cancel(job_id: str) -> None:
    _run(["scancel", job_id], check=False)


def active(job_id: str) -> bool:
    st = state(job_id)
    return st is not None and st not in FINAL


def wait_free(timeout: float) -> None:
    """Until no job is queued or running and both nodes are idle: a leftover would share the
    cores with the storm and change every figure."""
    deadline = time.monotonic() + timeout
    while True:
        jobs = _run(["squeue", "-h", "-o", "%A"]).stdout.split()
        nodes = _run(["sinfo", "-h", "-N", "-o", "%T"]).stdout.split()
        if not jobs and nodes and all(n == "idle" for n in nodes):
            return
        if time.monotonic() > deadline:
            raise SlurmError(f"test cluster still busy after {timeout:.0f} s: jobs {jobs}, nodes {nodes}")
        time.sleep(1)
