"""rank/decide.py in-process: the per-step stop/save decision of several ranks, each in a thread
of its own, over a fake channel (element-wise MAX, like node/dist.Control) and a fake clock.
Nothing here starts a process or a process group."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any
from dataclasses import dataclass, field

import pytest

from ddpjob.node import preemption
from ddpjob.rank.decide import Decision, StepDecider
from ddpjob.store.schedule import SaveSchedule


def run_ranks(loop: Callable[[Any], None], ranks: Iterable[Any]) -> None:
    """`loop(rank)` for each rank in a thread of its own, as processes would; none may hang."""
    threads = [threading.Thread(target=loop, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank hung"


class Hub:
    """What a process group does for the vote: every rank's values in, their MAX out, in
    rounds. Counts the votes started and read, so a test sees one left unread."""

    def __init__(self, world: int) -> None:
        self.world, self._lock = world, threading.Condition()
        self._rounds: dict[tuple[str, int], list[list[int]]] = {}
        self.started = self.read = 0

    def _put(self, kind: str, rnd: int, values: list[int]) -> None:
        with self._lock:
            self._rounds.setdefault((kind, rnd), []).append(values)
            self._lock.notify_all()

    def _max(self, kind: str, rnd: int) -> list[int]:
        with self._lock:
            ok = self._lock.wait_for(lambda: len(self._rounds.get((kind, rnd), [])) == self.world, timeout=10)
            assert ok, f"{kind} round {rnd}: not every rank voted"
            return [max(col) for col in zip(*self._rounds[(kind, rnd)])]


@dataclass
class FakeChannel:
    hub: Hub
    rounds: dict[str, int] = field(default_factory=lambda: {"agree": 0, "start": 0})

    def agree(self, values: list[int]) -> list[int]:
        rnd = self.rounds["agree"] = self.rounds["agree"] + 1
        self.hub._put("agree", rnd, values)
        return self.hub._max("agree", rnd)

    def start_agree(self, values: list[int]) -> "FakeVote":
        rnd = self.rounds["start"] = self.rounds["start"] + 1
        self.hub._put("start", rnd, values)
        with self.hub._lock:
            self.hub.started += 1
        return FakeVote(self.hub, rnd)


@dataclass
class FakeVote:
    hub: Hub
    rnd: int

    def result(self) -> list[int]:
        with self.hub._lock:
            self.hub.read += 1
        return self.hub._max("start", self.rnd)


class Clock:
    """Seconds that move only when a step says so (one per rank: each rank has its own clock)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Rank:
    """One rank's side: its stop flag, clock, background write and what it decided."""

    rank: int
    stop: preemption.StopFlag = field(default_factory=preemption.StopFlag)
    clock: Clock = field(default_factory=Clock)
    writing: bool = False
    decisions: list[Decision] = field(default_factory=list)


def run(world: int, total: int, *, lag: int, every_steps: int = 0, step_s: float = 1.0,
        end_in_s: float | None = None, during: dict[tuple[int, int], str] | None = None) -> tuple[list[Rank], Hub]:
    """`world` ranks in threads, each running `total` steps as Job.steps() does. `during` maps
    (rank, step) to what happens while that step computes: "signal" (SIGUSR2's flag), "write"
    (a background write starts) or "written" (it ends)."""
    hub, ranks = Hub(world), [Rank(r) for r in range(world)]
    during = during or {}

    def loop(me: Rank) -> None:
        deadline = preemption.DeadlineWatch(None if end_in_s is None else me.clock.now + end_in_s,
                                            clock=me.clock)
        decider = StepDecider(FakeChannel(hub), stop=me.stop, schedule=SaveSchedule(every_steps, 0.0),
                              deadline=deadline, busy=lambda: me.writing, total=total, lag=lag, clock=me.clock)
        step = 0
        while step < total:
            happens = during.get((me.rank, step + 1))  # while step `step + 1` computes
            if happens == "signal":
                me.stop.code = preemption.PREEMPTED
            me.writing = {"write": True, "written": False}.get(happens or "", me.writing)
            me.clock.now += step_s
            step += 1
            now = decider.after_step(step)
            me.decisions.append(now)
            if now.last or now.stop:
                break
            if now.save:
                decider.saved(0.5)
            decider.next_step(step)
        decider.close()

    run_ranks(loop, ranks)
    return ranks, hub


