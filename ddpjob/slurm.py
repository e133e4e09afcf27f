"""The one place that runs SLURM's commands (sbatch, squeue, scontrol, sacct, sinfo, scancel).

Used by the login side (submit, status, cancel, doctor) and by rank 0 on the nodes (requeue,
preemption check, end time, successor job); never imports torch. Every command has a timeout and
comes back as one `Result`; the typed helpers answer a value or `Failed`. `Failed` is not a
"no": it refuses to be read as a bool, so `if being_preempted(j):` on a failed query raises
instead of quietly deciding. Tests swap `runner` for tests/fake_slurm.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Union

from ddpjob.validate import SIGNALS

JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")  # used with fullmatch: no newline, ASCII digits only
NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}", re.ASCII)  # a node name (fullmatch), as ledger/crashes.HOST
TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Result:
    """One command's outcome. `error` is "" when it ran and exited 0, else one line: missing
    binary, timeout, non-zero exit (with stderr), so `ok` tells "it answered" from "it failed"."""

    args: tuple[str, ...]
    rc: int | None  # None: it never ran or never finished (missing, timeout)
    stdout: str = ""
    stderr: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    def failed(self) -> Failed:
        return Failed(self.error or f"{self.args[0]} answered nothing useful")


@dataclass(frozen=True)
class Failed:
    """A question SLURM did not answer (command failed), as opposed to an answer of "no"."""

    why: str

    def __bool__(self) -> bool:
        # Reading a failure as yes/no is exactly the bug this type exists to prevent.
        raise TypeError(f"a failed SLURM query is neither true nor false: {self.why}")

    def __str__(self) -> str:
        return self.why


# Signals a rank may take as a stop (`slurm.signal`), but INT, which stays Ctrl-C's at a terminal
_STOPS = tuple(getattr(signal, f"SIG{n}") for n in SIGNALS if n != "INT")


def _shielded() -> set[int]:
    """SIGTERM, and each stop signal this process catches itself (a rank's StopFlag: USR2 or its
    `slurm.signal`): the ones a SLURM command must not die of."""
    return {signal.SIGTERM, *(s for s in _STOPS if callable(signal.getsignal(s)))}


def _subprocess(args: Sequence[str], timeout: float, env: Mapping[str, str] | None,
                cwd: str | None) -> Result:
    argv = tuple(args)
    # The command starts with the stop signals blocked (a child inherits its starter thread's
    # mask, and scontrol keeps it). SLURM sends them to every process of a job step, rank 0's
    # `scontrol requeue` included, which died of them before printing its answer: a requeue's
    # own SIGTERM (stop 34's CI), and a warm-started rank's USR2, which reaches it twice (relayed
    # by its srun task, and by the warm server's step), the second after the checkpoint, during
    # the requeue (a stressed run: exit -12 read as a refusal, a successor job sent for a job
    # that should have been requeued). KillWait's SIGKILL still ends a command that hangs; a
    # signal for this thread waits until the command has returned.
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _shielded())
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                           env=None if env is None else dict(env), cwd=cwd)
    except FileNotFoundError:
        return Result(argv, None, error=f"{argv[0]}: command not found")
    except subprocess.TimeoutExpired:
        return Result(argv, None, error=f"{' '.join(argv[:3])} gave no answer within {timeout:.0f} s")
    except OSError as exc:
        return Result(argv, None, error=f"{argv[0]} could not run: {exc.strerror or exc}")
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    if p.returncode != 0:
        why = " ".join((p.stderr or p.stdout or "").split())[:300] or f"exit code {p.returncode}"
        return Result(argv, p.returncode, p.stdout, p.stderr, f"{' '.join(argv[:3])} failed: {why}")
    return Result(argv, 0, p.stdout, p.stderr)


Runner = Callable[[Sequence[str], float, Union[Mapping[str, str], None], Union[str, None]], Result]
runner: Runner = _subprocess  # the fake replaces this (tests/fake_slurm.py)


def run(args: Sequence[str], timeout: float = TIMEOUT_S, *, env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None) -> Result:
    """Run one SLURM command; never raises for a command that fails."""
    return runner(list(args), timeout, env, None if cwd is None else str(cwd))


def _bad_id(job_id: str | None) -> Failed | None:
    if not job_id or not JOB_ID.fullmatch(str(job_id)):
        return Failed(f"job id {job_id!r} is not a SLURM job id")
    return None


def parse_fields(line: str) -> dict[str, str]:
    """`Key=value Key2=va lue` (scontrol -o): a value runs up to the next ` Key=`."""
    keys = list(re.finditer(r"(?:^|\s)([A-Za-z][\w:/.\-]*)=", line))
    return {m.group(1): line[m.end():(keys[i + 1].start() if i + 1 < len(keys) else len(line))].strip()
            for i, m in enumerate(keys)}


def show_job(job_id: str) -> dict[str, str] | Failed:
    """`scontrol show job -o JOB` as a dict; Failed when scontrol did not answer (or the
    controller no longer knows the job)."""
    bad = _bad_id(job_id)
    if bad is not None:
        return bad
    res = run(["scontrol", "show", "job", "-o", str(job_id)])
    line = res.stdout.strip().splitlines()[0] if res.ok and res.stdout.strip() else ""
    return parse_fields(line) if line else res.failed()


def being_preempted(job_id: str) -> bool | Failed:
    """True while SLURM preempts the job: still RUNNING, with a PreemptTime. False for a plain
    scancel (no PreemptTime) or a job already requeued (no longer RUNNING)."""
    info = show_job(job_id)
    if isinstance(info, Failed):
        return info
    return info.get("JobState") == "RUNNING" and info.get("PreemptTime", "None") not in ("None", "Unknown", "")


def requeue(job_id: str) -> Result:
    """`scontrol requeue JOB` (the job goes back to PENDING, keeping its id). JOB is one job or
    one array task (ARRAYID_TASK: only that task; a bare array id would requeue every task).
    Where scontrol answers per task, JOB's own answer decides (see _task_answers)."""
    bad = _bad_id(job_id)
    if bad is not None:
        return Result(("scontrol", "requeue", str(job_id)), None, error=bad.why)
    res = run(["scontrol", "requeue", str(job_id)], timeout=60)
    if res.ok:
        return res
    mine = [msg for ids, msg in _task_answers(res.stderr + "\n" + res.stdout) if _names(ids, str(job_id))]
    if mine and all(msg == "No error" for msg in mine):
        # e.g. "548_0: Job is pending execution" / "548_1: No error" for 548_1: it was
        # requeued; reading the exit status alone would bring it back a second time
        return Result(res.args, res.rc, res.stdout, res.stderr)
    if mine:
        return Result(res.args, res.rc, res.stdout, res.stderr,
                      f"scontrol requeue {job_id} failed: {'; '.join(mine)}")
    return res


