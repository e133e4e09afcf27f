"""What a submitted run is now: its job.json, its scheduler state (through its backend) and its
run dir's records, read into a RunInfo; the run dirs under a root; a run named by path or job id.

Login side, after submit.py; status/logs (control.py), cancel/stop (stop.py), resume and
`status --json` (report.py) read runs through here. Never imports torch.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpjob import console, fileio, freeze, jobfile, recordtypes, rundir, runlock
from ddpjob.errors import DDPJobError, UsageError
from ddpjob.launch.backends import TERMINAL, Backend, choose
from ddpjob.ledger import attempts, events, policy
from ddpjob.store import manifest

SWEEP = "sweep.json"
COMPLETING_WAIT_S, POLL_S = 60.0, 1.0  # resume after a cancel: how long a COMPLETING job is awaited
sleep = time.sleep  # tests skip the pauses


@dataclass
class RunInfo:
    run_dir: Path
    backend: str = "?"
    job_id: str = ""
    state: str = "UNKNOWN"
    restarts: int = 0  # the run's attempts less one
    attempts: list[int] = field(default_factory=list)  # their numbers (ledger/attempts.py)
    reason: str = ""
    step: int | None = None
    loss: float | None = None
    checkpoint: str = ""
    completed: bool = False
    point: str = ""  # sweep grid values, "train.lr=0.1 train.batch_size=64"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL


def last_metric(run_dir: Path) -> tuple[int | None, float | None]:
    """(step, loss) of the newest metrics record that has a loss; reads only the file's tail."""
    try:
        lines = fileio.read_bounded(run_dir / rundir.METRICS, 65536, tail=True).splitlines()
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        return None, None
    import json

    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if (isinstance(rec, dict) and recordtypes.type_error(rec) is None and isinstance(rec.get("loss"), (int, float))
                and not isinstance(rec.get("loss"), bool)):
            return rec.get("step"), float(rec["loss"])
    return None, None


def last_checkpoint(run_dir: Path) -> str:
    """The newest checkpoint a resume would use (verified: sizes and hashes), "" if none."""
    found = manifest.newest_valid(run_dir / rundir.CHECKPOINTS)
    return found[1].name if found else ""


def job_record(run_dir: Path) -> dict[str, Any]:
    """job.json; for a run started by `ddpjob sbatch` + `sbatch` (no job.json), the SLURM job id
    the ranks recorded in events.jsonl."""
    if (run_dir / rundir.JOB).exists() and not (run_dir / rundir.JOB).is_file():
        raise fileio.RecordError(f"{run_dir / rundir.JOB} is not a regular file")  # DAMAGED, never read
    job = fileio.read_record(run_dir / rundir.JOB)
    if not job:
        ids = [str(e["job_id"]) for e in events.read(run_dir) if e.get("job_id")]
        if ids and re.fullmatch(r"\d+(_\d+)?", ids[-1]):
            job = {"backend": choose.SBATCH.name, "job_id": ids[-1], "via": choose.SBATCH.via}
    return job


