"""The types of the fields that every reader of events.jsonl and metrics.jsonl does arithmetic
on. A record that breaks them ("restart": "x", "time": "soon", a NaN time, a 400-digit loss) is a
damaged line: fileio.read_jsonl skips it like a torn one, so one bad line never crashes status,
ls, plot or a resume, and `status` names it (fileio.damaged_lines)."""

from __future__ import annotations

import json
import math
from typing import Any

_INTS = frozenset({"step", "restart", "resumed_step", "world_size", "steps_lost", "status", "rank",
                   "accumulation", "master_port", "failed_rank", "no_progress"})
_NUMBERS = frozenset({"epoch"})  # a custom loop may log a fractional epoch
_TIMES = frozenset({"time", "signal_time", "launched_time", "load_s", "updated_at", "decided_time", "saved_time",
                    "block_s", "snapshot_s"})
# ddpjob's own words only: a loop's job.log() may use any other name for any value
_STRS = frozenset({"event", "reason", "kind"})
_BIG = 1 << 53  # past this an int no longer converts to float exactly (plot, rates)


def type_error(rec: dict[str, Any]) -> str | None:
    """Why a record breaks the field types above, or None."""
    for key, value in rec.items():
        if value is None:
            continue
        bad = ((isinstance(value, int) and not isinstance(value, bool) and abs(value) >= _BIG)
               or (key in _INTS and (not isinstance(value, int) or isinstance(value, bool)))
               or (key in _NUMBERS and (isinstance(value, bool) or not isinstance(value, (int, float))))
               or (key in _TIMES and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)))
               or (key in _STRS and not isinstance(value, str)))
        if bad:
            expected = ("an integer" if key in _INTS else "a finite number" if key in _TIMES
                        else "a number" if key in _NUMBERS
                        else "text" if key in _STRS else "a number below 2**53")
            return f"{key!r} is {json.dumps(value)[:40]}, expected {expected}"
    return None
