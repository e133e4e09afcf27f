"""The one decision between two optimizer steps: does every rank stop, and is a checkpoint due.

`Job.steps()` asks `StepDecider.after_step(step)` after each step and acts on the answer (save,
stop for a requeue); everything that goes into the answer lives here: the stop flag (signals),
the save schedule (steps, minutes), the deadline watch and whether a background write is still
busy. Every rank puts in its own view and the channel takes the element-wise MAX over the ranks,
so every rank gets the same answer at the same step.

With `lag` 1 (train.stop_vote = "overlap", the default) the vote started after step s travels
while step s+1 computes and is read after it: nothing waits for it, and a stop lands one step
later. With `lag` 0 it is read at once (one blocking all-reduce per step).

Other values ride the same all-reduce (a Rider, several as one Riders): the step times of the
straggler watch (rank/steptimer.py) and, with checkpoint.snapshot_every = "auto", rank 0's
measured snapshot interval (rank/snapvote.py), so neither needs a collective of its own.

No torch and no process group: the channel is anything with `agree` / `start_agree` (node/dist's
Control, or a fake in tests/unit/test_decide.py), the clock a plain function.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ddpjob.node.preemption import DEADLINE, DeadlineWatch, StopFlag
from ddpjob.store.schedule import SaveSchedule


class Pending(Protocol):
    def result(self) -> list[int]: ...


class Rider(Protocol):
    """Values that travel with the vote, after its own three (rank/steptimer.StepTimer's step
    times, rank/snapvote.IntervalVote's snapshot interval): `slots` of them, the same number on
    every rank and at every vote, each rank filling its own (the channel takes the MAX)."""

    @property
    def slots(self) -> int: ...

    def values(self) -> list[int]: ...

    def arrived_votes(self, step: int, values: list[int]) -> None: ...


class Riders:
    """Several riders on one vote, each owning a slice of the values in the order given; a
    rider with no slots takes none and hears nothing (so the vote is the same as without it)."""

    def __init__(self, *riders: Rider | None) -> None:
        self._riders = [r for r in riders if r is not None and r.slots]

    @property
    def slots(self) -> int:
        return sum(r.slots for r in self._riders)

    def values(self) -> list[int]:
        out: list[int] = []
        for r in self._riders:
            mine = r.values()
            # a slice of the wrong length would shift every later rider's values
            assert len(mine) == r.slots, (type(r).__name__, len(mine), r.slots)
            out += mine
        return out

    def arrived_votes(self, step: int, values: list[int]) -> None:
        at = 0
        for r in self._riders:
            r.arrived_votes(step, values[at:at + r.slots])
            at += r.slots


class Channel(Protocol):
    """Element-wise MAX of a few small integers over all ranks (node/dist.Control)."""

    def agree(self, values: list[int]) -> list[int]: ...

    def start_agree(self, values: list[int]) -> Pending: ...


@dataclass(frozen=True)
class Decision:
    """What every rank does after optimizer step `step` (the number of steps done)."""

    step: int
    stop: int = 0  # a stop code of node/preemption (0: go on)
    save: bool = False  # a checkpoint is due here (a stop always writes one)
    busy: bool = False  # some rank's background write is still running: do not commit it yet
    last: bool = False  # `step` is the end of the run: the final save follows, no vote was read


class StepDecider:
    """Owns the per-step vote. Call after_step(step) after each step, saved(seconds) after a
    checkpoint it asked for, and close() once at the end (every rank reads the last vote, so
    the channel's collectives stay in step)."""

    def __init__(self, channel: Channel, *, stop: StopFlag, schedule: SaveSchedule,
                 deadline: DeadlineWatch, busy: Callable[[], bool], total: int, lag: int,
                 clock: Callable[[], float] = time.monotonic, rider: Rider | None = None) -> None:
        self._channel, self._stop, self._schedule, self._deadline = channel, stop, schedule, deadline
        self._rider = rider
        self._busy, self.total, self.lag, self._clock = busy, total, lag, clock
        self._deadline.lag_steps = lag
        self._pending: Pending | None = None
        self._step_started = clock()
        self.vote_s = 0.0  # time spent in the vote: what the overlap saves

    def after_step(self, step: int) -> Decision:
        """The decision after `step` steps. With lag 1 it reads the vote started after the
        previous step and starts the next one (whose save answer is for `step` + 1)."""
        now = self._clock()
        self._deadline.observe_step(now - self._step_started)
        if step >= self.total:
            return Decision(step, last=True)  # finishing costs no more than stopping would
        t0 = time.perf_counter()
        if not self.lag:
            (stop, save, busy), rides = self._split(self._channel.agree(self.my_vote(step)))
            ridden = step
        elif self._pending is None:
            # nothing in flight after an attempt's first step: only the schedule's step answer,
            # which every rank gives alike (a minute answer would need the vote)
            (stop, save, busy), rides = (0, int(self._schedule.due_by_steps(step)), 1), []
        else:
            (stop, save, busy), rides = self._split(self._pending.result())
            ridden = step - 1  # started after the step before: it carries that step's values
        self._pending = None
        self.vote_s += time.perf_counter() - t0
        if rides and self._rider is not None:
            self._rider.arrived_votes(ridden, rides)
        return Decision(step, stop=stop, save=bool(save or stop), busy=bool(busy))

    def saved(self, seconds: float) -> None:
        """A checkpoint the decision asked for was taken (or its write started)."""
        self._deadline.observe_checkpoint(seconds)
        self._schedule.mark_saved()

    def next_step(self, step: int) -> None:
        """The loop goes on to the step after `step`: with lag 1 the vote for it starts now,
        after any save of this step ("busy" must cover a background write started just now)."""
        if self.lag:
            t0 = time.perf_counter()
            self._pending = self._channel.start_agree(self.my_vote(step + 1))
            self.vote_s += time.perf_counter() - t0
        self._step_started = self._clock()

    def close(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def my_vote(self, due_at: int) -> list[int]:
        """This rank's [stop code, checkpoint due at step `due_at`, background write busy], and
        the rider's values after them (several riders: one Riders)."""
        if self._deadline.expired():
            self._stop.request(DEADLINE)
        own = [self._stop.code, int(self._schedule.due(due_at)), int(self._busy())]
        return own + (self._rider.values() if self._rider is not None else [])

    @staticmethod
    def _split(result: list[int]) -> tuple[tuple[int, int, int], list[int]]:
        return (result[0], result[1], result[2]), result[3:]