def run_info(run_dir: Path, states: dict[str, dict[str, Any]] | None = None) -> RunInfo:
    """The run now; `states`: the scheduler's answers for many runs at once (infos)."""
    job = job_record(run_dir)
    info = RunInfo(run_dir=run_dir, backend=job.get("backend", "?"), job_id=str(job.get("job_id", "")))
    evs = events.read(run_dir)
    info.attempts = [a.number for a in attempts.of_run(evs)]
    info.restarts = max(len(info.attempts) - 1, 0)
    backend = choose.of_record(job)
    if backend is not None:
        now = backend.state(run_dir, job, states)
        info.state, info.reason, info.extra = now.state, now.reason, now.extra
        info.restarts = max(info.restarts, now.restarts)
    elif not job:
        info.state = "UNKNOWN"
        info.reason = "no job.json, no job id in events.jsonl (a `ddpjob sbatch` run not started?)"
    stops = [e for e in evs if events.is_decision(e)]
    if info.state in TERMINAL and stops and stops[-1].get("reason") == policy.USER_STOP:
        # the ranks' exit 3 reads as FAILED to SLURM; it was `ddpjob stop`, with a checkpoint
        info.state, info.reason = "STOPPED", f"by `ddpjob stop`{_at(stops[-1].get('step'))}"
    done = rundir.completed(run_dir)
    if done is not None and info.state in TERMINAL and info.state != "COMPLETED":
        # the job ended otherwise and a start outside it (`ddpjob run RUN_DIR`) finished the training
        info.state, info.reason = "COMPLETED", f"{_at(done.get('step')).strip() or 'finished'}, after job {info.job_id} ended {info.state}"
    if evs:
        last = evs[-1]
        why = last.get("error") or last.get("note") or last.get("reason") or ""
        if events.is_decision(last):
            # the crash decision comes after the ranks' own records: say the cause, then the decision.
            # The first record is the root cause; later ones are often ranks failing because of it.
            cause = [e["error"] for e in evs if events.is_rank_crash(e) and isinstance(e.get("error"), str)
                     and e.get("job_id") == last.get("job_id") and e.get("restart") == last.get("restart")]
            if cause:
                text = cause[0].removeprefix("ddpjob: error: ").split(" Hint: ")[0]
                why = f"{text} ({why})" if why else text
        info.extra["last_event"] = f"{last.get('event')}" + (f": {why}" if why else "")
    info.step, info.loss = last_metric(run_dir)
    info.checkpoint = last_checkpoint(run_dir)
    info.completed = done is not None
    return info


def sweep_points(sweep_dir: Path) -> list[tuple[Path, str]]:
    points = fileio.read_record(sweep_dir / SWEEP).get("points")
    return [(sweep_dir / str(p["id"]), " ".join(f"{k}={v}" for k, v in p["values"].items()))
            for p in (points if isinstance(points, list) else [])
            if isinstance(p, dict) and isinstance(p.get("id"), (int, str))
            and "/" not in str(p["id"]) and isinstance(p.get("values"), dict)]


def runs_under(root: Path) -> list[tuple[Path, str]]:
    """(run dir, grid point) for every run and sweep point under root, oldest first."""
    out: list[tuple[Path, str]] = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        try:
            if (d / SWEEP).is_file():
                out += sweep_points(d)
            elif rundir.is_run_dir(d):
                out.append((d, ""))
        except OSError:  # another user's 0700 run in a shared runs root: shown as DAMAGED, not a crash
            out.append((d, ""))
    return out


def _job_record_or_none(run_dir: Path) -> dict[str, Any]:
    try:
        return job_record(run_dir)
    except (ValueError, OSError):  # a damaged run: run_info() below says how
        return {}


def infos(runs: list[tuple[Path, str]]) -> list[RunInfo]:
    """RunInfo for many runs with one scheduler query per backend (one sacct/squeue call for
    all their SLURM jobs)."""
    asks: dict[str, tuple[Backend, list[str]]] = {}  # by scheduler: both SLURM backends ask once
    for d, _ in runs:
        job = _job_record_or_none(d)
        backend, job_id = choose.of_record(job), str(job.get("job_id", ""))
        if backend is not None and re.fullmatch(r"[0-9]+(_[0-9]+)?|local-[0-9]+(_[0-9]+)?", job_id):
            asks.setdefault(backend.name, (backend, []))[1].append(job_id)
    states: dict[str, dict[str, Any]] = {}
    for backend, job_ids in asks.values():
        states.update(backend.states(job_ids))
    out = []
    for d, point in runs:
        try:
            info = run_info(d, states)
        except (ValueError, TypeError, AttributeError, KeyError, OSError) as exc:
            # One damaged run dir (a hand-edited or truncated record) is shown as such; it
            # must not hide every other run from `ls` and `status`. So is another user's.
            why = rundir.unreadable(d) if isinstance(exc, PermissionError) else ""
            info = RunInfo(run_dir=d, state="DAMAGED",
                           reason=(f"cannot read it: {why}" if why else f"{type(exc).__name__}: {exc}")[:200])
        info.point = point
        out.append(info)
    return out


