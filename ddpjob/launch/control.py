"""`ddpjob status / logs / ls`: what happened to a submitted run, as tables and log text.

Login-node side, after submit.py: the runs come from runs.py (job.json, the scheduler's state
through the run's backend, events.jsonl, metrics.jsonl, checkpoints/). Never imports torch, so it
answers in well under a second.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ddpjob import console, fileio, jobfile, rundir
from ddpjob.errors import DDPJobError, UsageError
from ddpjob.launch.backends import choose
from ddpjob.launch.runs import (RunInfo, code_state, infos, job_record, resolve, run_info, runs_under,
                                sweep_points)
from ddpjob.ledger import events as ledger_events


# ------------------------------------------------------------------ commands
def _fmt_loss(loss: Any) -> str:
    return f"{loss:.4f}" if isinstance(loss, (int, float)) else ""


def print_table(runs: list[RunInfo], title: str = "") -> None:
    console.table(title, ["run", "backend", "job id", "state", "step", "loss", "restarts", "checkpoint",
                          "point"],
                  [[str(i.run_dir), i.backend, i.job_id, i.state, "" if i.step is None else i.step,
                    _fmt_loss(i.loss), i.restarts, i.checkpoint, i.point] for i in runs])


def _command_run(i: RunInfo) -> bool:
    try:
        return bool(jobfile.read_run_config(i.run_dir).train.command)
    except (DDPJobError, OSError):
        return False


def format_status(i: RunInfo) -> str:
    """The compact per-run summary `ddpjob status RUN` prints."""
    state = i.state + (f" ({i.reason})" if i.reason else "")
    # a [train] command that logs no steps: its step is unknown, its checkpoint its program's own
    command = (i.step is None or not i.checkpoint) and _command_run(i)
    unknown = "unknown (the program logs no steps: docs/commands.md, Metrics)" if command else "-"
    own = "the program's own (ddpjob writes none for a command)" if command else "-"
    lines = [f"run         {i.run_dir}", f"job         {i.job_id or '-'} ({i.backend})",
             f"state       {state}", f"restarts    {i.restarts}" + (
                 f" (attempts {i.attempts[0]}-{i.attempts[-1]})" if len(i.attempts) > 1 else ""),
             f"last step   {unknown if i.step is None else i.step}"
             + (f"  loss {_fmt_loss(i.loss)}" if i.loss is not None else ""),
             f"checkpoint  {i.checkpoint or own}", f"completed   {'yes' if i.completed else 'no'}"]
    # progress, best accuracy and every restart with its reason, read from the run dir alone
    from ddpjob.launch.summary import summary

    try:
        # a quarantined host is excluded now only by the next restart of a live SLURM job
        backend = choose.of_record(job_record(i.run_dir))
        live = i.job_id if backend is not None and backend.on_slurm and not i.finished and i.job_id else None
        lines += [ln for ln in summary(i.run_dir, live) if ln.split()[0] in ("progress", "best", "restarts", "attempt",
                                                                       "recovery", "hosts", "straggler",
                                                                       "slowdown")
                  and not ln.startswith("restarts    0")]
    except (ValueError, OSError) as exc:  # a damaged record (fileio.RecordError, ...): said, not raised
        lines.append(f"damaged     {exc}"[:300])
    for record in (rundir.EVENTS, rundir.METRICS):
        skipped = fileio.damaged_lines(i.run_dir / record)
        if skipped:
            lines.append(f"damaged     {skipped}"[:300])
    try:
        partly = ledger_events.notes(ledger_events.read(i.run_dir))  # records of a newer ddpjob
    except (ValueError, OSError):  # a damaged events.jsonl: said above
        partly = ""
    if partly:
        lines.append(f"history     {rundir.EVENTS}: {partly}"[:300])
    from ddpjob.launch import goodput

    ledger = goodput.of_runs([i])[i.run_dir]
    if ledger is not None:  # where the run's time went, over every attempt (launch/goodput.py)
        lines.append(f"goodput     {ledger.describe()}")
    verdict = _verdict(i.run_dir)
    if verdict:
        lines.append(f"verdict     {verdict}")
    code = code_state(i.run_dir)
    if code:
        lines.append(f"code        {code['text']}")
    if i.extra.get("last_event"):
        lines.append(f"last event  {i.extra['last_event'][:200]}")
    if i.point:
        lines.insert(1, f"point       {i.point}")
    return "\n".join(lines)


def _verdicts(run_dir: Path) -> list[dict[str, Any]]:
    try:
        return [e for e in ledger_events.read(run_dir) if ledger_events.is_decision(e) and e.get("verdict")
                and e.get("line")]
    except (ValueError, OSError):
        return []


def _verdict(run_dir: Path) -> str:
    """The newest crash's verdict (ledger/policy.py): who broke it and what happened next."""
    try:
        crashes = [e for e in ledger_events.read(run_dir) if ledger_events.is_decision(e) and e.get("verdict")]
    except (ValueError, OSError):
        return ""
    if not crashes:
        return ""
    last = crashes[-1]
    return f"{last['verdict']} (attempt {last.get('restart')}): {last.get('line') or last.get('note') or ''}"[:600]


