"""Each rank's step times, and rank 0's two watches over them: the straggler watch (one rank
slower than the others, rank/straggler.py) and the slowdown watch (the whole job slower than
its own baseline, rank/slowdown.py). Job.steps() drives the StepTimer; its values ride the stop
vote (decide.Rider), so no collective is added.

Per step each rank measures: its busy time (from the start of its step to its last gradient's
accumulation, stamped by a hook on each parameter, less DDP's pre-forward, a wait for rank 0's
buffers: node/ddpwrap.py), its data wait (`job.timed`), the time its thread waited, runnable,
for a core (the kernel's run_delay in /proc/thread-self/schedstat: two reads of an open file a
step, about 2 us) and its host's load. They ride as SLOTS x world_size int64s (each rank fills
its own slots, the vote is an element-wise MAX). Where no gradient hook ran in a step (one
process, FSDP, a model not wrapped by `job.wrap`), the busy time is the whole step.

Nothing here is registered on the user's module in a way that pickles: parameter hooks are not
part of a tensor's pickled or copied state, and the pre-forward is timed by the DDP subclass
with the listener held outside the module (torch.save(model) and copy.deepcopy(model) work).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from ddpjob.rank.slowdown import Baseline, SlowdownWatch
from ddpjob.rank.straggler import Flag, Watch, host_of

SLOTS = 4  # per rank: busy, data wait, wait for a core (microseconds), host load (packed)
_CORES = 10_000  # the load slot holds round(100 x load average) x _CORES + cores


class RunqueueClock:
    """Seconds this thread has waited, runnable, for a core (schedstat's run_delay); 0.0 where
    the kernel does not say (no CONFIG_SCHED_INFO, not Linux)."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def __call__(self) -> float:
        if self._fd is None:
            return 0.0
        try:
            return int(os.pread(self._fd, 64, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0


def host_load() -> tuple[float, int]:
    """This host's 1-minute load average and its cores (0.0 where unknown)."""
    try:
        return os.getloadavg()[0], os.cpu_count() or 1
    except OSError:
        return 0.0, os.cpu_count() or 1


class StepTimer:
    """One rank's side: measures its steps and rides the vote when `ride` (several ranks and the
    straggler watch on). Rank 0 holds the watches (`watch`, `slowdown`: None elsewhere) and
    hands what they find to `report`."""

    def __init__(self, rank: int, world_size: int, watch: Watch | None, report: Callable[[Any], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter, *, ride: bool | None = None,
                 slowdown: SlowdownWatch | None = None, waited: Callable[[], float] | None = None,
                 load: Callable[[], tuple[float, int]] = host_load) -> None:
        self.rank, self.world_size, self._watch, self._report, self._clock = rank, world_size, watch, report, clock
        self.ride = world_size > 1 if ride is None else ride
        self._slowdown = slowdown
        self._waited = waited if waited is not None else (RunqueueClock() if self.ride else (lambda: 0.0))
        self._load = load
        self.arrived = 0.0  # the gradient hook's stamp: when this rank's backward was done
        self._arrived_waited = -1.0  # the wait for a core then (-1: not read this step)
        self._last_param: Any = None  # the parameter whose gradient came last in the last step
        self._latest: Any = None  # the one whose gradient came last so far in this step
        self.data_s = 0.0  # this step's data wait so far (job.timed)
        self._blocked = 0.0  # this step's time in DDP's pre-forward (its buffer broadcast from rank 0)
        self._blocked_waited = 0.0  # and the waits for a core in it
        self._pre = (0.0, 0.0)
        self._started = self._waited0 = 0.0
        self._last = (0, 0, 0, 0)  # the last step's slots
        self._step_s: dict[int, float] = {}  # rank 0: its own step times, until the vote brings the step
        self._done = 0  # steps done in this attempt

    def watch_forward(self, ddp: Any, model: Any) -> None:
        """Time DDP's pre-forward (node/ddpwrap.py: no hook on any module), and put a hook on each
        parameter's gradient accumulation: the last one of a step stamps `arrived`, this rank's
        backward done, before DDP waits for the others' buckets. No comm hook: the user may
        register their own after job.wrap."""
        if not self.ride:
            return
        from ddpjob.node import ddpwrap

        ddpwrap.listen(ddp, self)
        clock, waited = self._clock, self._waited

        def stamp(p: Any) -> None:
            self.arrived = clock()
            # the wait for a core up to here, not later while DDP waits for the others: read at
            # the parameter whose gradient came last in the last step (one read a step, not one
            # per parameter; the order of the gradients barely changes between steps)
            if p is self._last_param:
                self._arrived_waited = waited()
            self._latest = p

        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(stamp)

    def pre_forward_began(self) -> None:
        """DDP's pre-forward (node/ddpwrap.py): from here to its end, a wait for rank 0's
        buffers, not this rank's work; nor are its waits for a core (after the broadcast woke
        it) part of its waits while it worked."""
        self._pre = (self._clock(), self._waited())

    def pre_forward_ended(self) -> None:
        began, waited = self._pre
        self._blocked += self._clock() - began
        self._blocked_waited += self._waited() - waited

    def fetched(self, _started: float, seconds: float) -> None:
        """job.timed: a batch took `seconds` to come."""
        self.data_s += seconds

    def step_started(self) -> None:
        self._started, self.data_s, self._blocked, self._waited0 = self._clock(), 0.0, 0.0, self._waited()
        self._blocked_waited = 0.0
        self._arrived_waited = -1.0

    def step_done(self, step: int = 0) -> None:
        """Step `step` (1-based: the steps done) ended on this rank."""
        now = self._clock()
        stamped = self._started < self.arrived <= now
        end = self.arrived if stamped else now
        busy = max(0.0, end - self._started - self._blocked)
        until = self._arrived_waited if stamped and self._arrived_waited >= 0 else self._waited()
        waited = min(busy, max(0.0, until - self._waited0 - self._blocked_waited))
        self._last_param = self._latest
        load, cores = self._load() if self.ride else (0.0, 0)
        self._last = (round(1e6 * busy), round(1e6 * min(self.data_s, busy)), round(1e6 * waited),
                      round(100 * load) * _CORES + min(cores, _CORES - 1))
        self._done += 1
        if self._slowdown is None:
            return
        if self.ride:  # the others' values come with the vote: keep this step's time until then
            self._step_s[step] = now - self._started
            for old in [s for s in self._step_s if s < step - 4]:
                del self._step_s[old]
        else:  # one rank, or the straggler watch off: rank 0's own values alone
            self._observe_speed(step, now - self._started, [busy], [min(self.data_s, busy)])

    @property
    def slots(self) -> int:
        """How many values this rider adds to the vote (decide.Rider): none when nothing rides."""
        return SLOTS * self.world_size if self.ride else 0

    def values(self) -> list[int]:
        """This rank's slots of the vote: busy, data, wait, load, each world_size wide, the
        others 0."""
        if not self.ride:  # nothing rides
            return []
        w = self.world_size
        out = [0] * (SLOTS * w)
        for i, v in enumerate(self._last):
            out[i * w + self.rank] = v
        return out

    def arrived_votes(self, step: int, values: Sequence[int]) -> None:
        """Every rank's values of step `step`, as the vote brought them."""
        w = self.world_size
        if not self.ride or len(values) != SLOTS * w:
            return
        busy, data, wait = ([v / 1e6 for v in values[i * w:(i + 1) * w]] for i in range(3))
        if self._watch is not None:
            loads = [(v // _CORES / 100, v % _CORES) if v else None for v in values[3 * w:]]
            for flag in self._watch.observe(step, busy, data, wait, loads):
                self._tell(flag)
        if self._slowdown is not None and step in self._step_s:
            self._observe_speed(step, self._step_s.pop(step), busy, data)

    def _observe_speed(self, step: int, step_s: float, busy: list[float], data: list[float]) -> None:
        assert self._slowdown is not None
        for found in self._slowdown.observe(step, step_s, busy, data):
            self._tell(found)

    def _tell(self, found: Any) -> None:
        if self._report is not None:
            self._report(found)


def for_job(job: Any) -> StepTimer:
    """A Job's timer (rank/job.py). The vote carries the times when train.straggler_window > 0
    and there are several ranks; rank 0 watches for stragglers then, and for a slowdown of the
    whole job when train.slowdown_window > 0 (on its own times alone where nothing rides); it
    says and records what they find."""
    from ddpjob import console
    from ddpjob.ledger import events

    t, env = job.config.train, job.env
    ride = t.straggler_window > 0 and job.world_size > 1
    watch, slowdown = None, None
    if job.is_rank0 and ride:
        hosts = [host_of(r, env.hosts, env.local_world_size, env.hostname) for r in range(job.world_size)]
        watch = Watch(hosts, window=t.straggler_window, threshold=t.straggler_threshold)
    if job.is_rank0 and t.slowdown_window > 0:
        # a resumed run is compared with its own speed before the stop (the newest baseline)
        base = Baseline.from_events(events.read(job.run_dir), job.world_size)
        slowdown = SlowdownWatch(window=t.slowdown_window, threshold=t.slowdown_threshold, baseline=base,
                                 world_size=job.world_size)
    ids = {"job_id": job.job_id, "restart": job.restart}

    def report(found: Any) -> None:
        if isinstance(found, Flag):
            console.warn(found.describe())
            if job.config.slurm.on_straggler != "off":  # act on it ([slurm] on_straggler)
                from ddpjob.rank import stragglerstop

                stragglerstop.consider(job.config, env, job.run_dir, found, job._stop)
            extra = ({"wait_ms": round(1000 * found.wait_s, 3)} if found.cause != "host" else
                     {"wait_ms": round(1000 * found.wait_s, 3), "load": found.load, "cores": found.cores})
            events.record(job.run_dir, "straggler", rank=found.rank, host=found.host, cause=found.cause,
                          busy_ms=round(1000 * found.busy_s, 3), median_ms=round(1000 * found.median_s, 3),
                          data_ms=round(1000 * found.data_s, 3), step=found.last, first_step=found.first,
                          line=found.describe(), **extra, **ids)
        elif isinstance(found, Baseline):
            events.record(job.run_dir, "baseline", **found.fields(), **ids)
        else:  # a Slowdown or its end
            console.warn(found.describe())
            events.record(job.run_dir, "slowdown", **found.fields(), **ids)

    return StepTimer(job.rank, job.world_size, watch, report=report, ride=ride, slowdown=slowdown)
