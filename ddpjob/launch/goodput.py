"""The goodput ledgers of runs as `ddpjob status`, `status --json` and `ddpjob plot` show them:
the arithmetic (ledger/goodput.py) fed each run's events.jsonl and metrics.jsonl and the
scheduler's record of every start of its jobs (Backend.incarnations: sacct's Submit, Start and
End), which only the login side can ask for: the queue wait.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from ddpjob import fileio, rundir
from ddpjob.launch import runs
from ddpjob.launch.backends import TERMINAL, choose
from ddpjob.ledger import events
from ddpjob.ledger.goodput import Ledger, build


def of_runs(infos: list[runs.RunInfo]) -> dict[Path, Ledger | None]:
    """Each run's goodput ledger, with one scheduler query per backend for all their jobs' starts."""
    asks: dict[str, tuple[Any, set[str]]] = {}
    per_run: dict[Path, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
    for i in infos:
        if i.state == "DAMAGED":
            continue
        try:
            job, evs = runs.job_record(i.run_dir), events.read(i.run_dir)
        except (ValueError, OSError):
            continue
        per_run[i.run_dir] = (job, evs)
        backend = choose.of_record(job)
        ids = {str(j) for j in job.get("job_ids") or [job.get("job_id")] if j}
        ids |= {str(e["job_id"]) for e in evs if e.get("event") == "start" and e.get("job_id")}
        if backend is not None:
            asks.setdefault(backend.name, (backend, set()))[1].update(
                j for j in ids if re.fullmatch(r"[0-9]+(_[0-9]+)?", j))
    known: dict[str, Any] = {}
    for backend, ids in asks.values():
        if ids:
            known.update(backend.incarnations(sorted(ids)))
    out: dict[Path, Ledger | None] = {}
    now = time.time()
    for i in infos:
        if i.run_dir not in per_run:
            out[i.run_dir] = None
            continue
        job, evs = per_run[i.run_dir]
        try:
            metrics = fileio.read_jsonl(i.run_dir / rundir.METRICS)
        except (ValueError, OSError):
            metrics = []
        ids = {str(e.get("job_id")) for e in evs} | {str(j) for j in job.get("job_ids") or [job.get("job_id")] if j}
        submitted = job.get("submitted_at")
        out[i.run_dir] = build(
            evs, metrics, {j: known[j] for j in ids if j in known}, now=now,
            running=i.state not in TERMINAL and i.state not in ("UNKNOWN", "DAMAGED"),
            submitted=float(submitted) if isinstance(submitted, (int, float)) and not isinstance(submitted, bool) else None)
    return out
