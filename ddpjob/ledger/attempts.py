"""A run's attempts: each start of its ranks, numbered once, in the order they ran.

The number (the `restart` field of every record an attempt writes, events and metrics alike) is
unique and increasing across everything that starts ranks again: a requeue, a successor job, a
restart inside the allocation, a new submission (`ddpjob resume`), `ddpjob run` by hand and a
torchrun round. Whoever starts an attempt takes the next number: the local supervisor (it tells
its ranks, DDPJOB_RESTART_COUNT), else rank 0 under the run dir's lock (rank/start.py), after
the previous attempt's end is on record. A reader's rule for metrics: for each step, the record
of the highest attempt.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddpjob.ledger import events

_ENDS = ("local_end", "noop")  # besides a decision: records after which an attempt is over


def _number(e: Mapping[str, Any]) -> int | None:
    r = e.get("restart")
    return r if isinstance(r, int) and not isinstance(r, bool) else None


def next_number(evs: Iterable[Mapping[str, Any]]) -> int:
    """The number a new attempt takes: one past every attempt on record (0 for a new run)."""
    return 1 + max((n for e in evs if (n := _number(e)) is not None), default=-1)


def current(evs: Sequence[Mapping[str, Any]], job_id: Any, *, starting: bool = False) -> int:
    """The attempt `job_id` runs now: its newest attempt that has records but no end yet (a
    crash being decided, a start whose ranks died before their first record), else a new one.
    `starting`: asked by a start (rank 0 under the run lock), so an open attempt whose loop
    already began (its `start` record, a [train] command's `launch`) was an earlier round that
    ended unseen (torchrun's agent restarting its ranks, SLURM's SIGKILL after GraceTime): this
    start is a new attempt."""
    ended = {(str(e.get("job_id")), _number(e)) for e in evs
             if events.is_decision(e) or e.get("event") in _ENDS
             or (starting and e.get("event") in ("start", "launch"))}
    mine = [n for e in evs if str(e.get("job_id")) == str(job_id) and (n := _number(e)) is not None
            and e.get("event") not in ("stop_request", "cancel")]
    for n in reversed(mine):
        if (str(job_id), n) not in ended:
            return n
    return next_number(evs)


@dataclass(frozen=True)
class Attempt:
    """One start of the ranks, as the records tell it."""

    number: int
    job_id: str
    source: str  # slurm, local, torchrun, single (rank 0's start record), "?" before it
    resumed_step: int  # 0: from scratch
    started: float | None  # the start record's time (None: the ranks died before their loop)
    stop: Mapping[str, Any] | None  # the decision that ended it (None: running, or unseen)

    @property
    def ended_by(self) -> str | None:
        return None if self.stop is None else str(self.stop.get("reason"))


def of_run(evs: Sequence[Mapping[str, Any]]) -> list[Attempt]:
    """The run's attempts, in the order they ran (by number)."""
    found: dict[int, dict[str, Any]] = {}
    for e in evs:
        n = _number(e)
        if n is None or e.get("event") in ("stop_request", "cancel", "signal", "straggler", "baseline",
                                           "slowdown"):
            continue
        a = found.setdefault(n, {"job_id": str(e.get("job_id")), "source": "?", "resumed": 0,
                                 "started": None, "stop": None})
        if e.get("event") == "start":
            rs = e.get("resumed_step")
            a.update(source=str(e.get("source") or "?"), started=e.get("time"),
                     resumed=rs if isinstance(rs, int) and not isinstance(rs, bool) else 0)
        elif events.is_decision(e):
            a["stop"] = e
    return [Attempt(n, a["job_id"], a["source"], a["resumed"], a["started"], a["stop"])
            for n, a in sorted(found.items())]
