"""Acting on a named straggler ([slurm] on_straggler, docs/failures.md): what the run's ledger says
about the actions taken, read by rank 0 before it stops the ranks for one (rank/stragglerstop.py),
by the batch shell's restart layout (rank/requeue.restart_layout leaves the host out, as it leaves
out a host [slurm] exclude_after quarantined) and by `status`.

An action is the decision record of a stop with reason "straggler" (rank 0's, after every rank
stopped at one step with a checkpoint): `excluded_host` the host left out, `line` the verdict.
Pure: no torch, no SLURM.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ddpjob.ledger import events

REASON = "straggler"  # the decision's reason (events.jsonl)
MODES = ("off", "exclude", "requeue")


def actions(evs: Iterable[Mapping[str, Any]], chain: set[str] | None = None) -> list[Mapping[str, Any]]:
    """The run's straggler actions (of the job chain `chain`, None: every job), oldest first."""
    return [e for e in evs if events.is_decision(e) and e.get("reason") == REASON
            and isinstance(e.get("excluded_host"), str) and (chain is None or str(e.get("job_id")) in chain)]


def excluded(evs: Iterable[Mapping[str, Any]], chain: set[str] | None = None, action: str = "restart") -> list[str]:
    """The hosts left out for straggling by the actions of kind `action` (policy.RESTART: a restart
    inside the allocation; policy.REQUEUE: the requeued job's ExcNodeList), in name order."""
    return sorted({str(e["excluded_host"]) for e in actions(evs, chain) if e.get("action") == action})


def blocked(evs: Iterable[Mapping[str, Any]], step: int, every: int) -> int | None:
    """The step of the run's last action where it was fewer than `every` steps before `step` (no
    new action yet: at most one per [slurm] straggler_exclude_every steps of progress), else None."""
    steps = [int(e["step"]) for e in actions(evs) if isinstance(e.get("step"), int)]
    last = max(steps, default=None)
    return last if last is not None and step - last < every else None


def describe(rank: int, host: str, cause: str, busy_s: float, median_s: float) -> str:
    """The verdict line's first half: who is slow, why, by how much."""
    return (f"rank {rank} on {host} is a straggler ({cause}, {1000 * busy_s:.1f} ms of work a step "
            f"against {1000 * median_s:.1f} ms)")