def _stops(ranks: list[Rank]) -> list[tuple[int, int]]:
    return [next(((d.step, d.stop) for d in r.decisions if d.stop), (0, 0)) for r in ranks]


@pytest.mark.parametrize("lag, stops_at", [(1, 6), (0, 5)])
def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(lag: int, stops_at: int) -> None:
    """Overlapped (lag 1): the vote carrying the flag set during step 5 is read after step 6;
    read at once (lag 0): after step 5. Either way every rank stops there, checkpoint included."""
    ranks, hub = run(3, 20, lag=lag, during={(1, 5): "signal"})
    assert _stops(ranks) == [(stops_at, preemption.PREEMPTED)] * 3
    assert all(r.decisions[-1].save for r in ranks)  # a stop always writes its checkpoint
    assert hub.started == hub.read  # no vote left in flight


@pytest.mark.parametrize("lag", [1, 0])
def test_a_save_is_due_on_every_rank_at_the_schedules_steps(lag: int) -> None:
    ranks, hub = run(2, 10, lag=lag, every_steps=3)
    for r in ranks:
        assert [d.step for d in r.decisions if d.save] == [3, 6, 9]
        assert [d.step for d in r.decisions] == list(range(1, 11)) and r.decisions[-1].last
    assert hub.started == hub.read


def test_a_write_still_busy_on_one_rank_holds_every_ranks_commit() -> None:
    """The busy bit is the barrier before a commit: while rank 1 still writes, nobody commits."""
    ranks, _ = run(2, 8, lag=1, during={(1, 2): "write", (1, 5): "written"})
    for r in ranks:
        busy = [d.step for d in r.decisions if d.busy]
        # the first decision needs no vote and counts as busy; the write is seen from the vote
        # started after step 2 (read after step 3) until the one started after step 4
        assert busy == [1, 3, 4, 5], busy


def test_the_deadline_stops_every_rank_with_room_for_the_last_step_and_the_checkpoint() -> None:
    """No signal, only the end time: each step takes 10 s, the job ends 200 s after the start.
    The watch needs ((1 + lag) x step + checkpoint) x 1.5 + 30 s = 75 s (checkpoint guess 10 s):
    the vote started after step 13 (70 s left) carries the stop, read after step 14."""
    ranks, _ = run(2, 100, lag=1, step_s=10.0, end_in_s=200.0)
    assert _stops(ranks) == [(14, preemption.DEADLINE)] * 2
    for r in ranks:
        assert r.decisions[-1].save
        assert 1000.0 + 200.0 - r.clock.now >= 30.0  # the margin is still there when it stops


def test_a_stop_during_the_last_step_ends_the_run_as_finished() -> None:
    """The last step needs no vote: the run ends with its final save, not a stop for a requeue;
    the vote still in flight is read by every rank (close())."""
    ranks, hub = run(2, 6, lag=1, during={(0, 6): "signal", (1, 5): "signal"})
    for r in ranks:
        assert r.decisions[-1] == Decision(6, last=True)
        assert not any(d.stop for d in r.decisions)
    assert hub.started == hub.read == 2 * 5


class FakeSnaps:
    """memsnap.Snapshots as snapvote.IntervalVote sees it: `every` (None: "auto", measuring)
    and rank 0's verdict(), ready once the loop has asked about step `ready` (the probe's write
    done); it never waits."""

    def __init__(self, ready: int | None, every: int | None = None) -> None:
        self.every, self.ready, self.last = every, ready, 0

    def observe(self, step: int) -> None:  # what StateStore.snapshot_due does each step
        self.last = step

    def verdict(self) -> tuple[int, str] | None:
        ready = self.ready is not None and self.last >= self.ready
        return (7, "in-memory snapshots every 7 steps") if ready else None


@dataclass
class TimesRider:
    """A straggler-watch-like rider: `world` slots, this rank's own one filled."""

    rank: int
    world: int
    heard: list[tuple[int, list[int]]] = field(default_factory=list)

    @property
    def slots(self) -> int:
        return self.world

    def values(self) -> list[int]:
        return [self.rank + 1 if i == self.rank else 0 for i in range(self.world)]

    def arrived_votes(self, step: int, values: list[int]) -> None:
        self.heard.append((step, list(values)))