def cmd_status(args: argparse.Namespace) -> int:
    from ddpjob.launch import report

    if not args.target:
        runs = runs_under(Path(args.runs_root))
        if args.format != "table":
            report.print_records(infos(runs), args.format)  # no runs: no lines
        elif not runs:
            console.info(f"no runs under {args.runs_root}/ (submit one: ddpjob submit jobs/smoke.toml)")
        else:
            print_table(infos(runs))
        return 0
    path, is_sweep = resolve(args.target, args.runs_root)
    if args.format != "table":
        report.print_records(infos(sweep_points(path) if is_sweep else [(path, "")]), args.format)
    elif is_sweep:
        print_table(infos(sweep_points(path)), title=f"sweep {path}")
    else:
        console.info(format_status(infos([(path, "")])[0]))
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    from ddpjob.launch import report

    root = Path(args.runs_root)
    runs = runs_under(root)
    if args.format != "table":
        report.print_records(infos(runs), args.format)
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
    """Candidate logs of one rank, as the run's backend writes them: logs/rank-R.log (local
    backend, `ddpjob sbatch`; also the first guess before a job exists), submitit's
    <job id>_<R>_log.out/.err."""
    job = job_record(run_dir)
    backend = choose.of_record(job)
    return backend.log_files(run_dir, rank, job) if backend else [run_dir / rundir.LOGS / f"rank-{rank}.log"]


def _check_rank(run_dir: Path, rank: int) -> None:
    from ddpjob import jobfile

    world = jobfile.read_run_config(run_dir).slurm.world_size
    if not 0 <= rank < world:
        raise UsageError(f"rank {rank} does not exist in {run_dir}, which has {world} rank(s)",
                         f"pass --rank between 0 and {world - 1}")


def log_offsets(run_dir: Path, rank: int = 0) -> dict[Path, int]:
    """The sizes of the rank's logs now: where a job submitted next begins in them (every
    attempt appends to the same files), so `--wait` shows only its lines."""
    out: dict[Path, int] = {}
    for f in log_files(run_dir, rank):
        try:
            out[f] = f.stat().st_size
        except OSError:
            continue
    return out


def follow(run_dir: Path, rank: int = 0, poll_s: float = 0.5, state_every_s: float = 2.0,
           out: Any = None, since: dict[Path, int] | None = None) -> RunInfo:
    """Print the rank's logs as they grow, across requeues (appended or new files), until the
    job is finished; then a last read. `since`: where to begin in each file (log_offsets before
    the submission; else from the start). Returns the final RunInfo."""
    out = out or sys.stdout
    offsets: dict[Path, int] = dict(since or {})
    next_check, info = 0.0, run_info(run_dir)
    # the crash verdicts decided while it is followed (the batch shell's or the supervisor's, in a
    # log of their own): each once, beside the rank's output that showed only its symptom
    told = len(_verdicts(run_dir))

    def verdicts() -> None:
        nonlocal told
        new = _verdicts(run_dir)
        for e in new[told:]:
            out.write(f"ddpjob: crash verdict ({e.get('verdict')}, attempt {e.get('restart')}): {e.get('line')}\n")
            out.flush()
        told = max(told, len(new))

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
            verdicts()
            next_check = time.monotonic() + state_every_s
            if info.finished:
                time.sleep(poll_s)  # a last flush of the ranks' output
                drain()
                verdicts()
                return info
        time.sleep(poll_s)


