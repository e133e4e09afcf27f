"""`ddpjob verify`'s hand inside a rank (launch/verify.py is the other end): an interruption
caused at a given step, and each rank's view of its state at the end of the run.

The login side sets DDPJOB_VERIFY (probeplan.py; read through ClusterEnv.ddpjob_vars) to
`record`, `pause@STEP:RANK` or `kill@STEP:RANK`. `Job.steps()` calls `at_step` as it hands out STEP, and on
the first attempt only (restart 0) the chosen rank
- kill: SIGKILLs itself (a crash: the supervisor restarts the ranks in place);
- pause: writes RUN_DIR/verify/paused.json and waits until its stop flag is raised (verify then
  signals the supervisor, or runs `ddpjob stop`): the stop lands at the same step however long
  the signal takes, never where a timer happens to fire.
As every step is handed out, every rank of every attempt appends its view of the loop's own
variables (rank/loopview.py: what the loop holds outside `state`, by content) to
RUN_DIR/verify/steps-rank-R.jsonl; a replayed step's line comes later in the file.
After the final save (`at_end`) every rank writes RUN_DIR/verify/rank-R.json: a digest of each
`state` object as this rank holds it (a PerRank value by its content), and of the random
generators its code holds outside `state`.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

from ddpjob import fileio, rundir
from ddpjob.probeplan import FOLDER, PAUSED, STEPS, VARIABLE, Instruction, parse
from ddpjob.errors import DDPJobError
from ddpjob.rank import loopview
from ddpjob.rank.loopview import digest

__all__ = ["Probe", "digest"]

PAUSE_LIMIT_S = 300.0  # verify acts within a second; a rank paused longer was forgotten


class Probe:
    """One rank's part of a verify run; `None` from `for_rank` when verify did not ask."""

    def __init__(self, instruction: Instruction, run_dir: Path, rank: int, restart: int) -> None:
        self.instruction, self.run_dir, self.rank, self.restart = instruction, run_dir, rank, restart
        self.armed = restart == 0 and instruction.rank == rank and instruction.action != "record"
        self._cache: dict[int, Any] = {}
        self._inside: set[int] | None = None

    @classmethod
    def for_rank(cls, ddpjob_vars: Any, run_dir: Path, rank: int, restart: int) -> Probe | None:
        text = ddpjob_vars.get(VARIABLE)
        return cls(parse(text), run_dir, rank, restart) if text else None

    def at_step(self, step: int, stop: Any, state: dict[str, Any]) -> None:
        """`step` is handed out next (called from inside `job.steps()`: the frame above it is the
        user's loop); `stop` is the rank's StopFlag."""
        if self._inside is None:
            self._inside = loopview.inside_ids(state)
            rundir.make_dir(self.run_dir / FOLDER)
        loop = sys._getframe(2)  # at_step <- Job.steps <- the user's loop, iterating it
        fileio.append_jsonl(self.run_dir / FOLDER / STEPS.format(rank=self.rank), {
            "step": step, "restart": self.restart,
            "view": loopview.view(loop, self._inside, self._cache)})
        del loop
        if not self.armed or step != self.instruction.step:
            return
        self.armed = False
        if self.instruction.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        rundir.make_dir(self.run_dir / FOLDER)
        fileio.write_json_atomic(self.run_dir / FOLDER / PAUSED, {"step": step, "rank": self.rank,
                                                                   "pid": os.getpid()})
        deadline = time.monotonic() + PAUSE_LIMIT_S
        while not stop.code:  # the handler sets it; the sleep is interrupted by the signal
            if time.monotonic() > deadline:
                raise DDPJobError(f"rank {self.rank} paused at step {step} for `ddpjob verify` and no stop "
                                  f"came within {PAUSE_LIMIT_S:.0f} s", "rerun `ddpjob verify`")
            time.sleep(0.01)

    def at_end(self, state: dict[str, Any]) -> None:
        """After the final save: this rank's digests (verify compares them between runs)."""
        inside = {id(g) for obj in state.values() for g in _generators(obj, depth=2)}
        outside: dict[str, str] = {}
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:  # the user's loop is up the stack: its locals and globals
            for scope in (frame.f_locals, frame.f_globals):
                for name, value in list(scope.items()):
                    for where, g in _named_generators(name, value):
                        if id(g) not in inside:
                            outside.setdefault(where, digest(loopview.generator_state(g)))
            frame = frame.f_back
        rundir.make_dir(self.run_dir / FOLDER)
        fileio.write_json_atomic(self.run_dir / FOLDER / f"rank-{self.rank}.json", {
            "state": {str(k): digest(_content(v)) for k, v in state.items()},
            "outside": outside})


def _generators(value: Any, depth: int) -> list[Any]:
    return [g for _, g in _named_generators("", value, depth)]


def _named_generators(name: str, value: Any, depth: int = 1) -> list[tuple[str, Any]]:
    """Generators at `value` or one attribute level below it (`obj.gen`); modules and classes
    are not entered (torch's own generators live there)."""
    if isinstance(value, (ModuleType, type)) or name.startswith("__"):
        return []
    try:
        if loopview.is_generator(value):
            return [(name, value)]
    except Exception:  # an object whose isinstance check itself fails: not a generator of the user's
        return []
    found: list[tuple[str, Any]] = []
    if depth > 0:
        for attr, inner in list(getattr(value, "__dict__", {}).items()):
            found += _named_generators(f"{name}.{attr}", inner, depth - 1)
    return found


def _content(value: Any) -> Any:
    """What a `state` value holds: a PerRank's saved value, an object's state_dict, a plain value."""
    capture = getattr(value, "capture", None)
    if callable(capture) and type(value).__name__ == "PerRank":
        return capture()
    return value.state_dict() if callable(getattr(value, "state_dict", None)) else value
