"""`ddpjob verify`'s hand inside a rank (launch/verify.py is the other end): an interruption
caused at a given step, and each rank's view of its state at the end of the run.

The login side sets DDPJOB_VERIFY (probeplan.py; read through ClusterEnv.ddpjob_vars) to
`record`, `pause@STEP:RANK` or `kill@STEP:RANK`. `Job.steps()` calls `at_step` as it hands out STEP, and on
the first attempt only (restart 0) the chosen rank
- kill: SIGKILLs itself (a crash: the supervisor restarts the ranks in place);
- pause: writes RUN_DIR/verify/paused.json and waits until its stop flag is raised (verify then
  signals the supervisor, or runs `ddpjob stop`): the stop lands at the same step however long
  the signal takes, never where a timer happens to fire.
After the final save (`at_end`) every rank writes RUN_DIR/verify/rank-R.json: a digest of each
`state` object as this rank holds it, and of the random generators its code holds outside `state`.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

from ddpjob import fileio, rundir
from ddpjob.probeplan import FOLDER, PAUSED, VARIABLE, Instruction, parse
from ddpjob.errors import DDPJobError

PAUSE_LIMIT_S = 300.0  # verify acts within a second; a rank paused longer was forgotten


class Probe:
    """One rank's part of a verify run; `None` from `for_rank` when verify did not ask."""

    def __init__(self, instruction: Instruction, run_dir: Path, rank: int, first_attempt: bool) -> None:
        self.instruction, self.run_dir, self.rank = instruction, run_dir, rank
        self.armed = first_attempt and instruction.rank == rank and instruction.action != "record"

    @classmethod
    def for_rank(cls, ddpjob_vars: Any, run_dir: Path, rank: int, restart: int) -> Probe | None:
        text = ddpjob_vars.get(VARIABLE)
        return cls(parse(text), run_dir, rank, restart == 0) if text else None

    def at_step(self, step: int, stop: Any) -> None:
        """`step` is handed out next; `stop` is the rank's StopFlag."""
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
                            outside.setdefault(where, digest(_generator_state(g)))
            frame = frame.f_back
        rundir.make_dir(self.run_dir / FOLDER)
        fileio.write_json_atomic(self.run_dir / FOLDER / f"rank-{self.rank}.json", {
            "state": {str(k): digest(v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()},
            "outside": outside})


def _is_generator(value: Any) -> bool:
    """A random generator of its own (torch, numpy, random), not a library's global one."""
    import random

    import numpy as np
    import torch

    if isinstance(value, torch.Generator):
        return value is not torch.default_generator and all(value is not g for g in torch.cuda.default_generators)
    if isinstance(value, (np.random.Generator, np.random.RandomState)):
        return value is not np.random.mtrand._rand
    return isinstance(value, random.Random) and value is not getattr(random, "_inst", None)


def _generators(value: Any, depth: int) -> list[Any]:
    return [g for _, g in _named_generators("", value, depth)]


def _named_generators(name: str, value: Any, depth: int = 1) -> list[tuple[str, Any]]:
    """Generators at `value` or one attribute level below it (`obj.gen`); modules and classes
    are not entered (torch's own generators live there)."""
    if isinstance(value, (ModuleType, type)) or name.startswith("__"):
        return []
    try:
        if _is_generator(value):
            return [(name, value)]
    except Exception:  # an object whose isinstance check itself fails: not a generator of the user's
        return []
    found: list[tuple[str, Any]] = []
    if depth > 0:
        for attr, inner in list(getattr(value, "__dict__", {}).items()):
            found += _named_generators(f"{name}.{attr}", inner, depth - 1)
    return found


def _generator_state(g: Any) -> Any:
    if hasattr(g, "get_state") and not hasattr(g, "bit_generator"):
        return g.get_state()  # torch.Generator, numpy RandomState
    if hasattr(g, "bit_generator"):
        return g.bit_generator.state
    return g.getstate()


def digest(value: Any) -> str:
    """sha256 of a nested value of tensors, arrays, numbers and strings, the same for equal
    contents whatever the object identities (a state_dict, a generator's state)."""
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()[:16]


def _feed(h: Any, value: Any) -> None:
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor: this rank's shard
        t = local.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, np.ndarray):
        h.update(f"A{value.dtype}{value.shape}".encode() + np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        h.update(b"{")
        for k in sorted(value, key=str):
            h.update(repr(k).encode())
            _feed(h, value[k])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for v in value:
            _feed(h, v)
        h.update(b"]")
    else:
        h.update(repr(value).encode())
