"""Model plugins ("trainer_plugins:NAME") for the trainer tests; tests/ranks.py puts this folder
on the ranks' PYTHONPATH.

- `conv_nobn`: a small CNN without BatchNorm, so that K micro-batches of B and one batch of K*B
  give the same gradient up to float rounding (BN's batch statistics would differ).
- `signalling_cnn`: cnn_tiny (same state_dict keys) that sends itself SIGUSR2 at a chosen
  training forward call, so a test can stop a run mid-accumulation deterministically.
  DDPJOB_TEST_SIGNAL="RANK:CALL" (1-based count of training-mode forward calls, this process).
  Optional fields "RANK:CALL:RESTART:HOW": only in that incarnation (DDPJOB_RESTART_COUNT or
  SLURM_RESTART_COUNT), and HOW = "scancel" runs `scancel --signal=USR2 $SLURM_JOB_ID` (the real
  SLURM path, to every task of the job) and waits in this forward call until the signal has
  reached this process; HOW = "crash" raises instead, HOW = "kill" SIGKILLs this process; HOW = "pause" prints "paused at call N"
  and waits in this forward call until ddpjob's stop flag has a signal (or 120 s): the test sends
  the signal from outside (tests/ranks.py: signal_when_paused), and it lands in that very step. RANK falls back to SLURM_PROCID (submitit sets no RANK).
  DDPJOB_TEST_SNAP_WAIT=STEP: before HOW = "kill", wait until every rank's in-memory snapshot
  of STEP is committed (/dev/shm/ddpjob-<uid>/...; they are written in the background), so the
  restart's choice of snapshot is caused by the test, not by how fast a thread wrote.
  DDPJOB_TEST_SLOW="SECONDS[:RESTART]" sleeps that long in every training forward call (of that
  incarnation only): stretches wall time without changing a single number.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

from ddpjob.train.models import TinyCNN

if os.environ.get("DDPJOB_TEST_ACTIONS"):
    # The at-step actions of the real-SLURM tests for jobs that run the built-in trainer with a
    # model from this module. Imported only then: test_freeze copies this file alone as a plugin.
    import example_slurm_hooks

    example_slurm_hooks.install()


def conv_nobn(num_classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU(), nn.Conv2d(8, 16, 3, 2, 1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, num_classes))


class SignallingCNN(TinyCNN):
    def __init__(self, num_classes: int) -> None:
        super().__init__(num_classes)
        # Test-only plumbing: the node-side package never reads the environment outside
        # cluster.py, but a test plugin may.
        env = os.environ
        spec = env.get("DDPJOB_TEST_SIGNAL", "")
        rank, call, restart, self._how = (spec.split(":") + ["", "", "", ""])[:4] if spec else ("",) * 4
        my_rank = env.get("RANK") or env.get("SLURM_PROCID") or "0"
        # the incarnation: the local supervisor's count, else SLURM's plus the template's runs
        # inside the allocation after a crash (SLURM's count does not move then)
        my_restart = env.get("DDPJOB_RESTART_COUNT") or str(
            int(env.get("SLURM_RESTART_COUNT") or 0) + int(env.get("DDPJOB_ATTEMPT") or 0))
        self._armed = spec != "" and rank == my_rank and restart in ("", my_restart)
        self._at = int(call) if call else 0
        self._calls = 0
        slow, _, slow_restart = env.get("DDPJOB_TEST_SLOW", "").partition(":")
        self._sleep = float(slow) if slow and slow_restart in ("", my_restart) else 0.0
        self._job_id = env.get("SLURM_JOB_ID", "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self._calls += 1
            if self._sleep:
                time.sleep(self._sleep)
            if self._armed and self._calls == self._at:
                if self._how == "scancel":
                    from example_slurm_hooks import slurm

                    slurm(["scancel", "--signal=USR2", self._job_id])
                    self._wait_for_signal()
                elif self._how == "pause":
                    print(f"paused at call {self._calls}", flush=True)
                    self._wait_for_signal(120)
                elif self._how == "crash":  # a rank raising: srun --kill-on-bad-exit ends the rest
                    raise RuntimeError(f"test crash at training forward call {self._calls}")
                elif self._how == "kill":  # kill -9: no ddpjob code runs on the way down
                    _wait_for_snapshots()
                    os.kill(os.getpid(), signal.SIGKILL)
                else:
                    os.kill(os.getpid(), signal.SIGUSR2)
        return super().forward(x)

    @staticmethod
    def _wait_for_signal(timeout: float = 60) -> None:
        # ddpjob's handler is a bound method of its StopFlag: wait until it has recorded the
        # signal, so the stop request lands inside this micro-step (mid-accumulation).
        flag = getattr(signal.getsignal(signal.SIGUSR2), "__self__", None)
        deadline = time.monotonic() + timeout
        while getattr(flag, "code", 1) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)


def _wait_for_snapshots(timeout: float = 120) -> None:
    step = os.environ.get("DDPJOB_TEST_SNAP_WAIT", "")
    if not step:
        return
    world = int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)
    job = os.environ.get("DDPJOB_JOB_ID") or os.environ.get("SLURM_JOB_ID") or "nojob"
    pattern = f"ddpjob-{os.getuid()}/{job}-*/*/rank-*/step-{int(step):09d}/manifest.json"
    deadline = time.monotonic() + timeout
    while len(list(Path("/dev/shm").glob(pattern))) < world:
        if time.monotonic() > deadline:
            raise RuntimeError(f"trainer_plugins: no snapshot of step {step} on all {world} ranks in {timeout} s")
        time.sleep(0.02)


def signalling_cnn(num_classes: int = 10) -> nn.Module:
    return SignallingCNN(num_classes)
