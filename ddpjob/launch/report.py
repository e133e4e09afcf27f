"""`ddpjob status --json` and `ddpjob ls --json`: one stable JSON object per run, for scripts
(and `--format openmetrics`: the same values as series).

The schema (docs/status-json.md) is versioned by its `schema` key; fields are
only ever added. Values come from the same RunInfo the tables print (runs.py) plus the run
dir's ledger and metrics, so the two views never disagree. JSON has no NaN: a non-finite number
is null. Never imports torch.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ddpjob import rundir
from ddpjob.launch import goodput, runs
from ddpjob.launch.history import load_history
from ddpjob.ledger import events, phases
from ddpjob.ledger.goodput import Ledger

SCHEMA = "ddpjob.run/1"
STRAGGLER_KEYS = ("rank", "host", "cause", "busy_ms", "median_ms", "data_ms", "first_step", "step", "job_id",
                  "restart", "time", "wait_ms", "load", "cores")
SLOWDOWN_KEYS = ("since", "step", "ratio", "cause", "ranks", "step_ms", "baseline_step_ms", "data_ms",
                 "baseline_data_ms", "compute_ms", "baseline_compute_ms", "allreduce_ms", "baseline_allreduce_ms",
                 "line", "job_id", "restart", "time")
STOP_KEYS = ("reason", "step", "job_id", "restart", "steps_lost", "requeued", "requeued_by",
             "next_job_id", "time", "note")


def _num(v: Any) -> float | int | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return v if math.isfinite(v) else None


def record(i: runs.RunInfo, ledger: Ledger | None = None) -> dict[str, Any]:
    """The JSON object for one run."""
    job = runs.job_record(i.run_dir) if i.state != "DAMAGED" else {}
    ids = [str(j) for j in (job.get("job_ids") or ([job["job_id"]] if job.get("job_id") else []))]
    try:
        history = load_history(i.run_dir) if i.state != "DAMAGED" else None
    except (ValueError, OSError) as exc:  # e.g. a metrics.jsonl too large to be a record
        history, i.state, i.reason = None, "DAMAGED", f"{type(exc).__name__}: {exc}"[:200]
    evs = history.events if history else []
    stops = [{**{k: e.get(k) for k in STOP_KEYS}, "phases": phases.recovery(evs, n)}
             for n, e in enumerate(evs) if events.is_decision(e)]
    accs = [(a, r["step"]) for r in (history.evals if history else [])
            if (a := _num(r.get("eval_acc"))) is not None]
    best = max(accs, default=None)
    done = rundir.completed(i.run_dir) if i.state != "DAMAGED" else None
    ckpt = i.checkpoint
    code = runs.code_state(i.run_dir) if i.state != "DAMAGED" else {}
    return {
        "schema": SCHEMA,
        "run_dir": str(i.run_dir),
        "point": i.point or None,
        "backend": i.backend,
        "job_id": i.job_id or None,
        "job_ids": ids,
        "state": i.state,
        "reason": i.reason or None,
        "completed": i.completed,
        "restarts": i.restarts,
        "attempts": i.attempts,
        "stops": stops,
        "step": _num(i.step),
        "loss": _num(i.loss),
        "checkpoint": ({"step": int(ckpt.split("-")[1]),
                        "path": str(i.run_dir / rundir.CHECKPOINTS / ckpt)} if ckpt else None),
        "best_accuracy": None if best is None else {"value": best[0], "step": best[1]},
        "final_accuracy": _num((done or {}).get("accuracy")),
        "code": ({k: v for k, v in code.items() if k != "text"} or None) if i.state != "DAMAGED" else None,
        "goodput": ledger.record() if ledger is not None else None,
        "stragglers": [{k: e.get(k) for k in STRAGGLER_KEYS} for e in evs if e.get("event") == "straggler"],
        "slowdowns": [{**{k: b.get(k) for k in SLOWDOWN_KEYS}, "until_step": o.get("step") if o else None}
                      for b, o in events.slowdowns(evs)],
        "baseline_step_ms": next((_num(e.get("step_ms")) for e in reversed(evs) if e.get("event") == "baseline"), None),
    }


def dumps(obj: dict[str, Any]) -> str:
    return json.dumps(obj, allow_nan=False, sort_keys=False)


def print_records(infos: list[runs.RunInfo], form: str = "json") -> None:
    """JSON Lines: one object per run, in the order the table would list them; or the same
    values as OpenMetrics series, one per run (ddpjob/openmetrics.py, docs/openmetrics.md)."""
    if form == "openmetrics":
        from ddpjob import openmetrics

        openmetrics.client("--format openmetrics")  # its one line before any work
    found = goodput.of_runs(infos)
    records = [record(i, found.get(i.run_dir)) for i in infos]
    if form == "openmetrics":
        print(openmetrics.exposition(openmetrics.of_records(records)), end="", flush=True)
        return
    for r in records:
        print(dumps(r), flush=True)
