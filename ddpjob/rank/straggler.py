"""Who is slow: rank 0's Watch over every rank's work per step (rank/steptimer.py measures it and
it rides the stop vote), naming a rank that stays slower than the others, with its cause.

Under DDP the gradient all-reduce makes every rank's step take as long as the slowest one's, so
per-rank step times show nothing. What differs is when a rank *arrives* at that all-reduce: its
busy time, from the start of its step to its last gradient (less DDP's buffer broadcast, a wait
for rank 0), which holds its data wait (`job.timed`) and the time its thread waited, runnable,
for a core (the kernel's run_delay: `wait`).

A rank is named only when its excess stands out from the run's own variation, and lasts:
  - work = busy - wait: what the rank did, not the turns it waited for a core. Over a window of
    steps, at each step the rank's work less the others' median work at that step (paired, so
    a moment that slows every rank cancels out); the median of these differences is its excess.
    It must pass SPREAD_K standard errors (those of a difference of two medians of the window's
    steps, each as spread as the others' steps: 1.4826 x their median absolute deviation),
    `threshold` (a share of the others' median work: a real but small difference is not worth
    a line; OVERSUBSCRIBED_SHARE at least on a host with more runnable threads than cores) and
    MIN_EXCESS_S, at CONFIRM looks in a row, half a window apart, after the attempt's warm-up.
  - Its cause: data when its extra data wait is at least half the excess, else compute.
  - A rank slow only by busy (its work is like the others'), or whose extra waits for a core
    are more than its extra work (work sharing a core grows too), waited for a core: that is its
    host's doing, not the rank's. Then no rank is named: the host is, once ("host n1 is
    oversubscribed (load 9.0 on 2 cores)"), with the load and cores each rank reports.
A flagged rank is named again only after a window in which it was not slow. Pure: no torch.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

MIN_EXCESS_S = 0.001  # a rank under a millisecond slower a step is not worth a line, however sure
CONFIRM = 3  # looks in a row (every half window) that must find a rank slow before it is named
WARMUP_MIN = 5  # an attempt's first steps (at least these, half a window) are not compared
# Where a rank's host runs more threads than it has cores, a rank's work is inflated by more
# than its waits for a core (a core shared with a hyperthread sibling, a hypervisor's steal,
# caches), unevenly and for seconds at a time: only an excess of at least this share is named there.
OVERSUBSCRIBED_SHARE = 0.5
# Standard errors of the window's median difference a rank's excess must pass. A rank's steps
# vary (a 7 ms CPU step by 10-20% at idle), and a fixed number of those per-step sigmas hides a
# 30% straggler; what the window is unsure of is its median, whose error shrinks with the steps
# in it. 3 of them, at CONFIRM looks in a row, is far outside chance for a rank that is not slow.
SPREAD_K = 3.0
MEDIAN_SE = 1.2533  # the standard error of a median is this x sigma / sqrt(n) (normal samples)
MAD_SIGMA = 1.4826  # the MAD of a normal sample times this estimates its sigma


@dataclass(frozen=True)
class Flag:
    """A finding over steps first..last. `cause` "compute" or "data": `rank` on `host` is a
    straggler, `busy_s` its work per step against the others' `median_s`. `cause` "host": the
    host is oversubscribed, `rank` waited `wait_s` per step for a core (more than the others),
    `load` the host's 1-minute load average on `cores` cores (None: not reported)."""

    rank: int
    host: str
    cause: str
    busy_s: float
    median_s: float
    data_s: float
    first: int
    last: int
    wait_s: float = 0.0
    load: float | None = None
    cores: int | None = None

    def describe(self) -> str:
        if self.cause == "host":
            state = (f"oversubscribed (load {self.load:.1f} on {self.cores} cores)"
                     if self.load is not None and self.cores and self.load > self.cores else
                     f"contended (load {self.load:.1f} on {self.cores} cores)" if self.load is not None and self.cores
                     else "contended")
            return (f"host {self.host} is {state}: its ranks wait for a core (rank {self.rank} "
                    f"{1000 * self.wait_s:.1f} ms a step more than the others, steps {self.first}-{self.last}); "
                    "no rank is named a straggler while it is")
        what = "its data loading" if self.cause == "data" else "its own compute (not the data, not the all-reduce)"
        return (f"rank {self.rank} on {self.host} is a straggler: {1000 * self.busy_s:.1f} ms of work per step "
                f"against a median of {1000 * self.median_s:.1f} ms over steps {self.first}-{self.last}; "
                f"the cause is {what} ({1000 * self.data_s:.1f} ms of data wait per step)")


@dataclass(frozen=True)
class Excess:
    """One rank against the others over a window, in seconds: its median and the others' median
    (every step of every other rank pooled); `excess`, the median over the steps of its value
    less the others' median at the same step; `error`, that median's standard error."""

    mine: float
    others: float
    excess: float
    error: float

    def stands_out(self, threshold: float) -> bool:
        return self.excess > max(SPREAD_K * self.error, threshold * self.others, MIN_EXCESS_S)

    def stands_out_on(self, threshold: float, load: tuple[float, int] | None) -> bool:
        """As stands_out, at OVERSUBSCRIBED_SHARE at least where `load` (the host's load average,
        cores) says the host runs more threads than it has cores."""
        busy_host = load is not None and load[1] > 0 and load[0] > load[1]
        return self.stands_out(max(threshold, OVERSUBSCRIBED_SHARE) if busy_host else threshold)


