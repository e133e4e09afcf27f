"""The contract of RUN_DIR/metrics.jsonl, one JSON object a line (docs/commands.md, Metrics):
`kind`, `step`, `restart` (the attempt) and `time` are its own keys; every other number is a
scalar of the loop's. Rank 0 of the API and of the built-in trainer write it (rank/records.py),
a [train] command's program or an integration may (DDPJOB_METRICS). Readers: status and ls
(launch/runs.py), plot, the goodput ledger, the trackers, the crash decision's resume point.

Kinds: "train" (a step's scalars; a line without `kind` counts as one), "eval" (evaluation
scalars), "checkpoint" (the program saved the state of `step`: where it resumes from, so that
the steps lost past it are known; ddpjob's own checkpoints are in its events instead), "end"
(an integration's word that the trainer's run ended by itself at `step`, not by a stop: what
follows is the interpreter's end, rank/command_end.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

TRAIN, EVAL, CHECKPOINT, END = "train", "eval", "checkpoint", "end"
OWN_KEYS = frozenset({"kind", "time", "step", "restart"})  # never a scalar of the loop's


def step_of(rec: Mapping[str, Any]) -> int | None:
    step = rec.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def is_checkpoint(rec: Mapping[str, Any]) -> bool:
    return rec.get("kind") == CHECKPOINT


def is_word(rec: Mapping[str, Any]) -> bool:
    """A program's word on its run (a save, its end), not a step's scalars: no curve point, no
    training time."""
    return rec.get("kind") in (CHECKPOINT, END)


def newest_step(records: Iterable[Mapping[str, Any]]) -> int | None:
    """The newest step any line names (a checkpoint's step was trained too)."""
    steps = [s for r in records if (s := step_of(r)) is not None]
    return max(steps) if steps else None


def newest_checkpoint(records: Iterable[Mapping[str, Any]]) -> int | None:
    """The newest step a program said it saved (None: it says nothing of its saves)."""
    steps = [s for r in records if is_checkpoint(r) and (s := step_of(r)) is not None]
    return max(steps) if steps else None


def trainer_ended(records: Iterable[Mapping[str, Any]], attempt: int) -> int | None:
    """The step at which attempt `attempt`'s trainer said its run ended by itself (an "end" line),
    else None."""
    steps = [step_of(r) for r in records if r.get("kind") == END and r.get("restart") == attempt]
    return next((s for s in reversed(steps) if s is not None), None)
