"""Every record kind of RUN_DIR/events.jsonl, its fields, the schema version, and the one writer
and reader of the file (docs/events.md is the same list in words).

A record is one JSON object per line: `event` (its kind), `time`, `v` (the schema version that
wrote it; absent: written before versions, read as 1), and, for everything an attempt does,
`job_id` and `restart` (the attempt's number within the run: attempts.py). Readers never crash
on what they meet: a line that breaks the field types is skipped (fileio.read_jsonl), a kind this
ddpjob does not know or a record of a newer schema is kept for the views that can use it and
said once (notes()).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpjob import fileio, rundir

SCHEMA = 1  # fields are only ever added; a new meaning of a field is a new version
COMMON = ("event", "time", "v", "job_id", "restart")


@dataclass(frozen=True)
class Kind:
    """One record kind: who writes it, when, and the fields it may carry beyond COMMON."""

    name: str
    doc: str
    fields: tuple[str, ...]
    extra: bool = False  # may carry the loop's own fields (job.steps(**info))


_STOP_FIELDS = (
    # what stopped and where
    "reason", "step", "steps_lost", "status", "note", "source", "unseen", "accuracy",
    # SLURM's restart count of the job when the decision was made: which start of a requeued
    # job (same id) it decided for (rank/requeue.after_crash)
    "incarnation",
    # torchrun's agent (its pid) whose restart round was decided (rank/rounds.py): its later
    # rounds keep an end, a new torchrun of the run does not
    "agent",
    # a recovery's timestamps (ledger/phases.py)
    "signal_time", "decided_time", "saved_time",
    # the decision: requeued (True / False / None: not asked), by whom, the successor
    "requeued", "requeued_by", "next_job_id",
    # a crash: the culprit (crashes.Culprit.fields), the verdict (policy.Verdict.fields), loops
    "failed_rank", "failed_host", "failed_how", "host_fault", "no_progress", "lost_hosts",
    "verdict", "action", "line", "where", "asked",
    # a straggler's stop ([slurm] on_straggler): the host left out, the rank named, its cause
    "excluded_host", "straggler_rank", "cause", "srun_attempt",
    # a rank's own crash record (carries `rank`): its error line and what kind of error
    "rank", "host", "error", "error_class", "exception",
    # a [train] command: what its program did after the stop signal (rank/command_end.py), its
    # last line of output (the progress evidence of a program that logs no steps), whether the
    # attempt got anywhere by that evidence (ledger/progress.py)
    "program", "last_output", "progress",
)

KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("start", "rank 0: an attempt's loop is about to begin (Job.steps)",
         ("world_size", "source", "host", "resumed_step", "launched_time", "load_s", "warm"), extra=True),
    Kind("first_step", "rank 0: the attempt's first step is done", ("step", "graphs")),
    Kind("checkpoint", "rank 0: a periodic checkpoint was saved; its hold on the loop",
         ("step", "block_s", "snapshot_s")),
    Kind("signal", "a rank (or the local supervisor) received a stop signal",
         ("rank", "signal", "at_step", "stop_step", "signal_time", "source")),
    Kind("stop", "an attempt ended: the decision (no `rank`) or a rank's own crash record (`rank`)",
         _STOP_FIELDS),
    Kind("launch", "rank 0 of a [train] command: its program started (the job's id on record for status and "
         "stop at once; the start record follows at its first step line)", ("world_size", "host", "source")),
    Kind("rank_end", "a [train] command's rank: its program ended (rank 0 completes the run only when "
         "every rank's did with 0 and no stop; `teardown`: its 0 read from an abort in torch's teardown, "
         "which needs a peer's own 0)", ("rank", "host", "status", "stop", "program", "teardown")),
    Kind("exit", "rank 0: the process group is torn down after a stop", ("step",)),
    Kind("noop", "rank 0: a requeued run that had completed did nothing", ("reason",)),
    Kind("local_start", "the local supervisor started an attempt's ranks",
         ("source", "world_size", "master_port")),
    Kind("local_end", "the local supervisor ended the run", ("source", "state", "reason")),
    Kind("stop_request", "`ddpjob stop` asked the job to checkpoint and end", ("by",)),
    Kind("cancel", "`ddpjob cancel` cancelled the job", ("by",)),
    Kind("straggler", "rank 0's straggler watch named a slow rank (cause compute or data) or an "
         "oversubscribed host (cause host: `rank` waited for a core, `load` on `cores`)",
         ("rank", "host", "cause", "busy_ms", "median_ms", "data_ms", "step", "first_step", "wait_ms",
          "load", "cores", "line")),
    Kind("baseline", "rank 0: the run's own speed, the median step over a window after the warm-up",
         ("step", "world_size", "step_ms", "data_ms", "compute_ms", "allreduce_ms", "busy_ms")),
    Kind("slowdown", "rank 0: the job's step time stayed above its baseline (state began) or came back (over)",
         ("state", "since", "step", "ratio", "cause", "ranks", "step_ms", "data_ms", "compute_ms",
          "allreduce_ms", "baseline_step_ms", "baseline_data_ms", "baseline_compute_ms",
          "baseline_allreduce_ms", "line")),
    Kind("checkpoint_rejected", "a checkpoint that verified but holds code was skipped", ("step", "reason")),
)}


def record(run_dir: str | Path, kind: str, **fields: Any) -> dict[str, Any]:
    """Append one record of `kind` (time and schema version added) and return it. A kind or a
    field this module does not declare is ddpjob's own bug: refused before anything is written."""
    k = KINDS.get(kind)
    if k is None:
        raise ValueError(f"unknown event kind {kind!r}")
    unknown = set(fields) - set(COMMON) - set(k.fields)
    if unknown and not k.extra:
        raise ValueError(f"event {kind!r} has no field(s) {sorted(unknown)}")
    rec = {"time": time.time(), "event": kind, "v": SCHEMA, **fields}
    fileio.append_jsonl(Path(run_dir) / rundir.EVENTS, rec)
    return rec


