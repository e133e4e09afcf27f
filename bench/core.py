"""What every benchmark takes and gives: Bench (the sizes, the work dir, the data root and the
worker pools, with lockstep/interleave to run arms on them) and Row (one line of the table).

suite.py (P1-P10, P13 and the registry), p8.py and p11.py all build on these; run.py makes the
Bench and prints the rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import harness, pool
from bench.harness import Arm, Sizes, Trial


@dataclass
class Row:
    id: str
    measure: str
    goal: str
    measured: str
    passed: bool | None  # None: no goal to pass (or not measured)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Bench:
    sizes: Sizes
    base: Path  # work dir: data, workers' logs, run dirs
    root: Path  # the CIFAR-10-format data root
    log: Callable[[str], None] = print
    deadline: float = float("inf")  # time.monotonic() past which P8 starts no further arm
    hold: Path | None = None  # P8 times nothing while this file exists
    pools: pool.Pools = field(init=False)

    def __post_init__(self) -> None:
        self.pools = pool.Pools(self.base)

    def config(self, world: int, *overrides: str) -> str:
        return harness.job_config(self.root, self.sizes, world, *overrides)

    def lockstep(self, a: Arm, b: Arm, steps: int | None = None,
                 trials: int | None = None) -> tuple[list[Trial], list[Trial]]:
        s = self.sizes
        try:
            return pool.lockstep(self.pools, a, b, trials or s.trials, steps or s.warm + s.steps, self.base,
                                 log=self.log)
        finally:
            self.pools.reset()

    def interleave(self, arms: list[Arm], trials: int | None = None,
                   params: Callable[[Arm, int], dict[str, Any]] = lambda arm, i: {}) -> list[list[Trial]]:
        try:
            out = pool.interleave(self.pools, arms, trials or self.sizes.trials, self.base, params,
                                  log=self.log)
        finally:
            self.pools.reset()
        return [out[a.name] for a in arms]

    def close(self) -> None:
        self.pools.close()
