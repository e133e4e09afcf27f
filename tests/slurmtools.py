"""Helpers for driving the real SLURM test cluster (tests/cluster/start.sh) from tests.

Tests submit real batch scripts with `submit`, follow them with `wait_state`/`wait_done`, and
interrupt them with `cancel`/`requeue`. Every query names one job id (plain, an array's base id
for all its tasks, or "A_i" for one task), so tests running at the same time (several pytest
processes) never read or touch each other's jobs.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

POLL_S = 0.5
# States after which a job never runs again. PREEMPTED and NODE_FAIL are final only for jobs that
# cannot be requeued (a requeueable job goes back to PENDING), so they count once scontrol says so.
FINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
    "BOOT_FAIL", "DEADLINE",
})
ACTIVE_STATES = ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "REQUEUED",
                 "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT")

# Ids of the jobs this process submitted, oldest first: conftest cancels a test's leftovers.
# Tests that start jobs another way (ddpjob's CLI, submitit) append their ids here too.
submitted: list[str] = []


class SlurmError(RuntimeError):
    """A SLURM command failed, or a job ended in a state the caller was not waiting for."""


def _run(args: list[str], *, timeout: float = 30, check: bool = True,
         stdin: str | None = None, cwd: str | os.PathLike[str] | None = None,
         env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=timeout,
                              cwd=cwd, env=None if env is None else dict(env))
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(f"{' '.join(args)} did not answer within {timeout:.0f} s") from exc
    if check and proc.returncode != 0:
        raise SlurmError(f"{' '.join(args)} failed (exit {proc.returncode}): "
                         f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def submit(script: str | os.PathLike[str], *sbatch_args: str,
           cwd: str | os.PathLike[str] | None = None,
           env: Mapping[str, str] | None = None) -> str:
    """Submit with real `sbatch --parsable` and return the job id.

    `script` is a path to a batch script, or the script text itself (anything containing a
    newline). `env` adds/overrides variables of this process's environment for sbatch, which
    passes them on to the job (sbatch's default --export=ALL). Raises SlurmError with sbatch's
    stderr when sbatch refuses the job.
    """
    text = None
    if isinstance(script, str) and "\n" in script:
        text = script
        args = ["sbatch", "--parsable", *sbatch_args]  # sbatch reads the script from stdin
    else:
        args = ["sbatch", "--parsable", *sbatch_args, os.fspath(script)]
    full_env = None if env is None else {**os.environ, **env}
    for attempt in range(3):
        proc = _run(args, stdin=text, cwd=cwd, env=full_env, check=False, timeout=60)
        if proc.returncode == 0:
            break
        # A busy controller answers "Socket timed out"/"Unable to contact": worth a retry.
        if attempt == 2 or not re.search(r"timed out|Unable to contact", proc.stderr):
            raise SlurmError(f"sbatch {' '.join(sbatch_args)} failed (exit {proc.returncode}): "
                             f"{proc.stderr.strip()}")
        time.sleep(2)
    job_id = proc.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch --parsable printed {proc.stdout!r}, expected a job id")
    submitted.append(job_id)
    return job_id


def _parse_scontrol_line(line: str) -> dict[str, str]:
    # Values may contain spaces (Command=, Reason=, paths): a value runs up to the next " Key=".
    keys = list(re.finditer(r"(?:^|\s)([A-Za-z][\w:/.\-]*)=", line))
    info: dict[str, str] = {}
    for i, m in enumerate(keys):
        end = keys[i + 1].start() if i + 1 < len(keys) else len(line)
        info[m.group(1)] = line[m.end():end].strip()
    return info


def _matches(info: Mapping[str, str], job_id: str) -> bool:
    # A plain id, an array's base id (all its tasks), or one array task as "A_i".
    task = f"{info.get('ArrayJobId')}_{info.get('ArrayTaskId')}"
    return job_id in (info.get("JobId"), info.get("ArrayJobId"), task)


def _scontrol_jobs(job_id: str) -> tuple[list[dict[str, str]], str]:
    proc = _run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
    lines = [_parse_scontrol_line(line) for line in proc.stdout.strip().splitlines() if line]
    text = proc.stdout.strip() or proc.stderr.strip()
    return [info for info in lines if _matches(info, str(job_id))], text


def job_info(job_id: str) -> dict[str, str]:
    """`scontrol show job -o ID` parsed into a dict (JobState, Restarts, NodeList, ...).

    For an array's base id this is its first task. Raises SlurmError when slurmctld no longer
    knows the job (it forgets a finished job after MinJobAge=300 s; `sacct_state` still has it).
    """
    infos, text = _scontrol_jobs(job_id)
    if not infos:
        raise SlurmError(f"scontrol show job {job_id} printed no such job: {text!r}")
    return infos[0]


def _combined(states: list[str]) -> str | None:
    """One state for several (array tasks): the first still live, else the first not COMPLETED."""
    if not states:
        return None
    live = [s for s in states if s not in FINAL_STATES]
    if live:
        return live[0]
    return next((s for s in states if s != "COMPLETED"), "COMPLETED")


def sacct_state(job_id: str) -> str | None:
    """The job's state in the accounting database (allocation line), or None if not there yet.

    An array's base id gives the combined state of its tasks (see `_combined`).
    """
    proc = _run(["sacct", "-n", "-X", "-P", "-o", "JobID,JobIDRaw,State", "-j", str(job_id)],
                check=False)
    states = []
    for line in proc.stdout.splitlines():
        jid, raw, state = (line.split("|") + ["", ""])[:3]
        if state and (str(job_id) in (jid, raw) or jid.startswith(f"{job_id}_")):
            states.append(state.split()[0])  # "CANCELLED by 0" -> "CANCELLED"
    return _combined(states)


def sacct_rows(job_id: str, fields: str, timeout: float = 60) -> list[dict[str, str]]:
    """Every start of the job in the accounting database (`sacct -X -D`), as {field: value},
    once slurmdbd has them final: it lags the controller, so a job scontrol calls COMPLETED can
    still be RUNNING here for a moment. RESIZING rows are history (a node left the allocation)."""
    names = fields.split(",")
    assert "State" in names, fields
    deadline = time.monotonic() + timeout
    while True:
        proc = _run(["sacct", "-X", "-D", "-n", "-P", "-o", fields, "-j", str(job_id)], check=False)
        rows = [dict(zip(names, line.split("|"))) for line in proc.stdout.splitlines()
                if line.count("|") == len(names) - 1]
        live = [r for r in rows if r["State"].split()[0] in ACTIVE_STATES and r["State"] != "RESIZING"]
        if rows and not live:
            return rows
        if time.monotonic() > deadline:
            raise AssertionError(f"sacct has no final state for every start of job {job_id}: {proc.stdout!r}")
        time.sleep(1)


def sacct_times(job_id: str, timeout: float = 30) -> list[tuple[float, float, float]]:
    """(Submit, Start, End) in epoch seconds of every start of the job, oldest first, once
    slurmdbd has the end of each (it may lag the controller by a moment). SLURM_TIME_FORMAT=%s:
    sacct itself writes epoch seconds, so nothing here shares ddpjob's parsing."""
    deadline = time.monotonic() + timeout
    while True:
        proc = _run(["sacct", "-X", "-D", "-n", "-P", "-o", "Submit,Start,End", "-j", str(job_id)],
                    check=False, env={**os.environ, "SLURM_TIME_FORMAT": "%s"})
        rows = [line.split("|") for line in proc.stdout.splitlines() if line.count("|") == 2]
        if rows and all(v.isdigit() for row in rows for v in row):
            return sorted((float(a), float(b), float(c)) for a, b, c in rows)
        if time.monotonic() > deadline:
            raise AssertionError(f"sacct has no complete times for job {job_id}: {proc.stdout!r}")
        time.sleep(1)


def _state(job_id: str) -> tuple[str | None, str]:
    """(state, scontrol text) now; falls back to sacct once slurmctld has forgotten the job."""
    infos, text = _scontrol_jobs(job_id)
    if infos:
        return _combined([info.get("JobState", "") for info in infos]), text
    return sacct_state(job_id), text


def wait_state(job_id: str, states: Iterable[str], timeout: float) -> str:
    """Poll every 0.5 s until the job is in one of `states`; return the state reached.

    Raises TimeoutError (with the last state and `scontrol show job`) after `timeout` seconds, and
    SlurmError at once if the job ended in a final state that is not among `states`.
    """
    wanted = {s.upper() for s in states}
    deadline = time.monotonic() + timeout
    state, text = None, ""
    while True:
        state, text = _state(job_id)
        if state in wanted:
            return state
        if state in FINAL_STATES and state not in ("PREEMPTED", "NODE_FAIL"):
            raise SlurmError(f"job {job_id} ended {state} while waiting for {sorted(wanted)}:\n{text}")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"job {job_id} not in {sorted(wanted)} after {timeout:.0f} s; "
                               f"last state {state}:\n{text}")
        time.sleep(POLL_S)


