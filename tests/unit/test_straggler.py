"""rank/straggler.py in-process: the detector on made-up step times, and the times riding the
stop vote between ranks in threads over test_decide's fake channel (no process, no group).
The real ranks, with slowness injected at a chosen step, are in tests/ranks/test_straggler_ranks.py."""

from __future__ import annotations

import random

import pytest

from ddpjob.node import preemption
from ddpjob.rank.decide import StepDecider
from ddpjob.rank.steptimer import StepTimer
from ddpjob.rank.straggler import Flag, Watch, host_of
from ddpjob.store.schedule import SaveSchedule
from test_decide import FakeChannel, Hub, run_ranks

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
    # tiny steps: 0.8 ms above a 1 ms median is under MIN_EXCESS_S, not a straggler, however sure
    assert feed(Watch(HOSTS, window=20), range(1, 201), lambda r, s: 0.0018 if r == 0 else 0.001) == []
    # a busy moment of the host: rank 1 slow in steps 56-66 makes the median of one window (51-70)
    # slow, not of two in a row; the same slowness for good is named
    burst = lambda r, s: 0.05 if r == 1 and 55 < s <= 66 else 0.01
    assert feed(Watch(HOSTS, window=20), range(1, 201), burst) == []
    assert [f.rank for _, f in feed(Watch(HOSTS, window=20), range(1, 201),
                                    lambda r, s: 0.05 if r == 1 and s > 55 else 0.01)] == [1]
    slow = lambda r, s: 0.05 if r == 3 and (s <= 100 or s > 200) else 0.01  # slow, well, slow again
    flags = feed(Watch(HOSTS, window=20), range(1, 301), slow)
    assert [f.rank for _, f in flags] == [3, 3] and flags[1][0] > 200


def test_a_30_percent_straggler_is_named_within_three_windows_where_the_run_is_steady() -> None:
    rng = random.Random(3)
    busy = lambda r, s: 0.010 * rng.uniform(0.95, 1.05) * (1.3 if r == 3 and s > 100 else 1.0)
    flags = feed(Watch(HOSTS, window=20), range(1, 301), busy)
    assert [(f.rank, f.cause) for _, f in flags] == [(3, "compute")] and flags[0][0] <= 100 + 3 * 20


def test_under_heavy_jitter_a_rank_that_is_not_slower_is_never_named() -> None:
    """Every rank's step jitters by +-60% around 10 ms (a host shared with other work): with no
    rank slower, 2000 steps name nobody. A rank 25% slower under the same jitter is the only one
    ever named (once a window's median difference passes the window's error as well as the share)."""
    rng = random.Random(11)
    assert feed(Watch(HOSTS, window=20), range(1, 2001), lambda r, s: 0.010 * rng.uniform(0.4, 1.6)) == []
    slow = feed(Watch(HOSTS, window=20), range(1, 2001),
                lambda r, s: 0.010 * rng.uniform(0.4, 1.6) * (1.25 if r == 1 else 1.0))
    assert slow and {f.rank for _, f in slow} == {1}, slow


def test_a_rank_that_waits_for_a_core_names_its_host_once_not_the_rank() -> None:
    """Rank 1 shares its cores with other work from step 41: its steps take twice as long, all of
    it spent runnable, waiting for a core (wait). Its host is named once, with its load; no
    rank is a straggler. Its own work did not change."""
    watch = Watch(["n1", "n1", "n2", "n2"], window=20)
    out = []
    for s in range(1, 401):
        wait = [0.010 if r == 1 and s > 40 else 0.0002 for r in range(4)]
        busy = [0.010 + w for w in wait]
        load = [(9.0, 2) if r < 2 else (0.5, 2) for r in range(4)]
        out += [(s, f) for f in watch.observe(s, busy, [0.001] * 4, wait, load)]
    assert [(f.rank, f.host, f.cause) for _, f in out] == [(1, "n1", "host")]
    step, flag = out[0]
    assert 40 < step <= 40 + 3 * 20
    assert flag.describe().startswith("host n1 is oversubscribed (load 9.0 on 2 cores): its ranks wait for a core "
                                      "(rank 1 "), flag.describe()
    assert "no rank is named a straggler" in flag.describe()
    # the same waits on a host that is not over its cores: contended, said the same way once
    quiet = Watch(["n1", "n1", "n2", "n2"], window=20)
    found = [f for s in range(1, 200) for f in quiet.observe(
        s, [0.020 if r == 1 and s > 40 else 0.010 for r in range(4)], [0.001] * 4,
        [0.010 if r == 1 and s > 40 else 0.0 for r in range(4)], [(1.5, 8)] * 4)]
    assert [f.describe().split(":")[0] for f in found] == ["host n1 is contended (load 1.5 on 8 cores)"]