def read(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every readable record, in the order written."""
    return fileio.read_jsonl(Path(run_dir) / rundir.EVENTS)


def notes(evs: Iterable[Mapping[str, Any]]) -> str:
    """One line for what this ddpjob read only in part ('' when nothing): kinds it does not know
    and records of a newer schema (a newer ddpjob wrote into this run dir)."""
    newer = sum(1 for e in evs if isinstance(e.get("v"), int) and e["v"] > SCHEMA)
    unknown = sorted({str(e.get("event")) for e in evs if e.get("event") not in KINDS})
    parts = ([f"{newer} record(s) of a newer schema, read as schema {SCHEMA}"] if newer else []) + \
        ([f"unknown kind(s) {', '.join(unknown)[:120]} skipped"] if unknown else [])
    return "; ".join(parts)


# ------------------------------------------------------------------ the stop records
def decision(run_dir: str | Path, reason: str, *, job_id: Any, restart: Any, **fields: Any) -> dict[str, Any]:
    """Write an attempt's decision (is_decision: a stop without `rank`): why it ended (`reason`:
    policy.STOPS, FAILURES, user_stop, signal, finished, budget, killed) and what was decided."""
    if "rank" in fields:
        raise ValueError("a decision is the whole job's: it has no `rank` (a rank's own crash: rank_crash)")
    return record(run_dir, "stop", reason=reason, job_id=job_id, restart=restart, **fields)


def rank_crash(run_dir: str | Path, *, rank: int, host: str, job_id: Any, restart: Any, error: str,
               **fields: Any) -> dict[str, Any]:
    """Write a rank's own record of the error that ended it (is_rank_crash: a stop with `rank`);
    the decision about the attempt is another's (the batch shell, the supervisor, torchrun's next round)."""
    return record(run_dir, "stop", reason="crash", rank=rank, host=host, job_id=job_id, restart=restart,
                  error=error, **fields)


# ------------------------------------------------------------------ what a record is
def is_decision(e: Mapping[str, Any]) -> bool:
    """The attempt's stop as decided for the whole job (rank 0, the batch shell's decision, the
    local supervisor, or the next start for an end nobody saw): a stop without `rank`."""
    return e.get("event") == "stop" and "rank" not in e


def final_decisions(evs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Each attempt's decision, in the order written: where one attempt has two, the later one
    took the first's place (rank 0's stop that decided nothing, then the batch shell's decision
    of the crash srun saw: rank/requeue._step_ended_by_srun)."""
    last = {(str(e.get("job_id")), e.get("restart")): i for i, e in enumerate(evs) if is_decision(e)}
    return [e for i, e in enumerate(evs) if is_decision(e) and last[(str(e.get("job_id")), e.get("restart"))] == i]


def is_stop(e: Mapping[str, Any]) -> bool:
    """Any stop record: a decision or a rank's own crash record."""
    return e.get("event") == "stop"


def is_rank_crash(e: Mapping[str, Any]) -> bool:
    """A rank's own record of the error that ended it (rank/runner.py): a stop with `rank`."""
    return e.get("event") == "stop" and "rank" in e


def of_attempt(e: Mapping[str, Any], job_id: Any, restart: Any) -> bool:
    return str(e.get("job_id")) == str(job_id) and e.get("restart") == restart


def slowdowns(evs: Sequence[Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], Mapping[str, Any] | None]]:
    """Each slowdown the watch said (rank/slowdown.py) and its end (None: it lasted to the end
    of its attempt, or lasts)."""
    out: list[tuple[Mapping[str, Any], Mapping[str, Any] | None]] = []
    for e in evs:
        if e.get("event") != "slowdown":
            continue
        if e.get("state") == "began":
            out.append((e, None))
        elif out and out[-1][1] is None and (out[-1][0].get("job_id"), out[-1][0].get("restart")) == (
                e.get("job_id"), e.get("restart")):
            out[-1] = (out[-1][0], e)
    return out
