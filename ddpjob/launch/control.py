"""`ddpjob status / logs / cancel / ls`: what happened to a submitted run.

Login-node side, after submit.py: reads the run dir (job.json, local.json, events.jsonl,
metrics.jsonl, checkpoints/) and asks the scheduler (sacct/squeue/scancel on SLURM, process state
for the local backend). Never imports torch, so it answers in well under a second.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpjob import console, recordtypes, rundir
from ddpjob.errors import DDPJobError, UsageError
from ddpjob import slurm
from ddpjob.store import manifest

from ddpjob.launch.local import LOCAL  # the supervisor's state file
SWEEP = "sweep.json"
# SLURM states after which nothing more will happen (a requeued job goes back to PENDING).
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "STOPPED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT", "LOST"}
_ARRAY = re.compile(r"(\d+)_\[([0-9,\-]+)(?:%\d+)?\]", re.ASCII)


@dataclass
class RunInfo:
    run_dir: Path
    backend: str = "?"
    job_id: str = ""
    state: str = "UNKNOWN"
    restarts: int = 0
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


# ------------------------------------------------------------------ scheduler queries
def _expand_array_id(job_id: str) -> list[str]:
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
        for jid in _expand_array_id(parts[0]):
            prev = out.get(jid)
            out[jid] = {"state": (parts[1].split() or ["UNKNOWN"])[0], "exit": parts[2],
                        "nodes": parts[3], "restarts": 0 if prev is None else prev["restarts"] + 1}
    rows = slurm.squeue_states(bases)
    for parts in ([] if isinstance(rows, slurm.Failed) else rows):
        if len(parts) < 3:
            continue
        for jid in _expand_array_id(parts[0]):
            rec = out.setdefault(jid, {"restarts": 0, "exit": "", "nodes": ""})
            rec["state"], rec["reason"] = parts[1], parts[2]  # the controller is the freshest source
    return out


def pid_alive(pid: int | None, marker: str = "ddpjob.launch.local") -> bool:
    """Alive, not a zombie, and still our supervisor (pids are reused)."""
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z" and marker in cmdline


# ------------------------------------------------------------------ reading a run dir
def last_metric(run_dir: Path) -> tuple[int | None, float | None]:
    """(step, loss) of the newest metrics record that has a loss; reads only the file's tail."""
    try:
        lines = rundir.read_bounded(run_dir / rundir.METRICS, 65536, tail=True).splitlines()
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
        raise rundir.RecordError(f"{run_dir / rundir.JOB} is not a regular file")  # DAMAGED, never read
    job = rundir.read_record(run_dir / rundir.JOB)
    if not job:
        ids = [str(e["job_id"]) for e in rundir.events(run_dir) if e.get("job_id")]
        if ids and re.fullmatch(r"\d+(_\d+)?", ids[-1]):
            job = {"backend": "slurm", "job_id": ids[-1], "via": "sbatch"}
    return job


