"""`checkpoint.snapshot_every = "auto"`: rank 0's measured interval rides the per-step vote.

Rank 0 measures the interval (store/snapauto.py, memsnap.Snapshots.verdict()); every rank must
take it at the same step, since the ranks snapshot the same steps (StateStore.snapshot gathers
the peer copies, a collective) and must share a newest one. Instead of a collective of its own
the interval takes one slot of the vote decide.StepDecider already runs between two steps:
rank 0 puts 0 until its verdict is ready (the probe's write done: it never waits for it), then
interval + 1 (so that 0, snapshots off, can be said); the other ranks put 0 and the MAX is rank
0's. Every rank reads the vote at the same step (lag 0 or 1 alike) and sets the interval there,
before that step's StateStore.snapshot_due. Once it is set the slot stays 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ddpjob import console

if TYPE_CHECKING:
    from ddpjob.store.memsnap import Snapshots


class IntervalVote:
    """A decide.Rider of one slot: the "auto" snapshot interval, from rank 0 (`lead`)."""

    slots = 1

    def __init__(self, snaps: Snapshots, *, lead: bool, say: Callable[[str], None] = console.print0) -> None:
        self._snaps, self._lead, self._say = snaps, lead, say
        # rank 0's verdict once given: the same value at every vote until it has arrived
        self._verdict: tuple[int, str] | None = None

    def values(self) -> list[int]:
        if not self._lead or self._snaps.every is not None:
            return [0]
        if self._verdict is None:
            self._verdict = self._snaps.verdict()
        return [0] if self._verdict is None else [self._verdict[0] + 1]

    def arrived_votes(self, step: int, values: list[int]) -> None:
        if not values[0] or self._snaps.every is not None:
            return
        self._snaps.every = values[0] - 1
        if self._verdict is not None:  # rank 0: the line that says why
            self._say(self._verdict[1])


def for_snapshots(snaps: Snapshots | None, rank: int) -> IntervalVote | None:
    """The rider for a rank's snapshots, or None (no slot) when there are none or their
    interval is fixed: the same on every rank, since it follows the config alone."""
    if snaps is None or snaps.every is not None:
        return None
    return IntervalVote(snaps, lead=rank == 0)
