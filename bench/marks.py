"""Step marks and the gate that makes two arms take turns (pool.lockstep).

Every arm's loop calls `marks.mark(step)` after each step (ddpjob's trainer through a hook on
its MetricsLog.step, the references directly). A mark is [wall, process CPU] at the end of the
step and again when the loop goes on; in between, when the trial is gated, the rank reports
the step to the parent and waits for its go-ahead, using no CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class Gate:
    """Set up once per worker process by worker.main; `enabled` per trial."""

    def __init__(self) -> None:
        self.enabled = False
        self.send: Callable[[dict[str, Any]], None] | None = None
        self.wait: Callable[[], str] | None = None

    def pass_(self, step: int) -> None:
        assert self.send is not None and self.wait is not None
        self.send({"gate": step})
        line = self.wait()
        if not line:
            raise EOFError("the benchmark parent went away while this rank waited at a gate")


GATE = Gate()


def _clocks() -> list[float]:
    return [time.time(), time.process_time()]


class Marks(dict[str, list[float]]):
    """str(step) -> [wall end, CPU end, wall go-on, CPU go-on] (harness.step_costs)."""

    def mark(self, step: int) -> None:
        end = _clocks()
        if GATE.enabled:
            GATE.pass_(step)
        self[str(step)] = end + (_clocks() if GATE.enabled else end)