def run_info(run_dir: Path, slurm: dict[str, dict[str, Any]] | None = None) -> RunInfo:
    job = job_record(run_dir)
    info = RunInfo(run_dir=run_dir, backend=job.get("backend", "?"), job_id=str(job.get("job_id", "")))
    events = rundir.events(run_dir)
    info.restarts = max([int(e.get("restart", 0) or 0) for e in events] or [0])
    if info.backend == "local":
        rec = rundir.read_record(run_dir / LOCAL) or None
        alive = pid_alive(job.get("pid"))
        if rec is None:
            info.state = "PENDING" if alive else "FAILED"
            info.reason = "" if alive else "the supervisor is gone; see logs/supervisor.log"
        else:
            info.state, info.reason = rec.get("state", "UNKNOWN"), rec.get("reason", "")
            info.restarts = max(info.restarts, int(rec.get("restarts", 0)))
            if info.state not in TERMINAL and not alive:
                info.state, info.reason = "FAILED", "the supervisor died; see logs/supervisor.log"
    elif info.backend == "slurm" and info.job_id:
        rec = (slurm if slurm is not None else slurm_states([info.job_id])).get(info.job_id)
        if rec:
            info.state = rec.get("state", "UNKNOWN")
            info.reason = rec.get("reason", "") if rec.get("reason") not in ("None", None) else ""
            info.restarts = max(info.restarts, rec.get("restarts", 0))
            if info.state in TERMINAL and info.state != "COMPLETED" and rec.get("exit"):
                info.reason = info.reason or f"exit code {rec['exit']}"
            info.extra = rec
    elif not job:
        info.state = "UNKNOWN"
        info.reason = "no job.json, no job id in events.jsonl (a `ddpjob sbatch` run not started?)"
    stops = [e for e in events if e.get("event") == "stop" and "rank" not in e]
    if info.state in TERMINAL and stops and stops[-1].get("reason") == "user_stop":
        # the ranks' exit 3 reads as FAILED to SLURM; it was `ddpjob stop`, with a checkpoint
        info.state, info.reason = "STOPPED", f"by `ddpjob stop` at step {stops[-1].get('step')}"
    if events:
        last = events[-1]
        why = last.get("error") or last.get("note") or last.get("reason") or ""
        if last.get("event") == "stop" and not last.get("error"):
            # the crash decision comes after the ranks' own records: say the cause, then the decision.
            # The first record is the root cause; later ones are often ranks failing because of it.
            cause = [e["error"] for e in events if e.get("event") == "stop" and isinstance(e.get("error"), str)
                     and e.get("job_id") == last.get("job_id") and e.get("restart") == last.get("restart")]
            if cause:
                text = cause[0].removeprefix("ddpjob: error: ").split(" Hint: ")[0]
                why = f"{text} ({why})" if why else text
        info.extra["last_event"] = f"{last.get('event')}" + (f": {why}" if why else "")
    info.step, info.loss = last_metric(run_dir)
    info.checkpoint = last_checkpoint(run_dir)
    info.completed = rundir.completed(run_dir) is not None
    return info


def sweep_points(sweep_dir: Path) -> list[tuple[Path, str]]:
    points = rundir.read_record(sweep_dir / SWEEP).get("points")
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
    """RunInfo for many runs with one sacct/squeue call for all their SLURM jobs."""
    ids = [str(_job_record_or_none(d).get("job_id", "")) for d, _ in runs]
    ids = [i for i in ids if re.fullmatch(r"[0-9]+(_[0-9]+)?|local-[0-9]+(_[0-9]+)?", i)]
    slurm = slurm_states([i for i in ids if i and not i.startswith("local-")])
    out = []
    for d, point in runs:
        try:
            info = run_info(d, slurm)
        except (ValueError, TypeError, AttributeError, KeyError, OSError) as exc:
            # One damaged run dir (a hand-edited or truncated record) is shown as such; it
            # must not hide every other run from `ls` and `status`.
            info = RunInfo(run_dir=d, state="DAMAGED", reason=f"{type(exc).__name__}: {exc}"[:200])
        info.point = point
        out.append(info)
    return out


def resolve(target: str, runs_root: str | Path = "runs") -> tuple[Path, bool]:
    """A run dir, a sweep dir, or a job id (as job.json records it) -> (path, is_sweep)."""
    if not target.strip():  # '' would name the working directory, or match every run without an id
        raise UsageError(f"the run is {target!r}, expected a run directory or a job id",
                         "`ddpjob ls` lists the runs and their job ids")
    p = Path(target)
    if (p / SWEEP).is_file():
        return p, True
    if rundir.is_run_dir(p):
        return p, False
    root = Path(runs_root)
    if root.is_dir():
        for d in sorted(root.iterdir()):
            sweep = rundir.read_record(d / SWEEP) if (d / SWEEP).is_file() else None
            if sweep and str(sweep.get("job_id")) == target:
                return d, True
        for d, _ in runs_under(root):
            job = job_record(d)
            if target in {str(j) for j in [job.get("job_id", ""), *(job.get("job_ids") or [])] if j}:
                return d, False
    raise DDPJobError(f"'{target}' is neither a run directory nor a job id of a run under {root}/",
                      "`ddpjob ls` lists the runs and their job ids")


