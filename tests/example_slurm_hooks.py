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
  DDPJOB_TEST_ACTIONS=FILE  lines "RESTART STEP RANK ACTION [ARG]", read when an incarnation
      starts, so a test can write the next incarnation's action while the job is pending (after
      a stop whose step it could not know in advance). ACTION, on that rank when that step is
      handed out:
        preempt OUTFILE  as DDPJOB_TEST_PREEMPT_AT;
        requeue          `scontrol requeue JOB`, then wait in the step until the SIGTERM is recorded;
        kill MARKER      write MARKER.ready, wait until the test writes MARKER.go (it reads the
                         task pids meanwhile), then SIGKILL this rank;
        die              SIGKILL this rank at once (kill -9, the OOM killer: no ddpjob code runs);
        crash            raise RuntimeError (a bug in the training code);
        stop             `ddpjob stop RUN_DIR` (the user's stop, any backend), then wait in the step
                         until the checkpoint signal is recorded;
        signal_job       the job's warning signal from outside, as a time limit sends it: SIGUSR2 to
                         the local supervisor (RUN_DIR/local.json's pid), or `scancel --signal=USR2
                         JOB` on SLURM; then wait the same way.
      RESTART "*" acts in every incarnation (a crash that comes back each time).
tests/trainer_plugins.py installs these hooks too, so they also drive the built-in trainer.
"""

from __future__ import annotations

import os
import re
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


def _ignore_usr2() -> None:
    """In the child before exec (an ignored signal stays ignored across exec): `scancel
    --signal=USR2 JOB` signals every process of the job's steps, and the scancel a rank starts
    is one of them. Seen in CI under stress-ng: it died of its own USR2 (returncode -12) before
    it exited 0, and the rank raised."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def slurm(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """Run a SLURM command from inside a rank. A controller too busy to answer ("Socket timed
    out", "Unable to contact", seen under stress-ng) is asked again instead of failing the rank,
    as tests/slurmtools.py does for the test's own commands."""
    for attempt in range(4):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=90, env=_slurm_env(),
                             preexec_fn=_ignore_usr2, **kwargs)
        if out.returncode == 0:
            return out
        if attempt == 3 or not re.search(r"timed out|Unable to contact", out.stderr):
            raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
        time.sleep(2)
    raise AssertionError("unreachable")


def _preempt(job: api.Job, outfile: str) -> None:
    out = slurm(["sbatch", "--parsable", "--partition=high", "--nodes=2", "--ntasks-per-node=2", "--time=2",
                 "--job-name=ex-high", f"--output={outfile}.out"],
                input="#!/bin/bash\nsleep 1\n", cwd=os.path.dirname(outfile) or ".")
    Path(outfile).write_text(out.stdout.strip().split(";")[0] + "\n")
    print(f"example_slurm_hooks: step {job._step}: submitted high job {out.stdout.strip()}", flush=True)
    _wait_for_flag(signal.SIGTERM)


def _usr2(job: api.Job) -> None:
    slurm(["scancel", "--signal=USR2", str(job.job_id)])
    _wait_for_flag(signal.SIGUSR2)


def _requeue(job: api.Job) -> None:
    slurm(["scontrol", "requeue", str(job.job_id)])
    _wait_for_flag(signal.SIGTERM)


def _kill(marker: str) -> None:
    Path(marker + ".ready").write_text(f"{os.getpid()}\n")
    go = Path(marker + ".go")
    deadline = time.monotonic() + 120
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)


def _actions(path: str) -> dict[tuple[int, int, int], list[str]]:
    """(restart, step, rank) -> [action, arg...] from the DDPJOB_TEST_ACTIONS file."""
    out = {}
    for line in Path(path).read_text().splitlines() if path and os.path.isfile(path) else []:
        restart, step, rank, *action = line.split()
        out[-1 if restart == "*" else int(restart), int(step), int(rank)] = action
    return out


def _act(job: api.Job, action: list[str]) -> None:
    print(f"example_slurm_hooks: step {job._step}: rank {job.rank}: {' '.join(action)}", flush=True)
    if action[0] == "preempt":
        _preempt(job, action[1])
    elif action[0] == "requeue":
        _requeue(job)
    elif action[0] == "kill":
        _kill(action[1])
    elif action[0] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action[0] == "crash":
        raise RuntimeError(f"example_slurm_hooks: crash at step {job._step}")
    elif action[0] == "stop":
        import sys

        out = subprocess.run([sys.executable, "-m", "ddpjob", "stop", str(job.run_dir)], capture_output=True,
                             text=True, timeout=120, env=_slurm_env(), preexec_fn=_ignore_usr2)
        if out.returncode != 0:
            raise RuntimeError(f"example_slurm_hooks: ddpjob stop failed: {out.stdout}{out.stderr}")
        _wait_for_flag(signal.SIGUSR2)
    elif action[0] == "signal_job":
        local = Path(job.run_dir) / "local.json"
        if local.is_file():
            import json

            os.kill(int(json.loads(local.read_text())["pid"]), signal.SIGUSR2)
        else:
            slurm(["scancel", "--signal=USR2", str(job.job_id)])
        _wait_for_flag(signal.SIGUSR2)
    else:
        raise ValueError(f"example_slurm_hooks: unknown action {action}")


_installed = False


def install() -> None:
    global _installed
    env = os.environ
    preempt = env.get("DDPJOB_TEST_PREEMPT_AT", "")
    usr2 = env.get("DDPJOB_TEST_USR2_AT", "")
    slow = env.get("DDPJOB_TEST_SLOW_STEP", "")
    actions = _actions(env.get("DDPJOB_TEST_ACTIONS", ""))
    if _installed or not (preempt or usr2 or slow or actions):
        return
    _installed = True
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
            for when in (self.restart, -1):
                if (when, step, self.rank) in actions:
                    _act(self, actions[when, step, self.rank])
            yield step

    api.Job.steps = hooked  # type: ignore[method-assign]


def main() -> None:
    install()
    example_hooks.main()
