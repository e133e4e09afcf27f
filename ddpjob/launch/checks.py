"""One finding of a preflight check and the helpers every check shares: `ddpjob doctor`
(doctor.py), the restart-in-place checks (restartchecks.py) and the job's own code
(entrycheck.py) all speak in `Check`s; `submit` stops on the first FAIL (`raise_on_failures`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ddpjob import slurm
from ddpjob.errors import DDPJobError

PASS, WARN, FAIL = "pass", "warn", "fail"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # pass | warn | fail
    detail: str
    hint: str = ""


def raise_on_failures(checks: Sequence[Check]) -> None:
    """The first failed check as the one-line DDPJobError the CLI prints."""
    for c in checks:
        if c.status == FAIL:
            raise DDPJobError(f"preflight check '{c.name}' failed: {c.detail}", c.hint)


def output(res: slurm.Result) -> str:
    """A command's output, or why it failed (missing, timeout): what a check shows."""
    return (res.stdout + res.stderr).strip() or res.error


def one_cell(text: str, limit: int = 160) -> str:  # command output as part of one table cell
    return " ".join(text.split())[:limit]


def records(text: str) -> list[dict[str, str]]:
    """`scontrol show ... -o` output: one record per line of Key=Value tokens."""
    return [dict(t.split("=", 1) for t in line.split() if "=" in t) for line in text.splitlines()
            if "=" in line]
