"""`checkpoint.snapshot_every = "auto"` (the default; on only for a job that may restart,
slurm.max_failures > 0): the interval of the in-memory snapshots (store/memsnap.py), measured at
each start, since what a snapshot costs against a step depends on the model, the hardware and
the load (bench P13: >= 14 steps for cnn_tiny and >= 9 for ResNet-18 on 2 CPU cores, >= 37-70
for ResNet-18 on an H100). The probe is a real snapshot, AUTO.probe steps after the start; the
cost is the time it held the loop plus the CPU time of its background write (on CPUs the write
competes with the training threads; on a GPU this overstates it, which only lengthens the
interval). Once AUTO.decide steps have passed since the probe and its write is done, rank 0
sets the interval to the fewest steps that keep cost / (interval x median step time) <=
AUTO.goal, and every rank takes it at the same step: it rides the per-step vote
(rank/snapvote.py), since the ranks must snapshot the same steps to share a newest one. A write
still running AUTO.wait steps after that is counted at its time so far. Pure: no torch, no files.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AutoRule:
    probe: int = 20  # steps after the start: past the first steps' compiles and cold caches
    decide: int = 10  # steps after the probe: its background write is done by then, usually
    goal: float = 0.01  # one snapshot's cost as a fraction of the steps between two
    wait: int = 200  # steps past decide that rank 0 waits for the probe's write, at most
    most: int = 100_000


AUTO = AutoRule()


@dataclass
class Auto:
    """snapshot_every = "auto" on one rank: the start, the step times and the probe's cost."""

    rule: AutoRule = AUTO
    start: int | None = None  # the step the loop began at (first snapshot_due call - 1)
    probe_at: int | None = None  # the step of the probe: the first asked about from start + probe on
    step_s: list[float] = field(default_factory=list)
    last: tuple[int, float] | None = None  # (step, time) of the previous observe()
    block_s: float | None = None  # the probe's hold on the loop (the copy)
    write_cpu_s: float | None = None  # its background write's CPU time
    write_since: float | None = None  # time.perf_counter() when that write started

    def probe_now(self, step: int) -> bool:
        """The probe is the first snapshot asked about at or past start + probe (not at a step
        a checkpoint was written at: Snapshots.due)."""
        if self.probe_at is None and self.start is not None and step >= self.start + self.rule.probe:
            self.probe_at = step
        return step == self.probe_at

    def decide_step(self) -> int | None:
        return None if self.probe_at is None else self.probe_at + self.rule.decide

    def interval(self, unfinished_s: float | None = None) -> tuple[int, str]:
        """(steps between snapshots, 0: none; the line that says why). `unfinished_s`: the
        probe's write is still running after that long, which then stands for its cost (a
        floor: the interval it gives is, if anything, too short)."""
        if self.block_s is None or not self.step_s:
            return 0, "in-memory snapshots off: the probe snapshot could not be taken"
        step = statistics.median(self.step_s)
        write = self.write_cpu_s if unfinished_s is None else unfinished_s
        cost = self.block_s + (write or 0.0)
        late = "" if unfinished_s is None else f" (its write still running after {unfinished_s:.1f} s)"
        n = min(self.rule.most, max(1, math.ceil(cost / (self.rule.goal * max(step, 1e-6)))))
        return n, (f"in-memory snapshots every {n} steps (snapshot_every = \"auto\"): one costs "
                   f"{cost * 1e3:.1f} ms{late} ({self.block_s * 1e3:.1f} ms holding the loop), a step "
                   f"{step * 1e3:.1f} ms, so <= {self.rule.goal:.0%} of the time between two")
