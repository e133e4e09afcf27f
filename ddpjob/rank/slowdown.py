"""Is the whole job slower than it was: rank 0's SlowdownWatch compares the job's step time with
the run's own baseline (rank/steptimer.py feeds it; the straggler watch, rank/straggler.py,
compares the ranks with each other and says nothing when every rank is slow).

A degraded interconnect, a throttled GPU on every node, a shared filesystem under load: each
slows every rank, so only a comparison with the run itself shows it. The baseline is the median
over `window` steps after the attempt's warm-up (the first steps pay for the allocator, DDP's
bucket rebuild, compilation), recorded as a `baseline` event; a resumed attempt takes the
newest one of its world size from events.jsonl, so a requeued run is compared with itself
before the requeue. Every half window after that, the median step time of the last window is
compared with it. More than threshold / 3 below it: it is the new baseline (the window after
start-up is often still slow, and a baseline taken there hides a real slowdown). Above
(1 + threshold) x the baseline at CONFIRM looks in a row: one finding, which says since when,
how much, whether every rank or some are slower, and which part of the step moved (data wait,
compute, or the all-reduce: the wait for the others). Below
(1 + threshold / 2) x the baseline again: the job is back at its speed. Pure: no torch.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CONFIRM = 2  # looks in a row (half a window apart) above the limit before a slowdown is said
WARMUP_MIN = 5  # steps of an attempt never compared, however small the window
MIN_RANK_S = 0.001  # a rank is "slower" by at least this much per step, not by rounding
PARTS = (("data", "the data wait"), ("compute", "the compute"), ("allreduce", "the all-reduce wait"))


@dataclass(frozen=True)
class Parts:
    """A window's medians in seconds: `step`, rank 0's wall time per step, and what it is made
    of over the ranks: `data` (the median rank's data wait), `compute` (its work less the data
    wait) and `allreduce` (the rest: the wait for the others and the all-reduce itself); `busy`
    each rank's work (to its arrival at the gradient all-reduce)."""

    step: float
    data: float
    compute: float
    allreduce: float
    busy: tuple[float, ...]

    @classmethod
    def of(cls, steps: Sequence[tuple[int, float, Sequence[float], Sequence[float]]]) -> Parts:
        """(step, step seconds, every rank's busy, every rank's data wait) per step."""
        step = statistics.median(s[1] for s in steps)
        data = statistics.median(statistics.median(s[3]) for s in steps)
        work = statistics.median(statistics.median(s[2]) for s in steps)
        busy = tuple(statistics.median(s[2][r] for s in steps) for r in range(len(steps[0][2])))
        return cls(step, data, max(0.0, work - data), max(0.0, step - work), busy)

    def fields(self, prefix: str = "") -> dict[str, Any]:
        ms = {f"{prefix}step_ms": self.step, f"{prefix}data_ms": self.data,
              f"{prefix}compute_ms": self.compute, f"{prefix}allreduce_ms": self.allreduce}
        return {k: round(1000 * v, 3) for k, v in ms.items()}


@dataclass(frozen=True)
class Baseline:
    """The run's own speed: `parts` over the window that ended at `step`, at `world_size` ranks."""

    step: int
    parts: Parts
    world_size: int

    def fields(self) -> dict[str, Any]:
        """A `baseline` event's fields (ledger/events.py)."""
        return {"step": self.step, "world_size": self.world_size, **self.parts.fields(),
                "busy_ms": [round(1000 * b, 3) for b in self.parts.busy]}

    @classmethod
    def from_events(cls, evs: Sequence[Mapping[str, Any]], world_size: int) -> Baseline | None:
        """The newest `baseline` of this world size in the run's events (None: none, or one
        this reader cannot use: a resume at another world size has another speed)."""
        for e in reversed(evs):
            if e.get("event") != "baseline" or e.get("world_size") != world_size:
                continue
            try:
                step, data, compute, allreduce = (float(e[k]) / 1000 for k in
                                                  ("step_ms", "data_ms", "compute_ms", "allreduce_ms"))
                busy = tuple(float(b) / 1000 for b in e["busy_ms"])
                return cls(int(e["step"]), Parts(step, data, compute, allreduce, busy), world_size)
            except (KeyError, TypeError, ValueError):
                return None
        return None


