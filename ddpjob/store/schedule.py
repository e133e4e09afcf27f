"""When to save: every N optimizer steps and/or every M minutes (no torch)."""

from __future__ import annotations

import time
from typing import Callable

from ddpjob.errors import UsageError


class SaveSchedule:
    """Save every `every_steps` optimizer steps and/or every `every_minutes` (0 turns either off).

    due() is cheap and local. Step answers agree on every rank by construction; minute answers do
    not (each rank has its own clock), so the caller must agree on them: ask rank 0 and broadcast
    the answer, or all-reduce MAX of every rank's answer and then call mark_saved() on every rank.
    A True answer restarts the minute timer.
    """

    def __init__(self, every_steps: int, every_minutes: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if every_steps < 0 or every_minutes < 0:
            raise UsageError(f"checkpoint interval every_steps={every_steps} every_minutes={every_minutes}, "
                             "expected numbers >= 0", "use 0 to turn an interval off")
        self.every_steps, self.every_minutes, self._clock = every_steps, every_minutes, clock
        self._last = clock()

    def due_by_steps(self, step: int) -> bool:
        """The step answer alone: the same on every rank without a vote."""
        return self.every_steps > 0 and step > 0 and step % self.every_steps == 0

    def due(self, step: int) -> bool:
        by_steps = self.due_by_steps(step)
        by_time = self.every_minutes > 0 and self._clock() - self._last >= self.every_minutes * 60
        if by_steps or by_time:
            self.mark_saved()
            return True
        return False

    def mark_saved(self) -> None:
        self._last = self._clock()