def resolve(target: str, runs_root: str | Path = "runs") -> tuple[Path, bool]:
    """A run dir, a sweep dir, or a job id (as job.json records it) -> (path, is_sweep)."""
    if not target.strip():  # '' would name the working directory, or match every run without an id
        raise UsageError(f"the run is {target!r}, expected a run directory or a job id",
                         "`ddpjob ls` lists the runs and their job ids")
    p = Path(target)
    why = rundir.unreadable(p)  # another user's run: is_file() below would raise
    if why:
        raise DDPJobError(f"cannot read run directory: {why}, expected a run dir you can read",
                          rundir.UNREADABLE_HINT)
    if (p / SWEEP).is_file():
        return p, True
    if rundir.is_run_dir(p):
        return p, False
    root = Path(runs_root)
    if root.is_dir():
        for d in sorted(root.iterdir()):
            # os.path.isfile: False for another user's run (pathlib's raises), which is passed over
            sweep = fileio.read_record(d / SWEEP) if os.path.isfile(d / SWEEP) else None
            if sweep and str(sweep.get("job_id")) == target:
                return d, True
        for d, _ in runs_under(root):
            job = _job_record_or_none(d)
            if target in {str(j) for j in [job.get("job_id", ""), *(job.get("job_ids") or [])] if j}:
                return d, False
    raise DDPJobError(f"'{target}' is neither a run directory nor a job id of a run under {root}/",
                      "`ddpjob ls` lists the runs and their job ids")


def _at(step: Any) -> str:
    """" at step N", or nothing where the run logs no steps (a [train] command: docs/commands.md)."""
    return f" at step {step}" if isinstance(step, int) and not isinstance(step, bool) else ""


def code_state(run_dir: Path) -> dict[str, Any]:
    """The frozen code's hash and whether the code on disk has moved on ({} if unknown)."""
    rec = freeze.record(run_dir)
    if not rec.get("hash"):
        return {}
    try:
        cfg = jobfile.read_run_config(run_dir)
        now = freeze.digest(freeze.collect(cfg)["files"])
    except (DDPJobError, OSError):
        cfg, now = None, None
    changed = None if now is None else now != rec["hash"]
    if cfg is not None and cfg.train.command:
        # ddpjob cannot know which files a command reads: only its own code was frozen
        text = (f"{rec['hash']} (ddpjob's own, frozen at submission; the command runs its files as they "
                "are on disk at each start)")
    else:
        text = f"{rec['hash']} (frozen at submission" + {None: ")", False: "; the code on disk is the same)",
                                                         True: "; the code on disk has changed since)"}[changed]
    return {"hash": rec["hash"], "changed_on_disk": changed, "text": text}


def check_idle(run_dir: Path) -> None:
    """Two jobs must never train in one run dir: refuse while its job is queued or running."""
    [info] = infos([(run_dir, "")])
    if info.state == "COMPLETING":  # just after scancel: SLURM is still ending it, seconds as a rule
        console.info(f"ddpjob: job {info.job_id} is COMPLETING; waiting up to {COMPLETING_WAIT_S:.0f} s for it to end")
        deadline = time.monotonic() + COMPLETING_WAIT_S
        while info.state == "COMPLETING" and time.monotonic() < deadline:
            sleep(POLL_S)
            [info] = infos([(run_dir, "")])
    if info.job_id and info.state not in TERMINAL and info.state not in ("UNKNOWN", "DAMAGED"):
        raise DDPJobError(f"run directory '{run_dir}' has job {info.job_id} still {info.state}, "
                          "expected a stopped run to resume",
                          f"wait for it, or `ddpjob cancel {run_dir}` first")
    runlock.refuse_busy(run_dir)  # whatever the records say: something trains there now
    if info.state == "DAMAGED":  # its records cannot tell whether a job still runs: as if busy
        raise DDPJobError(f"run directory '{run_dir}' is damaged ({info.reason}), so whether a job "
                          "still runs there cannot be told, expected readable records",
                          f"repair or remove the damaged file (`ddpjob status {run_dir}` names it), "
                          "or use a new --run-dir")