@dataclass(frozen=True)
class Slowdown:
    """The job's step time stayed above the baseline: since step `since`, found at `step`."""

    since: int
    step: int
    now: Parts
    base: Baseline
    slower: tuple[int, ...]  # the ranks whose own work per step grew

    @property
    def ratio(self) -> float:
        return self.base.parts.step / self.now.step if self.now.step > 0 else 1.0

    @property
    def cause(self) -> str:
        """The part of the step that grew most: data, compute or allreduce."""
        return max(PARTS, key=lambda p: getattr(self.now, p[0]) - getattr(self.base.parts, p[0]))[0]

    def describe(self) -> str:
        n, b = self.now, self.base.parts
        world = len(n.busy)
        if world <= 1:
            who = ""
        elif len(self.slower) == world:
            who = ": every rank is slower (not one straggler)"
        elif len(self.slower) == 1:
            who = f": rank {self.slower[0]} alone is slower, the others wait for it"
        elif self.slower:
            who = f": ranks {', '.join(map(str, self.slower))} are slower, the others wait for them"
        else:
            who = ": no rank's own work is slower (the time goes to the all-reduce)"
        grew = sorted(((getattr(n, key) - getattr(b, key), key, name) for key, name in PARTS), reverse=True)
        top = grew[0][0]
        moved = [f"{name} went from {1000 * getattr(b, key):.0f} ms to {1000 * getattr(n, key):.0f} ms"
                 for d, key, name in grew if d > 0 and d >= top / 3]
        return (f"the job runs at {self.ratio:.2f}x its own speed since step {self.since} "
                f"({1000 * n.step:.0f} ms a step against {1000 * b.step:.0f} ms){who}; " + ", ".join(moved))

    def fields(self) -> dict[str, Any]:
        """A `slowdown` event's fields (state "began")."""
        return {"state": "began", "since": self.since, "step": self.step, "ratio": round(self.ratio, 3),
                "cause": self.cause, "ranks": list(self.slower), **self.now.fields(),
                **self.base.parts.fields("baseline_"), "line": self.describe()}


@dataclass(frozen=True)
class Recovered:
    """The job is back near its own speed at `step` (`ratio` of it over the last window)."""

    step: int
    ratio: float

    def describe(self) -> str:
        return f"the job is back at {self.ratio:.2f}x its own speed at step {self.step}"

    def fields(self) -> dict[str, Any]:
        return {"state": "over", "step": self.step, "ratio": round(self.ratio, 3), "line": self.describe()}


class SlowdownWatch:
    """Rank 0: `observe` each step's time and every rank's busy and data wait; it returns what is
    new: a Baseline (the first after the warm-up when none was given, and each faster one),
    a Slowdown, a Recovered."""

    def __init__(self, *, window: int = 50, threshold: float = 0.3, baseline: Baseline | None = None,
                 world_size: int = 1, warmup: int | None = None) -> None:
        self.window, self.threshold = max(4, int(window)), float(threshold)
        self.warmup = max(WARMUP_MIN, self.window // 2) if warmup is None else int(warmup)
        self.baseline, self.world_size = baseline, world_size
        self._seen = 0  # steps of this attempt observed
        self._hist: deque[tuple[int, float, list[float], list[float]]] = deque(maxlen=2 * self.window)
        self._suspect = 0
        self.slow: Slowdown | None = None

    def observe(self, step: int, step_s: float, busy_s: Sequence[float], data_s: Sequence[float]) -> list[Any]:
        self._seen += 1
        if self._seen <= self.warmup:
            return []
        self._hist.append((step, step_s, list(busy_s), list(data_s)))
        if len(self._hist) < self.window:
            return []
        last = list(self._hist)[-self.window:]
        if self.baseline is None:
            self.baseline = Baseline(step, Parts.of(last), self.world_size)
            return [self.baseline]
        if (self._seen - self.warmup) % max(1, self.window // 2):
            return []  # looked at every half window: medians are not free
        now, base = Parts.of(last), self.baseline.parts
        if self.slow is not None:
            if now.step < (1 + self.threshold / 2) * base.step:
                self.slow, self._suspect = None, 0
                return [Recovered(step, base.step / now.step if now.step > 0 else 1.0)]
            return []
        if now.step < (1 - self.threshold / 3) * base.step:
            # the run is faster than its baseline: the warm-up window was still slow (the first
            # steps after start-up often are), so the baseline becomes the speed the run has shown
            self.baseline, self._suspect = Baseline(step, now, self.world_size), 0
            return [self.baseline]
        limit = (1 + self.threshold) * base.step
        self._suspect = self._suspect + 1 if now.step > limit else 0
        if self._suspect < CONFIRM:
            return []
        # a step is slow when nearer (by ratio) the window's median than the baseline's
        split = (now.step * base.step) ** 0.5
        since = change_point([s[0] for s in self._hist], [s[1] > split for s in self._hist])
        slower = tuple(r for r, (b, b0) in enumerate(zip(now.busy, base.busy))
                       if b > (1 + self.threshold / 2) * b0 and b - b0 > MIN_RANK_S)
        self.slow = Slowdown(since, step, now, self.baseline, slower)
        return [self.slow]


def change_point(steps: Sequence[int], slow: Sequence[bool]) -> int:
    """The step from which the steps are slow: the split that leaves the fewest slow steps
    before it and fast steps after it (the earliest of equals). A slow step here and there
    before the change, or a fast one after it, does not move it."""
    errors = sum(not x for x in slow)  # the split before the first step: its fast steps
    best, at = errors, steps[0]
    for step, x in zip(steps, slow):
        if errors < best:
            best, at = errors, step
        errors += 1 if x else -1  # this step moves from "after" to "before" the split
    return at
