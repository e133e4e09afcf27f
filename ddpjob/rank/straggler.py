"""Who is slow: each rank's busy time per step travels with the stop vote (rank/decide.py), and
rank 0 names a rank that stays slower than the others.

Under DDP the gradient all-reduce makes every rank's step take as long as the slowest one's, so
per-rank step times show nothing. What differs is when a rank *arrives* at that all-reduce: the
time from the start of its step to the moment its last gradient is accumulated (a hook on each
parameter stamps it; DDP then waits for the others' buckets), which is the rank's own work, data wait
included, and not the time it then waits for the others. The one collective before it, DDP's
broadcast of rank 0's buffers at the start of each forward, is taken out (pre-hooks on DDP and
on the model it wraps time it). The data wait is what the loop's
batches took to come (`job.timed(batches)`; the built-in trainer uses it). Where no bucket hook
ran in a step (one process, FSDP, a model not wrapped by `job.wrap`), the busy time is the
whole step: equal on every rank, so nothing is ever flagged there.

The values ride the vote as two slots per rank (the vote is an element-wise MAX and each rank
fills only its own slots), so no collective is added: 2 x world_size int64s more per vote.

A rank is flagged when, over a window of steps, the median of its busy time exceeds the median
over the other ranks by more than `threshold` of it (and by at least MIN_EXCESS_S), at CONFIRM
looks in a row, half a window apart: one line naming
the rank, its host and the cause (data when its extra data wait is at least half its excess,
else compute), and a `straggler` event. A flagged rank is named again only after a window in
which it was not slow.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

MIN_EXCESS_S = 0.002  # a rank 1 ms slower in a 1 ms step is noise, not a straggler
CONFIRM = 2  # looks in a row (every half window) that must find a rank slow before it is named


@dataclass(frozen=True)
class Flag:
    """A straggler: `rank` on `host`, `busy_s` per step (median over steps first..last) against
    the ranks' median `median_s`; `cause` "data" or "compute"."""

    rank: int
    host: str
    cause: str
    busy_s: float
    median_s: float
    data_s: float
    first: int
    last: int

    def describe(self) -> str:
        what = "its data loading" if self.cause == "data" else "its own compute (not the data, not the all-reduce)"
        return (f"rank {self.rank} on {self.host} is a straggler: {1000 * self.busy_s:.1f} ms of work per step "
                f"against a median of {1000 * self.median_s:.1f} ms over steps {self.first}-{self.last}; "
                f"the cause is {what} ({1000 * self.data_s:.1f} ms of data wait per step)")


