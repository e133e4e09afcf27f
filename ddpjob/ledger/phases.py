"""A recovery, phase by phase: from the signal that stopped an attempt to the first step of the
next one, read from events.jsonl (never imports torch). `ddpjob status`, `status --json` and
`ddpjob plot` show the same numbers.

What rank 0 records, and where (ddpjob/api.py, node/requeue.py):
  signal (each rank)  signal_time: when the stop signal reached the rank
  stop                decided_time: the vote said stop; saved_time: the checkpoint is committed
  exit                time: the process group is torn down, the process ends next
  local_start (next)  time: the local supervisor started the ranks (a warm start's import included)
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


def launched(events: list[dict[str, Any]], i: int) -> float | None:
    """When the attempt that events[i] (a start record) begins had its processes started: the
    local supervisor's `local_start` of the job since the previous start, where there is one (a
    warm-started rank is forked once the warm server has imported torch, so its own process
    start, launched_time, leaves that import out), else the rank's launched_time."""
    start = events[i]
    for e in reversed(events[:i]):
        if e.get("event") == "start":
            break
        if e.get("event") == "local_start" and str(e.get("job_id")) == str(start.get("job_id")):
            return min(t for t in (_t(e, "time"), _t(start, "launched_time")) if t is not None)
    return _t(start, "launched_time")


def recovery(events: list[dict[str, Any]], i: int) -> dict[str, float]:
    """Seconds per phase of the recovery from the stop at events[i], in PHASES order."""
    stop = events[i]
    signals = [t for e in events if e.get("event") == "signal" and _same_attempt(e, stop)
               if (t := _t(e, "signal_time")) is not None]
    signalled = min(signals, default=_t(stop, "signal_time"))
    exited = next((e for e in events[i + 1:] if e.get("event") == "exit" and _same_attempt(e, stop)), None)
    at = next((n for n in range(i + 1, len(events)) if events[n].get("event") == "start"), None)
    start = began = first = None
    if at is not None:
        start, began = events[at], launched(events, at)
        first = next((e for e in events[at + 1:] if e.get("event") == "first_step"
                      and _same_attempt(e, events[at])), None)
    ends = [
        ("stop vote", signalled, _t(stop, "decided_time")),
        ("save", _t(stop, "decided_time"), _t(stop, "saved_time")),
        ("exit", _t(stop, "saved_time"), _t(exited, "time")),
        ("requeue", _t(exited, "time"), began),
        # everything from the process's start to the loop but the load: imports, the process
        # group, building the model and the data
        ("start-up", began, _minus(_t(start, "time"), _t(start, "load_s"))),
        ("load", 0.0, _t(start, "load_s")),
        ("first step", _t(start, "time"), _t(first, "time")),
    ]
    return {name: round(max(0.0, b - a), 3) for name, a, b in ends if a is not None and b is not None}


def describe(phases: dict[str, float]) -> str:
    """'stop vote 0.05 s, save 0.31 s, ...' ('' when nothing was recorded)."""
    return ", ".join(f"{name} {phases[name]:.2f} s" for name in PHASES if name in phases)
