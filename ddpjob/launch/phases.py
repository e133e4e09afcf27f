"""A recovery, phase by phase: from the signal that stopped an attempt to the first step of the
next one, read from events.jsonl (never imports torch). `ddpjob status`, `status --json` and
`ddpjob plot` show the same numbers.

What rank 0 records, and where (ddpjob/api.py, node/requeue.py):
  signal (each rank)  signal_time: when the stop signal reached the rank
  stop                decided_time: the vote said stop; saved_time: the checkpoint is committed
  exit                time: the process group is torn down, the process ends next
  start (next)        launched_time: the process started (/proc); load_s: the checkpoint load;
                      time: the loop is about to begin
  first_step (next)   time: the first step of the attempt is done

The phases add up to the time from the signal to the end of the next first step. A phase
whose ends were not both recorded (a crash, a stop recorded by the next start, a run
made by an older ddpjob) is left out rather than guessed.
"""

from __future__ import annotations

from typing import Any

PHASES = ("stop vote", "save", "exit", "requeue", "start-up", "load", "first step")


def _t(rec: dict[str, Any] | None, key: str) -> float | None:
    v = (rec or {}).get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _same_attempt(e: dict[str, Any], stop: dict[str, Any]) -> bool:
    return str(e.get("job_id")) == str(stop.get("job_id")) and e.get("restart") == stop.get("restart")


def recovery(events: list[dict[str, Any]], i: int) -> dict[str, float]:
    """Seconds per phase of the recovery from the stop at events[i], in PHASES order."""
    stop = events[i]
    signals = [t for e in events if e.get("event") == "signal" and _same_attempt(e, stop)
               if (t := _t(e, "signal_time")) is not None]
    signalled = min(signals, default=_t(stop, "signal_time"))
    exited = next((e for e in events[i + 1:] if e.get("event") == "exit" and _same_attempt(e, stop)), None)
    start = next((e for e in events[i + 1:] if e.get("event") == "start"), None)
    first = None
    if start is not None:
        first = next((e for e in events[events.index(start) + 1:] if e.get("event") == "first_step"
                      and _same_attempt(e, start)), None)
    ends = [
        ("stop vote", signalled, _t(stop, "decided_time")),
        ("save", _t(stop, "decided_time"), _t(stop, "saved_time")),
        ("exit", _t(stop, "saved_time"), _t(exited, "time")),
        ("requeue", _t(exited, "time"), _t(start, "launched_time")),
        # everything from the process's start to the loop but the load: imports, the process
        # group, building the model and the data
        ("start-up", _t(start, "launched_time"), _minus(_t(start, "time"), _t(start, "load_s"))),
        ("load", 0.0, _t(start, "load_s")),
        ("first step", _t(start, "time"), _t(first, "time")),
    ]
    return {name: round(max(0.0, b - a), 3) for name, a, b in ends if a is not None and b is not None}


def describe(phases: dict[str, float]) -> str:
    """'stop vote 0.05 s, save 0.31 s, ...' ('' when nothing was recorded)."""
    return ", ".join(f"{name} {phases[name]:.2f} s" for name in PHASES if name in phases)
