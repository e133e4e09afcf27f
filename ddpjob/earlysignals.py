"""The first thing `python -m ddpjob run` does (ddpjob/__main__.py), before any other import: a stop
signal from then on is noted, not the default action's end of the rank (srun's tasks cannot be
started with the signals blocked, and the rank's imports take a second). node/preemption.py's
StopFlag.install takes the noted signals over. Standard library only: it runs first."""

from __future__ import annotations

import signal
import time
from typing import Any

EARLY = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)  # any of them may be a job's stop signal
noted: list[tuple[int, float]] = []  # (signum, time) of each signal taken before the StopFlag


def note(signum: int, frame: Any) -> None:
    noted.append((signum, time.time()))


def hold() -> None:
    for signum in EARLY:
        signal.signal(signum, note)