# scontrol's answer for job arrays: the controller answers with an error code per task (group),
# and scontrol (src/scontrol/update_job.c, scontrol_requeue) prints one "IDS: message" line per
# entry on stderr, IDS like 548_0 or 80520_31-33,71: for more than one entry every line, "No
# error" included, and exit status 1 even when all succeeded; for one entry only a failure.
_TASK_ANSWER = re.compile(r"^\s*([0-9]+(?:_\[?[0-9][0-9,\-]*\]?)?): (.+?)\s*$", re.MULTILINE)


def _task_answers(text: str) -> list[tuple[str, str]]:
    """scontrol's per-task answers in `text`: [(ids, message)], [] where it printed none."""
    return [(m.group(1), m.group(2)) for m in _TASK_ANSWER.finditer(text)]


def _names(ids: str, job_id: str) -> bool:
    """Whether `ids` (548, 548_1, 548_0-3,7, 548_[0-3]) takes in `job_id` (548 or 548_2)."""
    base, _, ranges = ids.partition("_")
    job, _, task = job_id.partition("_")
    if base != job:
        return False
    if not task or not ranges:  # asked for the whole array, or answered for all of it
        return True
    for part in ranges.strip("[]").split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (hi or lo).isdigit() and int(lo) <= int(task) <= int(hi or lo):
            return True
    return False


def parse_time(text: str) -> float | None:
    """'2026-05-09T12:34:56' (the controller's local time) -> epoch seconds; None for N/A etc."""
    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def end_time(job_id: str) -> float | None | Failed:
    """The job's end time (epoch seconds) from `squeue -h -j JOB -o %e`; None: no end time."""
    bad = _bad_id(job_id)
    if bad is not None:
        return bad
    res = run(["squeue", "-h", "-j", str(job_id), "-o", "%e"])
    return parse_time(res.stdout) if res.ok else res.failed()


def partitions() -> list[str] | Failed:
    """The cluster's partition names (`sinfo -h -o %R`)."""
    res = run(["sinfo", "-h", "-o", "%R"])
    return sorted(set(res.stdout.split())) if res.ok else res.failed()


def cancel(job_id: str) -> Result:
    bad = _bad_id(job_id)
    if bad is not None:
        return Result(("scancel", str(job_id)), None, error=bad.why)
    return run(["scancel", str(job_id)])


def send_signal(job_id: str, name: str) -> Result:
    """`scancel --signal=NAME JOB`: to every task of the job's steps (the ranks), not the batch
    shell; the job itself goes on."""
    bad = _bad_id(job_id)
    if bad is not None or not name.isalnum():
        return Result(("scancel", str(job_id)), None, error=bad.why if bad else f"bad signal {name!r}")
    return run(["scancel", f"--signal={name}", str(job_id)])