def test_a_rank_sharing_its_core_with_a_hog_names_its_host_though_its_work_grew() -> None:
    """Rank 1 shares its core with a CPU hog from step 31 (the cluster test's hog case, as a
    loaded CI host measured it): it waits 22 ms a step for the core, and its own work grows from
    5.7 to 9.1 ms (cold caches, context switches), past even an oversubscribed host's share. The
    waits are the larger part: its host is named, once, not the rank."""
    watch = Watch(["n1", "n2"], window=20)
    out = []
    for s in range(1, 201):
        hogged = s > 30
        wait = [0.0003, 0.022 if hogged else 0.0003]
        busy = [0.0057 + wait[0], (0.0091 if hogged else 0.0057) + wait[1]]
        out += watch.observe(s, busy, [0.0006] * 2, wait, [(3.0, 2)] * 2)
    assert [(f.rank, f.host, f.cause) for f in out] == [(1, "n2", "host")], [f.describe() for f in out]


def test_a_rank_slow_in_its_own_work_on_a_busy_host_is_still_named() -> None:
    """The host is oversubscribed (every rank waits for a core now and then), and rank 2 also
    spins 15 ms a step from step 31: its own work grew, so it is named, with cause compute."""
    rng = random.Random(5)
    watch = Watch(HOSTS, window=20)
    out = []
    for s in range(1, 201):
        wait = [rng.choice([0.0, 0.0, 0.008]) for _ in range(4)]
        busy = [0.010 + w + (0.015 if r == 2 and s > 30 else 0.0) for r, w in enumerate(wait)]
        out += [f for f in watch.observe(s, busy, [0.0005] * 4, wait, [(9.0, 2)] * 4)]
    assert [(f.rank, f.cause) for f in out] == [(2, "compute")]


def test_two_ranks_taking_turns_for_the_cores_of_a_busy_host_name_nobody() -> None:
    """2 ranks, one host at twice its cores: for stretches of 30 steps one rank or the other
    waits for a core (its busy time doubles, all of it waiting). Thousands of steps, no rank named
    (the host may be, once)."""
    rng = random.Random(2)
    watch = Watch(["n1", "n1"], window=20)
    out, unlucky = [], 0
    for s in range(1, 3001):
        if s % 30 == 0:
            unlucky = rng.randrange(2)
        wait = [rng.uniform(0.004, 0.012) if r == unlucky else rng.uniform(0.0, 0.002) for r in range(2)]
        busy = [0.010 * rng.uniform(0.9, 1.1) + w for w in wait]
        out += watch.observe(s, busy, [0.0005] * 2, wait, [(4.0, 2)] * 2)
    assert [f.cause for f in out] in ([], ["host"]), [f.describe() for f in out]


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
        def observe(self, step, busy_s, data_s, *rest):  # type: ignore[override]
            seen[step] = [round(1e6 * b) for b in busy_s]
            return super().observe(step, busy_s, data_s, *rest)

    def loop(rank: int) -> None:
        tick = Tick()
        watch = Recording(["h0", "h1", "h2"], window=10) if rank == 0 else None
        timer = StepTimer(rank, world, watch, report=flags.append, clock=tick, waited=lambda: 0.0,
                          load=lambda: (1.0, 2))
        decider = StepDecider(FakeChannel(hub), stop=preemption.StopFlag(), schedule=SaveSchedule(0, 0.0),
                              deadline=preemption.DeadlineWatch(None), busy=lambda: False, total=total,
                              lag=lag, rider=timer)
        step = 0
        while step < total:
            timer.step_started()
            tick.now += 0.030 if rank == 1 and step >= 20 else 0.010  # the step itself
            timer.data_s += 0.0002
            timer.step_done(step + 1)
            step += 1
            if decider.after_step(step).last:
                break
            decider.next_step(step)
        decider.close()

    run_ranks(loop, range(world))
    assert seen[5] == [10000, 10000, 10000] and seen[30] == [10000, 30000, 10000]
    # every step but the last (no vote after it) and, overlapped, the one whose vote close() reads
    assert sorted(seen) == list(range(1, total - lag))
    assert seen[20] == [10000, 10000, 10000] and seen[21] == [10000, 30000, 10000]  # step 21: the first slow one
    assert [(f.rank, f.host, f.cause) for f in flags] == [(1, "h1", "compute")]


