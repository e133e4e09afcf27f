"""The two things almost every process-starting test does, written once: run the `ddpjob` CLI as a
user's shell would (its own interpreter, output captured), and poll until something holds.

Shared by every tier (tests/unit, tests/ranks, tests/cluster); tests/ranks.py builds on it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def ddpjob(*argv: str, cwd: Path | str | None = None, env: Mapping[str, str] | None = None,
           timeout: float = 300, check: bool = False, user: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """`python -m ddpjob ARGV` in `cwd` (the repository when None) with `env` (this process's
    environment when None). `check`: a non-zero exit fails the test with the command's output.
    `user`: a command that runs it as another user (AS_NOBODY). The timeout only bounds a hang:
    a passing command never comes near it."""
    out = subprocess.run([*user, sys.executable, "-m", "ddpjob", *argv], capture_output=True, text=True,
                         cwd=cwd or REPO, env=None if env is None else dict(env), timeout=timeout)
    if check:
        assert out.returncode == 0, f"ddpjob {' '.join(argv)}: exit {out.returncode}\n{out.stdout}{out.stderr}"
    return out


# What a second user sees, for tests that run as root (whom no mode stops): `user=AS_NOBODY`.
AS_NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")


def without_job_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without the SLURM_/DDPJOB_ variables of an enclosing job (a
    test run inside an allocation must not hand its job to the job it submits), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDPJOB_"))}
    env.update(extra or {})
    return env


def job_env(**extra: str) -> dict[str, str]:
    """What the job's tasks need on top of sbatch's exported environment: the test plugins."""
    return {"PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)]), "OMP_NUM_THREADS": "1", **extra}


def wait_for(predicate: Callable[[], Any], timeout: float = 60.0, what: str = "condition",
             poll: float = 0.05, *, alive: Callable[[], bool] | None = None, whose: str = "") -> Any:
    """Poll `predicate` until it returns something truthy, and return that; fail after `timeout` s,
    or at once (after one last look) when `alive` says that `whose` (a job, a supervisor) ended."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if alive is not None and not alive():
            value = predicate()
            if value:
                return value
            raise AssertionError(f"{whose} ended while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)