class Watch:
    """Rank 0's detector over the per-step busy/data times of every rank (pure, no torch)."""

    def __init__(self, hosts: Sequence[str], *, window: int = 20, threshold: float = 0.5) -> None:
        self.hosts, self.window, self.threshold = list(hosts), max(2, int(window)), float(threshold)
        self._steps: deque[tuple[int, list[float], list[float]]] = deque(maxlen=self.window)
        self._flagged: set[int] = set()
        self._suspect: dict[int, int] = {}  # rank -> looks in a row that found it slow

    def observe(self, step: int, busy_s: Sequence[float], data_s: Sequence[float]) -> list[Flag]:
        """Add one step's times (every rank's); the ranks newly found slow over the last window."""
        self._steps.append((step, list(busy_s), list(data_s)))
        if len(self._steps) < self.window or step % max(1, self.window // 2):
            return []  # a full window, looked at every half window: medians are not free
        n = len(self.hosts)
        busy = [statistics.median(s[1][r] for s in self._steps) for r in range(n)]
        data = [statistics.median(s[2][r] for s in self._steps) for r in range(n)]
        out = []
        for r in range(n):
            # against the others' median: with 2 ranks the median of all would hold the slow one
            mid = statistics.median(busy[:r] + busy[r + 1:])
            mid_data = statistics.median(data[:r] + data[r + 1:])
            slow = busy[r] - mid > max(self.threshold * mid, MIN_EXCESS_S)
            # slow at CONFIRM looks in a row (half a window apart): a busy moment of a shared
            # host, which slows whoever runs then, is not a straggler
            self._suspect[r] = self._suspect.get(r, 0) + 1 if slow else 0
            if slow and self._suspect[r] >= CONFIRM and r not in self._flagged:
                cause = "data" if data[r] - mid_data >= 0.5 * (busy[r] - mid) else "compute"
                out.append(Flag(r, self.hosts[r], cause, busy[r], mid, data[r], self._steps[0][0], step))
                self._flagged.add(r)
            elif not slow:
                self._flagged.discard(r)
        return out


class StepTimer:
    """One rank's side: measures its steps and rides the vote (decide.Rider). `report` gets
    the flags (rank 0 logs and records them); None on the other ranks."""

    def __init__(self, rank: int, world_size: int, watch: Watch | None,
                 report: Callable[[Flag], None] | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.rank, self.world_size, self._watch, self._report, self._clock = rank, world_size, watch, report, clock
        self.arrived = 0.0  # the comm hook's stamp: when this rank handed DDP its last bucket
        self.data_s = 0.0  # this step's data wait so far (job.timed)
        self._blocked = 0.0  # this step's wait in DDP's forward (its buffer broadcast from rank 0)
        self._forward_called = 0.0
        self._started = 0.0
        self._last = (0, 0)  # (busy, data) of the last step, in microseconds

    def watch_forward(self, ddp: Any, model: Any) -> None:
        """Pre-hooks on DDP and on the model it wraps: the time between them is DDP's buffer
        broadcast, a wait for rank 0, not this rank's work. And a hook on each parameter's
        gradient accumulation: the last one of a step stamps `arrived`, this rank's backward
        done, before DDP waits for the others' buckets (an autograd callback at the end of the
        backward pass). No comm hook: the user may register their own after job.wrap."""
        if not self.world_size:
            return
        if getattr(model, "_compiled_call_impl", None) is None:
            # (a model compiled in place would trace the hook into its graph: not for those)
            ddp.register_forward_pre_hook(lambda _m, _a: self.forward_called())
            model.register_forward_pre_hook(lambda _m, _a: self.forward_entered())
        clock = self._clock

        def stamp(_p: Any) -> None:
            self.arrived = clock()

        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(stamp)

    def fetched(self, _started: float, seconds: float) -> None:
        """job.timed: a batch took `seconds` to come."""
        self.data_s += seconds

    def step_started(self) -> None:
        self._started, self.data_s, self._blocked = self._clock(), 0.0, 0.0

    def forward_called(self) -> None:
        """DDP's forward was called (its pre-hook): it may first wait for rank 0's buffers."""
        self._forward_called = self._clock()

    def forward_entered(self) -> None:
        """The wrapped model's forward began (its pre-hook): the time since forward_called was
        spent in DDP's buffer broadcast, waiting for rank 0, not working."""
        if self._forward_called:
            self._blocked += self._clock() - self._forward_called
            self._forward_called = 0.0

    def step_done(self) -> None:
        now = self._clock()
        end = self.arrived if self._started < self.arrived <= now else now
        busy = max(0.0, end - self._started - self._blocked)
        self._last = (round(1e6 * busy), round(1e6 * min(self.data_s, busy)))

    def values(self) -> list[int]:
        """This rank's slots of the vote: busy then data, each world_size wide, the others 0."""
        if not self.world_size:  # the watch is off (or one rank): nothing rides
            return []
        out = [0] * (2 * self.world_size)
        out[self.rank], out[self.world_size + self.rank] = self._last
        return out

    def arrived_votes(self, step: int, values: Sequence[int]) -> None:
        """Every rank's values of step `step`, as the vote brought them."""
        if self._watch is None or len(values) != 2 * self.world_size:
            return
        w = self.world_size
        for flag in self._watch.observe(step, [v / 1e6 for v in values[:w]], [v / 1e6 for v in values[w:]]):
            if self._report is not None:
                self._report(flag)


def host_of(rank: int, hosts: Sequence[str], tasks_per_node: int, fallback: str) -> str:
    """The host of `rank` under SLURM's default block distribution (ranks 0..T-1 on the first
    node of the step, ...); `fallback` (this host) where the step's hosts are unknown."""
    node = rank // max(1, tasks_per_node)
    return hosts[node] if 0 <= node < len(hosts) else fallback


def for_job(job: Any) -> StepTimer:
    """A Job's timer (rank/job.py): it rides the vote when train.straggler_window > 0 and there
    are several ranks (world_size 0 otherwise: no slots, no hooks); rank 0 also watches, and
    says and records what it finds."""
    t, env = job.config.train, job.env
    on = t.straggler_window > 0 and job.world_size > 1
    watch = None
    if on and job.is_rank0:
        hosts = [host_of(r, env.hosts, env.local_world_size, env.hostname) for r in range(job.world_size)]
        watch = Watch(hosts, window=t.straggler_window, threshold=t.straggler_threshold)

    def report(flag: Flag) -> None:
        from ddpjob import console
        from ddpjob.ledger import events

        console.warn(flag.describe())
        events.record(job.run_dir, "straggler", rank=flag.rank, host=flag.host, cause=flag.cause,
                            busy_ms=round(1000 * flag.busy_s, 3), median_ms=round(1000 * flag.median_s, 3),
                            data_ms=round(1000 * flag.data_s, 3), step=flag.last, first_step=flag.first,
                            job_id=job.job_id, restart=job.restart)

    return StepTimer(job.rank, job.world_size if on else 0, watch, report=report)