# the ledger's short words for who requeued (rank/requeue.py's requeued_by), as a mark says them
_REQUEUED_BY = {"scontrol": "requeued", "slurm": "requeued by SLURM", "successor": "a successor job"}


def attempt_marks(events: list[dict[str, Any]]) -> list[tuple[tuple[str, int], str]]:
    """((job id, restart), mark) for each start record, in order: the line `ddpjob logs` shows in
    place of a rank's own `ddpjob: attempt N starts: ...` line, numbered by the run's starts and
    saying how the attempt came about (the stop before it, and who brought the run back)."""
    from ddpjob.launch.summary import came_back

    out: list[tuple[tuple[str, int], str]] = []
    prev: int | None = None
    for n, e in enumerate(events):
        if e.get("event") != "start":
            continue
        job = str(e.get("job_id") or "-")
        why = "first start"
        if prev is not None:
            stops = [i for i in range(prev + 1, n) if ledger_events.is_stop(events[i])]
            at_stop = next((i for i in reversed(stops) if ledger_events.is_decision(events[i])),
                           stops[-1] if stops else None)
            if at_stop is None:
                why = "no stop recorded before it: killed?"
            else:
                stop = events[at_stop]
                how = came_back(stop)
                if how == "not requeued":  # brought back by hand (`ddpjob resume`) or torchrun's agent
                    how = "resumed" if str(events[prev].get("job_id") or "-") != job else "restarted"
                how = _REQUEUED_BY.get(how, how)
                at = f" at step {stop['step']}" if isinstance(stop.get("step"), int) else ""
                why = f"{how} after {stop.get('reason') or 'a stop'}{at}"
        restart = e.get("restart")
        number = restart if isinstance(restart, int) else len(out)  # the run's numbering (ledger/attempts.py)
        out.append(((job, restart if isinstance(restart, int) else -1), f"==> attempt {number} (job {job}, {why}) <=="))
        prev = n
    return out


class Marks:
    """Puts each rank's attempt line of a log (read in order, across its files) in the form of its
    mark: the next start record of that job and restart not used yet. A line no record matches
    (a start refused before rank 0 recorded it) stays as the rank wrote it. Not for --follow: a
    rank writes its line before rank 0 records the start, so the mark would depend on timing."""

    def __init__(self, run_dir: Path) -> None:
        self.used, self.marks = 0, attempt_marks(ledger_events.read(run_dir))

    def text(self, text: str) -> str:
        return "".join(self.line(line) for line in text.splitlines(keepends=True))

    def line(self, line: str) -> str:
        found = console.ATTEMPT_LINE.fullmatch(line.rstrip("\n"))
        key = (found.group(2), int(found.group(1))) if found else None
        k = next((k for k in range(self.used, len(self.marks)) if self.marks[k][0] == key), None)
        if k is None:
            return line
        self.used = k + 1
        return self.marks[k][1] + "\n"


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
    marks = Marks(path)
    for f in files:
        if len(files) > 1 and f.stat().st_size:
            console.info(f"==> {f} <==")
        sys.stdout.write(marks.text(f.read_text(errors="replace")))
    sys.stdout.flush()
    if not any(f.stat().st_size for f in files):
        print(f"ddpjob: the log of rank {args.rank} is empty so far (ranks other than 0 print "
              "only warnings and errors)", file=sys.stderr)
    return 0
