"""A run's history as the login side reads it: rank 0's metrics lines (one record per step, the
re-run step's latest), its evaluations, the restarts as markers at the step each resumed from,
and the events. `ddpjob plot` (plot.py) draws it; the text summary (summary.py, `status`) and
the reports (report.py) read it. Reads the run dir only, nothing is asked of the scheduler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpjob import fileio, rundir
from ddpjob.ledger import crashes, events, metricslines

# (metrics key, panel title): the four panels, in reading order.
PANELS = (("loss", "train loss"), ("eval_acc", "eval accuracy"), ("lr", "learning rate"),
          ("img_s", "images/s"))
# A record's bookkeeping, not a metric; every other number a loop logs gets a panel of its own.
# eval_s: the evaluation's seconds, drawn in the goodput panel's "eval" instead
_NOT_METRICS = metricslines.OWN_KEYS | {"epoch", "eval_s"}
MAX_CUSTOM_PANELS = 8


def custom_metrics(histories: list[History]) -> list[str]:
    """The user's own logged metrics (job.log(grad_norm=...)), beyond the built-in panels."""
    fixed = {key for key, _ in PANELS}
    seen: dict[str, None] = {}
    for h in histories:
        for r in [*h.train, *h.evals]:
            for k, v in r.items():
                if k not in fixed and k not in _NOT_METRICS and isinstance(v, (int, float)) \
                        and not isinstance(v, bool):
                    seen.setdefault(k)
    return sorted(seen)[:MAX_CUSTOM_PANELS]


@dataclass(frozen=True)
class Marker:
    """A restart: training resumed at `step` after a stop for `reason`."""

    step: int
    reason: str
    restart: int  # the attempt's number in the run (ledger/attempts.py): 1 for the first restart ...

    @property
    def label(self) -> str:
        return f"restart {self.restart}: {self.reason}"


@dataclass
class History:
    name: str
    train: list[dict[str, Any]]  # one record per step (a re-run step keeps its latest record)
    evals: list[dict[str, Any]]
    markers: list[Marker]
    events: list[dict[str, Any]]
    exclude_after: int = crashes.QUARANTINE_AFTER  # the run's [slurm] exclude_after


def number(v: Any) -> float:
    """Metrics values: numbers, or "nan"/"inf" strings (JSON has no NaN)."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def restart_markers(evs: list[dict[str, Any]]) -> list[Marker]:
    """Every "start" after the first one is a restart; its reason is the last stop before it."""
    markers: list[Marker] = []
    started = False
    reason: str | None = None
    for e in evs:
        kind = e.get("event")
        if kind == "stop":
            reason = str(e.get("reason") or "stopped")
        elif kind == "cancel" and reason is None:
            reason = "cancelled"
        elif kind == "start":
            if started:
                step = e.get("resumed_step")
                number = e.get("restart")
                markers.append(Marker(int(step) if isinstance(step, int) else 0, reason or "killed (no stop recorded)",
                                      number if isinstance(number, int) and not isinstance(number, bool)
                                      else len(markers) + 1))
            started, reason = True, None
    return markers


def load_history(run_dir: str | Path, name: str | None = None) -> History:
    run = Path(run_dir)
    train: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    for rec in fileio.read_jsonl(run / rundir.METRICS):
        if not isinstance(rec.get("step"), int) or metricslines.is_word(rec):
            continue  # a program's word on its save or its end (ledger/metricslines.py) is no curve point
        is_eval = rec.get("kind") == "eval" or (rec.get("kind") is None and "eval_acc" in rec)
        (evals if is_eval else train)[rec["step"]] = rec  # later (re-run) records win
    evs = events.read(run)
    after = fileio.read_record(run / "config.json").get("slurm", {}).get("exclude_after")
    return History(name or run.name, [train[s] for s in sorted(train)],
                   [evals[s] for s in sorted(evals)], restart_markers(evs), evs,
                   after if isinstance(after, int) and not isinstance(after, bool) else crashes.QUARANTINE_AFTER)
