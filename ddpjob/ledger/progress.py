"""Did a [train] command's attempt get anywhere? The evidence a crash-loop rule may use, for a
program ddpjob does not drive (pure reading, no torch): the decider (rank/requeue.after_crash,
launch/local.Supervisor.retry_crash) asks before the policy decides a crash.

In order of strength: its metrics lines (the newest step it logged: the step rules of
ledger/crashes.py apply as for the API), else the files under [train] command_progress (a file
changed after the attempt began: it got on), else its output (the crashed rank's last line, the
same as the crash before it: no further). Without any of them the answer is "unknown", and no
rule fires on it: only max_failures bounds the retries (a loop is never read off "step 0 ==
step 0" of a program that logs no steps).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpjob.ledger import crashes, events

MAX_FILES = 10000  # walked under a progress folder before the answer is "it got on" anyway


@dataclass(frozen=True)
class Evidence:
    """What the decider knows of an attempt's progress."""

    step: int | None  # the newest step its metrics lines show (None: it logs no steps)
    progressed: bool | None  # without steps: whether it got on (None: nothing tells)
    by: str  # in words, for the verdict line: "its files under out/", "its last line of output"
    last_output: str | None = None  # the crashed rank's last line, recorded for the next crash


def newest_change(path: Path) -> float | None:
    """The newest modification time of `path` or of anything under it (None: nothing there)."""
    try:
        newest = path.stat().st_mtime
    except OSError:
        return None
    if path.is_dir():
        for n, (folder, _, files) in enumerate(os.walk(path)):
            for name in files:
                try:
                    newest = max(newest, os.stat(os.path.join(folder, name)).st_mtime)
                except OSError:
                    continue
            if n > MAX_FILES:
                break
    return newest


def _began(evs: Sequence[dict[str, Any]], job_id: Any, restart: int) -> float | None:
    for e in evs:
        if e.get("event") in ("start", "local_start") and events.of_attempt(e, job_id, restart):
            t = e.get("launched_time") or e.get("time")
            if isinstance(t, (int, float)) and not isinstance(t, bool):
                return float(t)
    return None


def _last_output(evs: Sequence[dict[str, Any]], job_id: Any, restart: int, rank: int | None) -> str | None:
    """The crashed rank's last line of output in its crash record (the first crash record of the
    attempt where the culprit's rank is not known)."""
    mine = [e for e in evs if events.is_rank_crash(e) and events.of_attempt(e, job_id, restart)
            and isinstance(e.get("last_output"), str) and e["last_output"]]
    chosen = next((e for e in mine if e.get("rank") == rank), mine[0] if mine else None)
    return None if chosen is None else str(chosen["last_output"])


def of_attempt(run_dir: Path, evs: Sequence[dict[str, Any]], job_id: Any, restart: int, *,
               progress_path: Path | None, culprit_rank: int | None) -> Evidence:
    """The evidence of attempt (job_id, restart) of a command run, strongest first."""
    step = crashes.command_saved(run_dir)
    line = _last_output(evs, job_id, restart, culprit_rank)
    if step is not None:
        return Evidence(step, None, "its metrics lines", line)
    if progress_path is not None:
        began, changed = _began(evs, job_id, restart), newest_change(progress_path)
        got_on = None if began is None else changed is not None and changed > began
        return Evidence(None, got_on, f"its files under {progress_path}", line)
    before = [e for e in events.final_decisions(evs) if e.get("reason") == "crash"
              and not events.of_attempt(e, job_id, restart)]
    prev = before[-1].get("last_output") if before else None
    got_on = None if line is None or not isinstance(prev, str) else line != prev
    return Evidence(None, got_on, "its last line of output", line)


@dataclass(frozen=True)
class Point:
    """Where a crashed command run stands for the decision: the step it resumes from and the
    steps lost (None: it logs no steps), its evidence, and the decision record's fields for it."""

    resume_at: int | None
    steps_lost: int | None
    evidence: Evidence

    def fields(self) -> dict[str, Any]:
        ev = self.evidence
        return {**({"progress": ev.progressed} if ev.progressed is not None else {}),
                **({"last_output": ev.last_output} if ev.last_output else {})}

    def facts(self) -> dict[str, Any]:
        """crashes.facts' keywords for it."""
        return {"resume_at": self.resume_at, "steps_lost": self.steps_lost, "from_snapshot": False,
                "own_checkpoint": True, "progressed": self.evidence.progressed, "evidence": self.evidence.by}


def point(run_dir: Path, evs: Sequence[dict[str, Any]], job_id: Any, restart: int, *,
          progress_path: Path | None, culprit_rank: int | None) -> Point:
    """A crashed command attempt's resume point (its own checkpoint: at most its newest logged
    step) and progress evidence, for rank/requeue.after_crash and the local supervisor alike."""
    ev = of_attempt(run_dir, evs, job_id, restart, progress_path=progress_path, culprit_rank=culprit_rank)
    return Point(*crashes.command_point(run_dir), ev)