def wait_done(job_id: str, timeout: float) -> str:
    """Wait until the job has ended; return its final state (COMPLETED, FAILED, CANCELLED, ...)."""
    deadline = time.monotonic() + timeout
    while True:
        state, text = _state(job_id)
        if state in FINAL_STATES:
            return state
        if time.monotonic() >= deadline:
            raise TimeoutError(f"job {job_id} had not ended after {timeout:.0f} s; "
                               f"last state {state}:\n{text}")
        time.sleep(POLL_S)


def cancel(job_id: str) -> None:
    """scancel the job; a job that already ended is fine."""
    proc = _run(["scancel", str(job_id)], check=False)
    if proc.returncode != 0 and not re.search(r"already completing or completed|Invalid job id",
                                              proc.stderr):
        raise SlurmError(f"scancel {job_id} failed: {proc.stderr.strip()}")


def requeue(job_id: str) -> None:
    """`scontrol requeue`: kill the job now (no warning signal) and put it back to PENDING."""
    _run(["scontrol", "requeue", str(job_id)])


def release_now(job_id: str) -> None:
    """Let a requeued job start at once instead of after the ~11 s BeginTime hold."""
    _run(["scontrol", "update", f"jobid={job_id}", "starttime=now"])


def done_with_port_held(job_id: str, port: int, timeout: float) -> str:
    """Hold `port` on this machine (every test node's) as another program would, release the job
    (submitted with --hold) and wait for its end; its final state."""
    import socket

    with socket.socket() as other:
        other.bind(("0.0.0.0", port))
        other.listen()
        _run(["scontrol", "release", str(job_id)])
        return wait_done(job_id, timeout)