# ------------------------------------------------------------------ commands
def _fmt_loss(loss: Any) -> str:
    return f"{loss:.4f}" if isinstance(loss, (int, float)) else ""


def print_table(runs: list[RunInfo], title: str = "") -> None:
    console.table(title, ["run", "backend", "job id", "state", "step", "loss", "restarts", "checkpoint",
                          "point"],
                  [[str(i.run_dir), i.backend, i.job_id, i.state, "" if i.step is None else i.step,
                    _fmt_loss(i.loss), i.restarts, i.checkpoint, i.point] for i in runs])


def format_status(i: RunInfo) -> str:
    """The compact per-run summary `ddpjob status RUN` prints."""
    state = i.state + (f" ({i.reason})" if i.reason else "")
    lines = [f"run         {i.run_dir}", f"job         {i.job_id or '-'} ({i.backend})",
             f"state       {state}", f"restarts    {i.restarts}",
             f"last step   {'-' if i.step is None else i.step}"
             + (f"  loss {_fmt_loss(i.loss)}" if i.loss is not None else ""),
             f"checkpoint  {i.checkpoint or '-'}", f"completed   {'yes' if i.completed else 'no'}"]
    # progress, best accuracy and every restart with its reason, read from the run dir alone
    from ddpjob.launch.plot import summary

    try:
        lines += [ln for ln in summary(i.run_dir) if ln.split()[0] in ("progress", "best", "restarts", "attempt",
                                                                       "recovery", "hosts")
                  and not ln.startswith("restarts    0")]
    except (ValueError, OSError) as exc:  # a damaged record (rundir.RecordError, ...): said, not raised
        lines.append(f"damaged     {exc}"[:300])
    for record in (rundir.EVENTS, rundir.METRICS):
        skipped = rundir.damaged_lines(i.run_dir / record)
        if skipped:
            lines.append(f"damaged     {skipped}"[:300])
    code = code_state(i.run_dir)
    if code:
        lines.append(f"code        {code['text']}")
    if i.extra.get("last_event"):
        lines.append(f"last event  {i.extra['last_event'][:200]}")
    if i.point:
        lines.insert(1, f"point       {i.point}")
    return "\n".join(lines)


def code_state(run_dir: Path) -> dict[str, Any]:
    """The frozen code's hash and whether the code on disk has moved on ({} if unknown)."""
    from ddpjob import config
    from ddpjob import freeze

    rec = freeze.record(run_dir)
    if not rec.get("hash"):
        return {}
    try:
        now = freeze.digest(freeze.collect(config.read_run_config(run_dir))["files"])
    except (DDPJobError, OSError):
        now = None
    changed = None if now is None else now != rec["hash"]
    text = f"{rec['hash']} (frozen at submission" + {None: ")", False: "; the code on disk is the same)",
                                                     True: "; the code on disk has changed since)"}[changed]
    return {"hash": rec["hash"], "changed_on_disk": changed, "text": text}


def cmd_status(args: argparse.Namespace) -> int:
    from ddpjob.launch import report

    if not args.target:
        runs = runs_under(Path(args.runs_root))
        if args.json:
            report.print_records(infos(runs))  # no runs: no lines
        elif not runs:
            console.info(f"no runs under {args.runs_root}/ (submit one: ddpjob submit jobs/smoke.toml)")
        else:
            print_table(infos(runs))
        return 0
    path, is_sweep = resolve(args.target, args.runs_root)
    if args.json:
        report.print_records(infos(sweep_points(path) if is_sweep else [(path, "")]))
    elif is_sweep:
        print_table(infos(sweep_points(path)), title=f"sweep {path}")
    else:
        console.info(format_status(infos([(path, "")])[0]))
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    from ddpjob.launch import report

    root = Path(args.runs_root)
    runs = runs_under(root)
    if args.json:
        report.print_records(infos(runs))
        return 0
    if not runs:
        console.info(f"no runs under {root}/ (submit one: ddpjob submit jobs/smoke.toml)")
        return 0
    rows = []
    for i in infos(runs):
        rows.append([str(i.run_dir), i.backend, i.job_id, i.state, "" if i.step is None else i.step,
                     i.restarts, i.point])
    console.table("", ["run", "backend", "job id", "state", "step", "restarts", "point"], rows)
    return 0