@pytest.mark.parametrize("lag", [0, 1])
def test_the_auto_snapshot_interval_rides_the_vote_and_is_set_at_the_same_step_on_every_rank(lag: int) -> None:
    """Rank 0's verdict, ready after step 5, travels in one slot after the step times' slice;
    every rank sets the interval at step 6 (lag 0: the vote of step 6 is read at once; lag 1:
    the one started after step 5 is read after step 6), and only rank 0 says its line."""
    from ddpjob.rank.decide import Riders
    from ddpjob.rank.snapvote import IntervalVote

    world, total = 3, 12
    hub = Hub(world)
    set_at: dict[int, int | None] = {}
    said: dict[int, list[str]] = {r: [] for r in range(world)}
    times = [TimesRider(r, world) for r in range(world)]
    snaps = [FakeSnaps(ready=5 if r == 0 else None) for r in range(world)]

    def loop(rank: int) -> None:
        vote = IntervalVote(snaps[rank], lead=rank == 0, say=said[rank].append)  # type: ignore[arg-type]
        decider = StepDecider(FakeChannel(hub), stop=preemption.StopFlag(), schedule=SaveSchedule(0, 0.0),
                              deadline=preemption.DeadlineWatch(None), busy=lambda: False, total=total,
                              lag=lag, rider=Riders(times[rank], vote))
        step, set_at[rank] = 0, None
        while step < total:
            step += 1
            if decider.after_step(step).last:
                break
            if snaps[rank].every is not None and set_at[rank] is None:
                set_at[rank] = step
            snaps[rank].observe(step)
            decider.next_step(step)
        decider.close()

    run_ranks(loop, range(world))
    assert set_at == {0: 6, 1: 6, 2: 6} and all(s.every == 7 for s in snaps)
    assert said == {0: ["in-memory snapshots every 7 steps"], 1: [], 2: []}
    for rider in times:  # the step times' slice is what it would be alone
        assert rider.heard and all(v == [1, 2, 3] for _, v in rider.heard), rider.heard
    assert hub.started == hub.read


def test_snapshots_off_or_fixed_add_no_slot_to_the_vote() -> None:
    """snapshot_every = 0 (no Snapshots) or N: no rider, the vote is [stop, save, busy] plus
    the step times as before; once "auto" is decided its slot stays 0."""
    from ddpjob.rank.decide import Riders
    from ddpjob.rank.snapvote import IntervalVote, for_snapshots

    assert for_snapshots(None, 0) is None
    assert for_snapshots(FakeSnaps(None, every=5), 0) is None  # type: ignore[arg-type]
    assert Riders(TimesRider(0, 2), None).values() == [1, 0]
    assert Riders(TimesRider(0, 0), None).slots == 0 and Riders().values() == []
    decider = StepDecider(FakeChannel(Hub(1)), stop=preemption.StopFlag(), schedule=SaveSchedule(0, 0.0),
                          deadline=preemption.DeadlineWatch(None), busy=lambda: False, total=5, lag=0,
                          rider=Riders(None))
    assert decider.my_vote(1) == [0, 0, 0]
    decided = FakeSnaps(ready=0)
    vote = IntervalVote(decided, lead=True, say=lambda line: None)  # type: ignore[arg-type]
    assert vote.values() == [8]  # interval 7, + 1
    vote.arrived_votes(1, [8])
    assert decided.every == 7 and vote.values() == [0]


def test_rank_0s_verdict_of_no_snapshots_travels_as_1_and_turns_them_off() -> None:
    """Interval 0 (the probe could not be taken) is said as 1, so that 0 still means "not yet"."""
    from ddpjob.rank.snapvote import IntervalVote

    off = FakeSnaps(ready=None)
    off.verdict = lambda: (0, "in-memory snapshots off: the probe snapshot could not be taken")  # type: ignore[method-assign]
    said: list[str] = []
    vote = IntervalVote(off, lead=True, say=said.append)  # type: ignore[arg-type]
    assert vote.values() == [1]
    IntervalVote(off, lead=False, say=said.append).arrived_votes(3, [0])  # type: ignore[arg-type]
    assert off.every is None  # 0: nothing decided yet
    vote.arrived_votes(3, [1])
    assert off.every == 0 and said == ["in-memory snapshots off: the probe snapshot could not be taken"]