def test_the_gradient_hook_s_stamp_is_the_busy_time_not_the_whole_step() -> None:
    """The last gradient was accumulated 2 ms into a 10 ms step: the rest was the wait for the
    others, so this rank's busy time is 2 ms; a stamp from an earlier step does not count."""
    tick = Tick()
    timer = StepTimer(1, 2, None, clock=tick, waited=lambda: 0.0, load=lambda: (1.0, 2))
    timer.step_started()
    tick.now += 0.002
    timer.arrived = tick.now
    tick.now += 0.008
    timer.step_done(1)
    # busy, data, wait for a core, host load (100 x load x 10000 + cores): rank 1's slots only
    assert timer.values() == [0, 2000, 0, 0, 0, 0, 0, 100 * 10000 + 2]
    timer.step_started()
    tick.now += 0.010
    timer.step_done(2)  # no bucket this step (no_sync micro-step, no DDP): the whole step
    assert timer.values() == [0, 10000, 0, 0, 0, 0, 0, 100 * 10000 + 2]


def test_the_time_a_rank_waited_for_a_core_rides_beside_its_busy_time() -> None:
    tick, waited = Tick(), Tick()
    timer = StepTimer(0, 2, None, clock=tick, waited=waited, load=lambda: (9.25, 2))
    timer.step_started()
    tick.now += 0.010
    waited.now += 0.004
    timer.step_done(1)
    assert timer.values() == [10000, 0, 0, 0, 4000, 0, 925 * 10000 + 2, 0]


def test_the_wait_for_a_core_counts_up_to_the_rank_s_arrival_not_while_it_waits_for_the_others() -> None:
    """The wait is read where the step's last gradient came in the step before (one read a
    step): a rank kept off its core while DDP waits for the others is not less busy for it."""
    class Param:
        requires_grad = True

        def register_post_accumulate_grad_hook(self, hook):
            self.hook = hook

    class Model:
        params = [Param(), Param()]

        def parameters(self):
            return self.params

    tick, waited = Tick(), Tick()
    timer = StepTimer(1, 2, None, clock=tick, waited=waited, load=lambda: (1.0, 2))
    timer.watch_forward(None, Model())
    first, last = Model.params
    for step in (1, 2):
        timer.step_started()
        timer.pre_forward_began()  # DDP's buffer broadcast: 2 ms, 1 of them off its core after it
        tick.now += 0.002
        waited.now += 0.001
        timer.pre_forward_ended()
        tick.now += 0.004
        waited.now += 0.001  # kept off its core 1 ms while it worked
        first.hook(first), last.hook(last)  # the gradients come in this order
        tick.now += 0.006
        waited.now += 0.005  # and 5 ms more while it waits for the others
        timer.step_done(step)
    # step 1 learns which gradient comes last; from step 2 the wait stops at the arrival; the
    # broadcast and the wait in it are neither work nor a wait while it worked
    assert timer.values()[:2] == [0, 4000] and timer.values()[4:6] == [0, 1000]


def test_on_an_oversubscribed_host_only_a_large_excess_names_a_rank() -> None:
    """Load 9 on 2 cores: a rank whose work is 40% above the others' for good (a worse core,
    a hypervisor's steal) is not named; at 150% it is. On a host within its cores 40% is."""
    def run(share: float, load: tuple[float, int]) -> list[int]:
        watch = Watch(HOSTS, window=20)
        return [f.rank for s in range(1, 201) for f in watch.observe(
            s, [0.010 * (1 + share) if r == 3 else 0.010 for r in range(4)], [0.0] * 4, [0.0] * 4, [load] * 4)]

    assert run(0.4, (9.0, 2)) == [] and run(1.5, (9.0, 2)) == [3] and run(0.4, (1.0, 2)) == [3]

