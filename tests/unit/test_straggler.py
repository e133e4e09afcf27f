"""rank/straggler.py in-process: the detector on made-up step times, and the times riding the
stop vote between ranks in threads over test_decide's fake channel (no process, no group).
The real ranks, with slowness injected at a chosen step, are in tests/ranks/test_straggler_ranks.py."""

from __future__ import annotations

import random
import threading

import pytest

from ddpjob.node import preemption
from ddpjob.rank.decide import StepDecider
from ddpjob.rank.straggler import Flag, StepTimer, Watch, host_of
from ddpjob.store.schedule import SaveSchedule
from test_decide import FakeChannel, Hub

HOSTS = ["n1", "n1", "n2", "n2"]


def feed(watch: Watch, steps: range, busy, data=lambda r, s: 0.0) -> list[tuple[int, Flag]]:
    out = []
    for s in steps:
        for flag in watch.observe(s, [busy(r, s) for r in range(4)], [data(r, s) for r in range(4)]):
            out.append((s, flag))
    return out


def test_a_rank_slow_in_its_own_compute_is_named_with_its_host_within_a_window() -> None:
    flags = feed(Watch(HOSTS, window=20), range(1, 201), lambda r, s: 0.030 if r == 2 and s > 60 else 0.010)
    assert len(flags) == 1
    step, flag = flags[0]
    assert 60 + 10 < step <= 60 + 20 + 10 and (flag.rank, flag.host, flag.cause) == (2, "n2", "compute")
    # named as soon as the window's median moved: the window still held some fast steps
    assert 0.015 < flag.busy_s <= 0.030 and flag.median_s == pytest.approx(0.010)
    assert flag.describe().startswith(f"rank 2 on n2 is a straggler: {1000 * flag.busy_s:.1f} ms of work per "
                                      "step against a median of 10.0 ms over steps ")


def test_a_rank_waiting_for_its_data_is_named_with_that_cause() -> None:
    flags = feed(Watch(HOSTS, window=20), range(1, 101), lambda r, s: 0.035 if r == 1 and s > 10 else 0.010,
                 lambda r, s: 0.025 if r == 1 and s > 10 else 0.001)
    assert [(f.rank, f.host, f.cause) for _, f in flags] == [(1, "n1", "data")]


def test_noise_raises_no_flag_and_a_recovered_rank_is_named_again_only_after_a_clean_window() -> None:
    rng = random.Random(7)
    # every rank's step jitters by +-30%; no rank is slow: 1000 steps, not one flag
    assert feed(Watch(HOSTS, window=20), range(1, 1001), lambda r, s: 0.010 * rng.uniform(0.7, 1.3)) == []
    # tiny steps: 1.5 ms above a 1 ms median is under MIN_EXCESS_S, not a straggler
    assert feed(Watch(HOSTS, window=20), range(1, 201), lambda r, s: 0.0025 if r == 0 else 0.001) == []
    # a busy moment of the host: rank 1 slow in steps 56-66 makes the median of one window (51-70)
    # slow, not of two in a row; the same slowness for good is named
    burst = lambda r, s: 0.05 if r == 1 and 55 < s <= 66 else 0.01
    assert feed(Watch(HOSTS, window=20), range(1, 201), burst) == []
    assert [f.rank for _, f in feed(Watch(HOSTS, window=20), range(1, 201),
                                    lambda r, s: 0.05 if r == 1 and s > 55 else 0.01)] == [1]
    slow = lambda r, s: 0.05 if r == 3 and (s <= 100 or s > 200) else 0.01  # slow, well, slow again
    flags = feed(Watch(HOSTS, window=20), range(1, 301), slow)
    assert [f.rank for _, f in flags] == [3, 3] and flags[1][0] > 200


def test_hosts_follow_slurm_s_block_distribution() -> None:
    assert [host_of(r, ["n1", "n2"], 2, "me") for r in range(4)] == ["n1", "n1", "n2", "n2"]
    assert host_of(5, [], 2, "me") == "me"  # the local backend: one host


class Tick:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("lag", [0, 1])
def test_each_rank_s_times_ride_the_vote_and_reach_rank_0_with_their_step(lag: int) -> None:
    """3 ranks in threads, as Job.steps() drives them: rank 1's steps take 3x longer from step
    21 on. Rank 0's watch gets every rank's busy time of each step (the vote read after step s
    carries step s with lag 0, step s - 1 with lag 1), and names rank 1 and nobody else."""
    hub, world, total = Hub(3), 3, 80
    seen: dict[int, list[int]] = {}
    flags: list[Flag] = []

    class Recording(Watch):
        def observe(self, step, busy_s, data_s):  # type: ignore[override]
            seen[step] = [round(1e6 * b) for b in busy_s]
            return super().observe(step, busy_s, data_s)

    def loop(rank: int) -> None:
        tick = Tick()
        watch = Recording(["h0", "h1", "h2"], window=10) if rank == 0 else None
        timer = StepTimer(rank, world, watch, report=flags.append, clock=tick)
        decider = StepDecider(FakeChannel(hub), stop=preemption.StopFlag(), schedule=SaveSchedule(0, 0.0),
                              deadline=preemption.DeadlineWatch(None), busy=lambda: False, total=total,
                              lag=lag, rider=timer)
        step = 0
        while step < total:
            timer.step_started()
            tick.now += 0.030 if rank == 1 and step >= 20 else 0.010  # the step itself
            timer.data_s += 0.0002
            timer.step_done()
            step += 1
            if decider.after_step(step).last:
                break
            decider.next_step(step)
        decider.close()

    threads = [threading.Thread(target=loop, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert seen[5] == [10000, 10000, 10000] and seen[30] == [10000, 30000, 10000]
    # every step but the last (no vote after it) and, overlapped, the one whose vote close() reads
    assert sorted(seen) == list(range(1, total - lag))
    assert seen[20] == [10000, 10000, 10000] and seen[21] == [10000, 30000, 10000]  # step 21: the first slow one
    assert [(f.rank, f.host, f.cause) for f in flags] == [(1, "h1", "compute")]


def test_the_gradient_hook_s_stamp_is_the_busy_time_not_the_whole_step() -> None:
    """The last gradient was accumulated 2 ms into a 10 ms step: the rest was the wait for the
    others, so this rank's busy time is 2 ms; a stamp from an earlier step does not count."""
    tick = Tick()
    timer = StepTimer(1, 2, None, clock=tick)
    timer.step_started()
    tick.now += 0.002
    timer.arrived = tick.now
    tick.now += 0.008
    timer.step_done()
    assert timer.values() == [0, 2000, 0, 0]
    timer.step_started()
    tick.now += 0.010
    timer.step_done()  # no bucket this step (no_sync micro-step, no DDP): the whole step
    assert timer.values() == [0, 10000, 0, 0]
