"""Per-rank state: `ddpjob.PerRank(obj)` marks a value of `state` that each rank keeps its own of
(a torch.Generator for the batch offsets, a per-rank counter). The rest of `state` is the job's:
rank 0's copy is saved and loaded into every rank. A PerRank's state rides in the rank's own
RNG file (`rank-R.pt`, store/state.py), so it is saved, snapshotted and sent between nodes
exactly as the rank's RNG streams are, and resumed by the same rank number.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ddpjob.errors import DDPJobError

KEY = "per_rank"  # the key of rank-R.pt holding this rank's PerRank values, by state key


class PerRank:
    """A value of `state` that is each rank's own: a torch.Generator, or an object with
    state_dict()/load_state_dict(). `.obj` is the object itself."""

    def __init__(self, obj: Any) -> None:
        stateful = callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
        if not (isinstance(obj, torch.Generator) or stateful):
            raise DDPJobError(f"ddpjob.PerRank() got a {type(obj).__name__}, expected a torch.Generator "
                              "or an object with state_dict() and load_state_dict()",
                              "wrap the object that holds the rank's own state, e.g. ddpjob.PerRank(generator)")
        self.obj = obj

    def __repr__(self) -> str:
        return f"PerRank({self.obj!r})"

    def capture(self) -> Any:
        return self.obj.get_state() if isinstance(self.obj, torch.Generator) else self.obj.state_dict()

    def restore(self, saved: Any) -> None:
        if isinstance(self.obj, torch.Generator):
            self.obj.set_state(saved)
        else:
            self.obj.load_state_dict(saved)


def keys(state: Mapping[str, Any]) -> list[str]:
    return [k for k, v in state.items() if isinstance(v, PerRank)]


def capture(state: Mapping[str, Any]) -> dict[str, Any]:
    """What joins this rank's RNG file: {KEY: {key: state}}, or {} without PerRank values."""
    mine = {k: v.capture() for k, v in state.items() if isinstance(v, PerRank)}
    return {KEY: mine} if mine else {}


def restore(state: Mapping[str, Any], saved: Mapping[str, Any] | None, *, where: str) -> list[str]:
    """Load this rank's saved values (`saved`: its RNG file, None when the checkpoint has none
    for this rank, which is a new rank of a grown job) into the PerRank values of `state`;
    returns the keys that start from the object as built."""
    held = (saved or {}).get(KEY, {})
    fresh = []
    for key in keys(state):
        if key not in held:
            fresh.append(key)
            continue
        try:
            state[key].restore(held[key])
        except (RuntimeError, KeyError, ValueError, TypeError) as err:
            raise DDPJobError(f"state '{key}' (per rank) in {where} does not fit this run's "
                              f"{type(state[key].obj).__name__} ({' '.join(str(err).split())[:200]})",
                              "resume with the same per-rank objects, or use a new run dir") from None
    return fresh


def resize_line(names: list[str], old: int, new: int) -> str:
    """The rule at another world size, said once (rank 0): rank r takes old rank r's values where
    that rank existed; new ranks start from their objects as built; the values of ranks that are
    gone are dropped (there is no rank to take them: merging generators has no meaning)."""
    what = ", ".join(f"state[{k!r}]" for k in names)
    kept = (f"ranks 0-{min(old, new) - 1} take their" if min(old, new) > 1 else "rank 0 takes its")
    rest = (f"ranks {old}-{new - 1} start from theirs as built" if new > old
            else f"the saved values of ranks {new}-{old - 1} are dropped")
    return f"{what} (per rank) at {old} -> {new} ranks: {kept} own saved values, {rest}"