def active(job_id: str) -> bool:
    """True while the job is pending, running or on its way out."""
    state, _ = _state(job_id)
    return state is not None and state not in FINAL_STATES


def cluster_free(timeout: float = 120) -> None:
    """Wait until no job is queued or running on the test cluster and n1, n2 are idle.

    Tests that need every CPU (preemption, 2-node jobs) call this first so leftovers of earlier
    tests cannot change what they measure. Raises TimeoutError naming the jobs still there.
    """
    deadline = time.monotonic() + timeout
    while True:
        jobs = _run(["squeue", "-h", "-o", "%A %T %P"]).stdout.strip()
        nodes = _run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.split()
        idle = sorted(set(zip(nodes[::2], nodes[1::2]))) == [("n1", "idle"), ("n2", "idle")]
        if not jobs and idle:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"test cluster still busy after {timeout:.0f} s: jobs "
                               f"{jobs.splitlines() or 'none'}, nodes {nodes}")
        time.sleep(POLL_S)


def read_when(path: str | os.PathLike[str], pattern: str, timeout: float) -> str:
    """Wait until the file at `path` contains regex `pattern`; return the whole text."""
    deadline = time.monotonic() + timeout
    p = Path(path)
    while True:
        text = p.read_text(errors="replace") if p.exists() else ""
        if re.search(pattern, text, re.MULTILINE):
            return text
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{p} has no line matching {pattern!r} after {timeout:.0f} s; "
                               f"it holds:\n{text[-2000:]}")
        time.sleep(POLL_S)