def exclude_nodes(job_id: str, hosts: Sequence[str]) -> Result:
    """`scontrol update JobId=JOB ExcNodeList=HOSTS`: the pending job's next start leaves those
    hosts out (a straggler's, [slurm] on_straggler = "requeue"). SLURM takes it only while the
    job is pending: after `scontrol requeue`, before the job starts again."""
    bad = _bad_id(job_id)
    names = ",".join(hosts)
    if bad is None and not (hosts and all(NODE.fullmatch(h) for h in hosts)):
        bad = Failed(f"host names {names!r} are not SLURM node names")
    if bad is not None:
        return Result(("scontrol", "update"), None, error=bad.why)
    res = run(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={names}"], timeout=60)
    return res if res.ok else Result(res.args, res.rc, res.stdout, res.stderr,
                                     f"scontrol update JobId={job_id} ExcNodeList={names} failed: "
                                     f"{(res.stderr or res.stdout).strip()[:200]}")


def submit(script: str | Path, *sbatch_args: str, cwd: str | Path | None = None) -> str | Failed:
    """`sbatch --parsable ARGS SCRIPT` -> the new job id. Run from inside a job, the environment
    loses SLURM_*/SBATCH_*/SRUN_*: sbatch and srun read those as options, and the running job's
    (its task count, step id, CPU binding) must not become the new job's."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    res = run(["sbatch", "--parsable", *sbatch_args, str(script)], timeout=60, env=env, cwd=cwd)
    job_id = res.stdout.strip().split(";")[0] if res.ok else ""
    if not JOB_ID.fullmatch(job_id):
        return res.failed() if not res.ok else Failed(f"sbatch printed {res.stdout!r}, expected a job id")
    return job_id


def submit_successor(job_id: str, script: str | Path, cwd: str | Path | None = None) -> str | Failed:
    """A new job running `script` once `job_id` has ended, however it ends (afterany): the
    requeue that needs no `scontrol requeue`. Should the old job be requeued after all, the
    successor waits for its final end (and finds the run completed).

    For an array task (ARRAYID_TASK) the successor is that task alone: a one-task array of the
    same index (`--array=TASK` on the command line overrides the script's `#SBATCH --array`),
    whose id, NEWID_TASK, is returned. A sweep point's script is submitit's script of the whole
    sweep; resubmitted as is it would run every point again. The same index keeps what the
    script derives from SLURM_ARRAY_TASK_ID (the point's code, submitit's NEWID_TASK pickle)."""
    bad = _bad_id(job_id)
    if bad is not None:
        return bad
    _, _, task = job_id.partition("_")
    new = submit(script, f"--dependency=afterany:{job_id}", *([f"--array={task}"] if task else []), cwd=cwd)
    return f"{new}_{task}" if task and not isinstance(new, Failed) else new


def sacct_states(base_ids: Sequence[str]) -> list[list[str]] | Failed:
    """Rows JobID|State|ExitCode|NodeList of every incarnation (`sacct -X -D`)."""
    res = run(["sacct", "-X", "-D", "-n", "-P", "-o", "JobID,State,ExitCode,NodeList",
               "-j", ",".join(base_ids)])
    return [ln.split("|") for ln in res.stdout.splitlines()] if res.ok else res.failed()


@dataclass(frozen=True)
class Incarnation:
    """One run of a job id as sacct keeps it (a requeued job has one per start)."""

    state: str  # first word: "CANCELLED by 0" -> CANCELLED
    start: float | None
    end: float | None
    submit: float | None = None  # when it (re)entered the queue: a requeued start's is its requeue


def incarnations(job_id: str) -> list[Incarnation] | Failed:
    """Every start of `job_id`, oldest first (`sacct -X -D`): how each one ended."""
    bad = _bad_id(job_id)
    if bad is not None:
        return bad
    res = run(["sacct", "-X", "-D", "-n", "-P", "-o", "State,Start,End", "-j", str(job_id)], timeout=20)
    if not res.ok:
        return res.failed()
    rows = [ln.split("|") for ln in res.stdout.splitlines() if ln.count("|") == 2]
    out = [Incarnation((r[0].split() or ["UNKNOWN"])[0], parse_time(r[1]), parse_time(r[2])) for r in rows]
    return sorted(out, key=lambda i: i.start if i.start is not None else float("inf"))


def incarnations_of(job_ids: Sequence[str]) -> dict[str, list[Incarnation]] | Failed:
    """Every start of each job, oldest first, in one `sacct -X -D` (the goodput ledger's queue
    wait): {job id: [Incarnation, ...]}; an array task is keyed as sacct names it (548_1)."""
    for job_id in job_ids:
        if (bad := _bad_id(job_id)) is not None:
            return bad
    if not job_ids:
        return {}
    res = run(["sacct", "-X", "-D", "-n", "-P", "-o", "JobID,State,Submit,Start,End", "-j", ",".join(job_ids)],
              timeout=20)
    if not res.ok:
        return res.failed()
    out: dict[str, list[Incarnation]] = {}
    for row in (ln.split("|") for ln in res.stdout.splitlines() if ln.count("|") == 4):
        out.setdefault(row[0], []).append(Incarnation((row[1].split() or ["UNKNOWN"])[0], parse_time(row[3]),
                                                      parse_time(row[4]), parse_time(row[2])))
    for rows in out.values():
        rows.sort(key=lambda i: i.start if i.start is not None else float("inf"))
    return out


def squeue_states(base_ids: Sequence[str]) -> list[list[str]] | Failed:
    """Rows JobID|State|Reason of the queued and running jobs."""
    res = run(["squeue", "-h", "-o", "%i|%T|%r", "-j", ",".join(base_ids)])
    return [ln.split("|") for ln in res.stdout.splitlines()] if res.ok else res.failed()
