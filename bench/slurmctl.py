"""The few SLURM commands P11 needs: submit, ask a job's state, release a requeued job, cancel.

bench/ is not allowed to import tests/ (slurmtools.py lives there), so these are the waits and
retries a benchmark driver needs, over ddpjob's one runner of SLURM commands
(ddpjob.slurm: timeouts, a failed command told from an answer). Every query names one
job id: the cluster is shared.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ddpjob import slurm

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


def _run(args: list[str], cwd: Path | None = None, env: dict[str, str] | None = None,
         check: bool = True) -> slurm.Result:
    """ddpjob's one SLURM runner (timeouts, failed told from answered), asked again when a busy
    slurmctld does not answer in time; raises SlurmError for a failure when `check`."""
    for attempt in range(3):
        res = slurm.run(args, timeout=60, env=env, cwd=cwd)
        if res.ok or not re.search(r"timed out|no answer", res.error) or attempt == 2:
            break
        time.sleep(2)
    if check and not res.ok:
        raise SlurmError(res.error)
    return res


def up() -> bool:
    return slurm.run(["sinfo", "-h"], timeout=20).ok


def sbatch(script: Path, *args: str, cwd: Path, env: dict[str, str]) -> str:
    """`sbatch --parsable ARGS SCRIPT` -> the job id."""
    out = _run(["sbatch", "--parsable", *args, str(script)], cwd=cwd, env=env).stdout.strip().split(";")[0]
    if not slurm.JOB_ID.fullmatch(out):
        raise SlurmError(f"sbatch printed {out!r}, expected a job id")
    return out


def state(job_id: str) -> str | None:
    """JobState from slurmctld, or from accounting (the newest incarnation) once slurmctld has
    forgotten the job."""
    info = slurm.show_job(job_id)
    if not isinstance(info, slurm.Failed) and info.get("JobState"):
        return info["JobState"]
    return accounted(job_id)


def accounted(job_id: str) -> str | None:
    """The newest incarnation's state in accounting (slurmdbd: asking costs slurmctld nothing)."""
    rows = slurm.sacct_states([job_id])
    states = [] if isinstance(rows, slurm.Failed) else [r[1].split()[0] for r in rows
                                                       if len(r) > 1 and r[0] == job_id and r[1]]
    return states[-1] if states else None


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
    info = slurm.show_job(job_id)
    return not isinstance(info, slurm.Failed) and info.get("Requeue") == "1"


def release(job_id: str) -> None:
    """Start a requeued job now instead of after its BeginTime hold (cred_expire + 1 s)."""
    _run(["scontrol", "update", f"jobid={job_id}", "starttime=now"])


def cancel(job_id: str) -> None:
    slurm.cancel(job_id)  # best effort: the job may be gone already


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


START = Path(__file__).resolve().parents[1] / "tests" / "cluster" / "start.sh"  # run, not imported


def node_count() -> int:
    return len(set(_run(["sinfo", "-h", "-N", "-o", "%N"]).stdout.split()))


def resize(nodes: int) -> None:
    out = subprocess.run(["bash", str(START), "--nodes", str(nodes)], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SlurmError(f"tests/cluster/start.sh --nodes {nodes} failed: {(out.stdout + out.stderr)[-1500:]}")


@contextlib.contextmanager
def at_least(nodes: int, log: Callable[[str], None]) -> Iterator[None]:
    """The test cluster with `nodes` slurmd or more (partition `wide` holds them all), given back
    to its size after, once it is idle."""
    before = node_count()
    if before < nodes:
        log(f"  the test cluster grows to {nodes} nodes (tests/cluster/start.sh --nodes {nodes})")
        resize(nodes)
    try:
        yield
    finally:
        if before < nodes:
            wait_free(timeout=600)
            resize(before)