def excess(series: Sequence[Sequence[float]], r: int) -> Excess:
    """Rank `r` against the other ranks (`series`: one list of every rank's values per step).
    The error is that of a difference of two medians of the window's steps, each as unsure as
    the others' own step-to-step spread makes it: how far a rank that is not slow strays. (Not
    the slow rank's: a rank whose slowness varies from step to step is no less slow for it, nor
    is one that became slow inside the window less sure to be.)"""
    others = [v for values in series for i, v in enumerate(values) if i != r]
    mid = statistics.median(others)
    sigma = MAD_SIGMA * statistics.median(abs(v - mid) for v in others)
    error = MEDIAN_SE * sigma * math.sqrt(2 / len(series))
    return Excess(statistics.median(v[r] for v in series), mid, median_excess(series, r), error)


def differences(series: Sequence[Sequence[float]], r: int) -> list[float]:
    """Per step, rank `r`'s value less the median of the others'."""
    return [v[r] - statistics.median([u for i, u in enumerate(v) if i != r]) for v in series]


def median_excess(series: Sequence[Sequence[float]], r: int) -> float:
    return statistics.median(differences(series, r))


class Watch:
    """Rank 0's detector over the per-step busy, data and wait times of every rank."""

    def __init__(self, hosts: Sequence[str], *, window: int = 20, threshold: float = 0.2) -> None:
        self.hosts, self.window, self.threshold = list(hosts), max(2, int(window)), float(threshold)
        self._steps: deque[tuple[int, list[float], list[float], list[float]]] = deque(maxlen=self.window)
        self._load: list[tuple[float, int] | None] = [None] * len(self.hosts)
        self._flagged: set[int] = set()
        self._hosts_said: set[str] = set()  # "oversubscribed" is said once per host
        self._suspect: dict[int, int] = {}  # rank -> looks in a row that found it slow
        self._seen = 0  # steps of this attempt observed
        self.warmup = max(WARMUP_MIN, self.window // 2)

    def observe(self, step: int, busy_s: Sequence[float], data_s: Sequence[float],
                wait_s: Sequence[float] | None = None,
                load: Sequence[tuple[float, int] | None] | None = None) -> list[Flag]:
        """Add one step's times (every rank's; `wait_s`: the time each waited for a core, `load`:
        each rank's host's (load average, cores)); the findings new at this step."""
        n = len(self.hosts)
        self._seen += 1
        if self._seen <= self.warmup:  # allocator, caches, DDP's bucket rebuild: not the ranks' speed
            return []
        wait = list(wait_s) if wait_s is not None else [0.0] * n
        self._steps.append((step, list(busy_s), list(data_s), [min(w, b) for w, b in zip(wait, busy_s)]))
        if load is not None:
            self._load = [x if x is not None else old for x, old in zip(load, self._load)]
        if len(self._steps) < self.window or step % max(1, self.window // 2):
            return []  # a full window, looked at every half window: medians are not free
        busy = [s[1] for s in self._steps]
        work = [[b - w for b, w in zip(s[1], s[3])] for s in self._steps]
        out = []
        for r in range(n):
            own = excess(work, r)  # the rank's own work: its compute and its data wait
            raw = excess(busy, r)  # and what it took in wall time, waits for a core included
            # slow in wall time only because it waited for a core more than the others: its host
            waited = raw.stands_out(self.threshold) and median_excess(
                [s[3] for s in self._steps], r) >= 0.5 * raw.excess
            slow = own.stands_out_on(self.threshold, self._load[r]) or waited
            # slow at CONFIRM looks in a row (half a window apart): a busy moment is not a straggler
            self._suspect[r] = self._suspect.get(r, 0) + 1 if slow else 0
            if not slow:
                self._flagged.discard(r)
            elif self._suspect[r] >= CONFIRM and r not in self._flagged:
                self._flagged.add(r)
                flag = self._flag(r, step, own, raw, waited)
                if flag is not None:
                    out.append(flag)
        return out

    def _flag(self, r: int, step: int, own: Excess, raw: Excess, waited: bool) -> Flag | None:
        first = self._steps[0][0]
        data = statistics.median(s[2][r] for s in self._steps)
        wait = median_excess([s[3] for s in self._steps], r)
        # A rank that shares its core with other work also does more work (cold caches, context
        # switches: 60% more on the test cluster's hogged core); where it waited for the core
        # longer than that extra work, the sharing is the cause, and its host is named.
        if own.stands_out_on(self.threshold, self._load[r]) and not (waited and wait >= own.excess):
            extra_data = median_excess([s[2] for s in self._steps], r)
            cause = "data" if extra_data >= 0.5 * own.excess else "compute"
            return Flag(r, self.hosts[r], cause, own.mine, own.others, data, first, step,
                        wait_s=wait)
        # slow in wall time only: the turns it waited for a core made the difference
        host = self.hosts[r]
        if host in self._hosts_said:
            return None
        self._hosts_said.add(host)
        reported = self._load[r]
        return Flag(r, host, "host", raw.mine, raw.others, data, first, step, wait_s=wait,
                    load=reported[0] if reported else None, cores=reported[1] if reported else None)


def host_of(rank: int, hosts: Sequence[str], tasks_per_node: int, fallback: str) -> str:
    """The host of `rank` under SLURM's default block distribution (ranks 0..T-1 on the first
    node of the step, ...); `fallback` (this host) where the step's hosts are unknown."""
    node = rank // max(1, tasks_per_node)
    return hosts[node] if 0 <= node < len(hosts) else fallback
