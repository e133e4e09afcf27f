"""tests/example_hooks.py plus the hooks the real-SLURM example tests need (a `train.entry`):

    [train] entry = "example_slurm_hooks:main"
    [train] args = ["examples/charlm/train.py", ...the script's own args]

From the environment, each hook acting when `job.steps()` hands out a step:
  DDPJOB_TEST_PREEMPT_AT="RESTART:STEP:OUTFILE"  rank 0 of that incarnation submits (sbatch) a
      job to partition `high` that needs both nodes, writes its id to OUTFILE, and then waits
      inside the step until ddpjob's stop flag has recorded the SIGTERM of the preemption: the
      stop lands at that step, caused by the step, not at a time.
  DDPJOB_TEST_USR2_AT="RESTART:STEP"  rank 0 of that incarnation runs `scancel --signal=USR2 JOB`
      (what SLURM's time-limit warning delivers) and waits the same way for the signal.
  DDPJOB_TEST_SLOW_STEP="RESTART:SECONDS"  every step of that incarnation sleeps that long (wall
      time only: no number changes), so that a time-limit warning lands mid-run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import example_hooks
from ddpjob import api


def _wait_for_flag(signum: int, timeout: float = 120) -> None:
    """ddpjob's handler is a bound method of its StopFlag: wait until it has recorded a signal."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        flag = getattr(signal.getsignal(signum), "__self__", None)
        if getattr(flag, "code", 0):
            return
        time.sleep(0.05)
    raise RuntimeError(f"example_slurm_hooks: no {signal.Signals(signum).name} within {timeout:.0f} s")


def _slurm_env() -> dict[str, str]:
    """This process's environment without the job's SLURM_* variables (sbatch would read them)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def _preempt(job: api.Job, outfile: str) -> None:
    out = subprocess.run(
        ["sbatch", "--parsable", "--partition=high", "--nodes=2", "--ntasks-per-node=2", "--time=2",
         "--job-name=ex-high", f"--output={outfile}.out"],
        input="#!/bin/bash\nsleep 1\n", capture_output=True, text=True, timeout=60, env=_slurm_env(),
        cwd=os.path.dirname(outfile) or ".", check=True)
    Path(outfile).write_text(out.stdout.strip().split(";")[0] + "\n")
    print(f"example_slurm_hooks: step {job._step}: submitted high job {out.stdout.strip()}", flush=True)
    _wait_for_flag(signal.SIGTERM)


def _usr2(job: api.Job) -> None:
    subprocess.run(["scancel", "--signal=USR2", str(job.job_id)], check=True, timeout=60,
                   env=_slurm_env())
    _wait_for_flag(signal.SIGUSR2)


def _install() -> None:
    env = os.environ
    preempt = env.get("DDPJOB_TEST_PREEMPT_AT", "")
    usr2 = env.get("DDPJOB_TEST_USR2_AT", "")
    slow = env.get("DDPJOB_TEST_SLOW_STEP", "")
    if not (preempt or usr2 or slow):
        return
    p_restart, p_step, p_file = (preempt.split(":", 2) if preempt else ("-1", "-1", ""))
    u_restart, u_step = (usr2.split(":") if usr2 else ("-1", "-1"))
    s_restart, s_secs = (slow.split(":") if slow else ("-1", "0"))
    steps = api.Job.steps

    def hooked(self: api.Job, state: dict[str, Any], total: int, **info: Any) -> Iterator[int]:
        for step in steps(self, state, total, **info):
            if self.restart == int(s_restart):
                time.sleep(float(s_secs))
            if self.rank == 0 and self.restart == int(p_restart) and step == int(p_step):
                _preempt(self, p_file)
            if self.rank == 0 and self.restart == int(u_restart) and step == int(u_step):
                _usr2(self)
            yield step

    api.Job.steps = hooked  # type: ignore[method-assign]


def main() -> None:
    _install()
    example_hooks.main()
