"""`checkpoint.snapshot_every = "auto"` (the default; on only for a job that may restart,
slurm.max_failures > 0): the interval of the in-memory snapshots (store/memsnap.py), measured at
each start, since what a snapshot costs against a step depends on the model, the hardware and
the load (bench P13: >= 14 steps for cnn_tiny and >= 9 for ResNet-18 on 2 CPU cores, >= 37-70
for ResNet-18 on an H100). The probe is a real snapshot, AUTO.probe steps after the start; the
cost is the time it held the loop plus the CPU time of its background write (on CPUs the write
competes with the training threads; on a GPU this overstates it, which only lengthens the
interval). AUTO.decide steps after the probe, rank 0 sets the interval to the fewest steps that
keep cost / (interval x median step time) <= AUTO.goal and every rank takes it (one broadcast:
they must snapshot the same steps to share a newest one). Pure: no torch, no files.
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

    def probe_now(self, step: int) -> bool:
        """The probe is the first snapshot asked about at or past start + probe (not at a step
        a checkpoint was written at: Snapshots.due)."""
        if self.probe_at is None and self.start is not None and step >= self.start + self.rule.probe:
            self.probe_at = step
        return step == self.probe_at

    def decide_step(self) -> int | None:
        return None if self.probe_at is None else self.probe_at + self.rule.decide

    def interval(self) -> tuple[int, str]:
        """(steps between snapshots, 0: none; the line that says why)."""
        if self.block_s is None or not self.step_s:
            return 0, "in-memory snapshots off: the probe snapshot could not be taken"
        step = statistics.median(self.step_s)
        cost = self.block_s + (self.write_cpu_s or 0.0)
        n = min(self.rule.most, max(1, math.ceil(cost / (self.rule.goal * max(step, 1e-6)))))
        return n, (f"in-memory snapshots every {n} steps (snapshot_every = \"auto\"): one costs "
                   f"{cost * 1e3:.1f} ms ({self.block_s * 1e3:.1f} ms holding the loop), a step "
                   f"{step * 1e3:.1f} ms, so <= {self.rule.goal:.0%} of the time between two")