# ------------------------------------------------------------------ logs
def log_files(run_dir: Path, rank: int) -> list[Path]:
    """Candidate logs of one rank: logs/rank-R.log (local backend, `ddpjob sbatch`) and
    submitit's <job id>_<R>_log.out/.err (same names across requeues: --open-mode=append)."""
    files = [run_dir / rundir.LOGS / f"rank-{rank}.log"]
    job = job_record(run_dir)
    if job.get("backend") == "slurm" and job.get("job_id"):
        folder = Path(job.get("log_folder") or run_dir / rundir.LOGS)
        for jid in job.get("job_ids") or [job["job_id"]]:  # successor jobs: each id's logs, in order
            files += [folder / f"{jid}_{rank}_log.{ext}" for ext in ("out", "err")]
    return files


def _check_rank(run_dir: Path, rank: int) -> None:
    from ddpjob import config

    world = config.read_run_config(run_dir).slurm.world_size
    if not 0 <= rank < world:
        raise UsageError(f"rank {rank} does not exist in {run_dir}, which has {world} rank(s)",
                         f"pass --rank between 0 and {world - 1}")


def follow(run_dir: Path, rank: int = 0, poll_s: float = 0.5, state_every_s: float = 2.0,
           out: Any = None) -> RunInfo:
    """Print the rank's logs as they grow, across requeues (appended or new files), until the
    job is finished; then a last read. Returns the final RunInfo."""
    out = out or sys.stdout
    offsets: dict[Path, int] = {}
    next_check, info = 0.0, run_info(run_dir)

    def drain() -> None:
        for f in log_files(run_dir, rank):
            try:
                size = f.stat().st_size
            except OSError:
                continue
            pos = offsets.get(f, 0)
            if size < pos:  # truncated or replaced: start over
                pos = 0
            if size > pos:
                with open(f, "rb") as fh:
                    fh.seek(pos)
                    data = fh.read(size - pos)
                offsets[f] = pos + len(data)
                out.write(data.decode(errors="replace"))
                out.flush()

    while True:
        drain()
        if time.monotonic() >= next_check:
            info = run_info(run_dir)
            next_check = time.monotonic() + state_every_s
            if info.finished:
                time.sleep(poll_s)  # a last flush of the ranks' output
                drain()
                return info
        time.sleep(poll_s)


def cmd_logs(args: argparse.Namespace) -> int:
    path, is_sweep = resolve(args.run)
    if is_sweep:
        raise UsageError(f"'{args.run}' is a sweep with several runs",
                         f"pass one point, e.g. {path / '0'} (`ddpjob status {args.run}` lists them)")
    _check_rank(path, args.rank)
    if args.follow:
        follow(path, args.rank)
        return 0
    files = [f for f in log_files(path, args.rank) if f.is_file()]
    if not files:
        info = run_info(path)
        raise DDPJobError(f"no log for rank {args.rank} in {path} yet (state {info.state})",
                          "it appears when the job starts; `ddpjob logs --follow` waits for it")
    for f in files:
        if len(files) > 1 and f.stat().st_size:
            console.info(f"==> {f} <==")
        sys.stdout.write(f.read_text(errors="replace"))
    sys.stdout.flush()
    if not any(f.stat().st_size for f in files):
        print(f"ddpjob: the log of rank {args.rank} is empty so far (ranks other than 0 print "
              "only warnings and errors)", file=sys.stderr)
    return 0
