"""The instruction `ddpjob verify` hands a run's ranks and where they answer: the one grammar
that launch/verify.py writes (DDPJOB_VERIFY, in the supervisor's environment) and rank/probe.py
reads (through ClusterEnv.ddpjob_vars). Shared, no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ddpjob.errors import DDPJobError

VARIABLE = "DDPJOB_VERIFY"
FOLDER = "verify"  # RUN_DIR/verify/: paused.json, rank-R.json, steps-rank-R.jsonl
PAUSED = "paused.json"
STEPS = "steps-rank-{rank}.jsonl"  # each step's view of the loop's own variables (rank/loopview.py)


@dataclass(frozen=True)
class Instruction:
    """record: only the digests at the end; pause/kill: that too, and at `step` on `rank`."""

    action: str  # record | pause | kill
    step: int = -1
    rank: int = 0

    def text(self) -> str:
        return self.action if self.action == "record" else f"{self.action}@{self.step}:{self.rank}"


def parse(text: str) -> Instruction:
    """DDPJOB_VERIFY's value (only ddpjob verify writes it)."""
    if text == "record":
        return Instruction("record")
    m = re.fullmatch(r"(pause|kill)@(\d{1,9}):(\d{1,6})", text)
    if m is None:
        raise DDPJobError(f"{VARIABLE} is {text!r}, expected record, pause@STEP:RANK or kill@STEP:RANK",
                          f"unset {VARIABLE}: only `ddpjob verify` sets it")
    return Instruction(m[1], int(m[2]), int(m[3]))
