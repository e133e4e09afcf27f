"""Model plugins ("trainer_plugins:NAME") for the trainer tests; tests/ranks.py puts this folder
on the ranks' PYTHONPATH.

- `conv_nobn`: a small CNN without BatchNorm, so that K micro-batches of B and one batch of K*B
  give the same gradient up to float rounding (BN's batch statistics would differ).
- `signalling_cnn`: cnn_tiny (same state_dict keys, strided convs instead of max-pools) that
  sends itself SIGUSR2 at a chosen training forward call, so a test can stop a run
  mid-accumulation deterministically.
  DDPJOB_TEST_SIGNAL="RANK:CALL" (1-based count of training-mode forward calls, this process);
  several, comma-separated, for other ranks or incarnations.
  Optional fields "RANK:CALL:RESTART:HOW": only in that incarnation (DDPJOB_RESTART_COUNT,
  TORCHELASTIC_RESTART_COUNT or SLURM_RESTART_COUNT), and HOW = "scancel" runs `scancel --signal=USR2 $SLURM_JOB_ID` (the real
  SLURM path, to every task of the job) and waits in this forward call until the signal has
  reached this process; HOW = "crash" raises instead, HOW = "kill" SIGKILLs this process, "segv" sends it
  SIGSEGV, "internal" breaks ddpjob's per-step decision (an exception raised inside ddpjob), HOW = "term"
  sends it SIGTERM (a preemption) instead of SIGUSR2; HOW = "pause" prints "paused at call N"
  and waits in this forward call until ddpjob's stop flag has a signal (or 120 s): the test sends
  the signal from outside (tests/ranks.py: signal_when_paused), and it lands in that very step. RANK falls back to SLURM_PROCID (submitit sets no RANK).
  DDPJOB_TEST_SNAP_WAIT=STEP: before HOW = "kill", wait until every rank's in-memory snapshot
  of STEP is committed (/dev/shm/ddpjob-<uid>/...; they are written in the background), so the
  restart's choice of snapshot is caused by the test, not by how fast a thread wrote.
  DDPJOB_TEST_SNAP_DIR: where to look instead of /dev/shm (checkpoint.snapshot_dir).
  DDPJOB_TEST_SLOW="SECONDS[:RESTART]" sleeps that long in every training forward call (of that
  incarnation only): stretches wall time without changing a single number.
- Stragglers, DDPJOB_TEST_STRAGGLE="RANK:CALL:HOW:SECONDS": from training forward call CALL on,
  rank RANK is slow by SECONDS per call. HOW = "compute": a busy-wait in the backward pass (a
  hook on the output's gradient); "data": a sleep in data loading (with the dataset plugin
  `trainer_plugins:slow_synthetic`, which waits before handing out a batch's first sample);
  "hog": SECONDS processes (0: three) spinning on the CPU this rank is pinned to, from that call on
  (the rank pins itself to its node's last core and every other rank to the first).
- DDPJOB_TEST_COPY_TEXTFILE="STEP,STEP,...": when `job.steps()` hands out each STEP, rank 0 copies
  its train.metrics_textfile to FILE.at-STEP, so a test reads the file as it was at that step.
"""


from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpjob.train.models import TinyCNN

if os.environ.get("DDPJOB_TEST_ACTIONS"):
    # The at-step actions of the real-SLURM tests for jobs that run the built-in trainer with a
    # model from this module. Imported only then: test_freeze copies this file alone as a plugin.
    import example_slurm_hooks

    example_slurm_hooks.install()


def _copy_textfile_at(steps: set[int]) -> None:
    import shutil

    from ddpjob import api

    inner = api.Job.steps

    def steps_copying(self: api.Job, state: dict[str, Any], total: int, **info: Any) -> Any:
        for step in inner(self, state, total, **info):
            if step in steps and self.is_rank0:
                path = self.run_dir / self.config.train.metrics_textfile
                shutil.copyfile(path, f"{path}.at-{step}")
            yield step

    api.Job.steps = steps_copying  # type: ignore[method-assign]


if os.environ.get("DDPJOB_TEST_COPY_TEXTFILE"):
    _copy_textfile_at({int(s) for s in os.environ["DDPJOB_TEST_COPY_TEXTFILE"].split(",")})


def conv_nobn(num_classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU(), nn.Conv2d(8, 16, 3, 2, 1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, num_classes))


class SignallingCNN(TinyCNN):
    def __init__(self, num_classes: int) -> None:
        super().__init__(num_classes)
        # Cheaper than cnn_tiny, same parameters and state_dict keys: each max-pool gives way to
        # a stride of 2 in the conv before it. The tests that use this model train thousands of
        # steps in all, and on a CPU core the pools cost more than the convs: a step of the
        # preemption tests' 4-rank job takes 47 ms instead of 86 on 2 cores.
        for i, layer in enumerate(self):
            if isinstance(layer, nn.MaxPool2d):
                self[i] = nn.Identity()
                conv = self[i - 3]
                assert isinstance(conv, nn.Conv2d), conv
                conv.stride = (2, 2)
        # Test-only plumbing: the node-side package never reads the environment outside
        # cluster.py, but a test plugin may.
        env = os.environ
        my_rank = env.get("RANK") or env.get("SLURM_PROCID") or "0"
        # the incarnation: the local supervisor's count, torchrun's round, else SLURM's plus the
        # template's runs inside the allocation after a crash (SLURM's count does not move then)
        my_restart = env.get("DDPJOB_RESTART_COUNT") or env.get("TORCHELASTIC_RESTART_COUNT") or str(
            int(env.get("SLURM_RESTART_COUNT") or 0) + int(env.get("DDPJOB_ATTEMPT") or 0))
        # several specs, comma-separated: the first for this rank and incarnation
        specs = [(s.split(":") + ["", "", "", ""])[:4] for s in env.get("DDPJOB_TEST_SIGNAL", "").split(",") if s]
        mine = [s for s in specs if s[0] == my_rank and s[2] in ("", my_restart)]
        rank, call, restart, self._how = mine[0] if mine else ("",) * 4
        self._armed = bool(mine)
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
                elif self._how == "term":  # SLURM's preemption signal
                    os.kill(os.getpid(), signal.SIGTERM)
                elif self._how == "crash":  # a rank raising: srun --kill-on-bad-exit ends the rest
                    raise RuntimeError(f"test crash at training forward call {self._calls}")
                elif self._how in ("kill", "segv"):  # kill -9 / a segfault: no ddpjob code runs on the way down
                    _wait_for_snapshots()
                    os.kill(os.getpid(), signal.SIGKILL if self._how == "kill" else signal.SIGSEGV)
                elif self._how == "internal":  # ddpjob's own bug: its per-step decision is broken,
                    # so the TypeError is raised in ddpjob's frame (rank/job.py), not in this file
                    from ddpjob.rank.decide import StepDecider

                    StepDecider.after_step = None  # type: ignore[assignment,method-assign]
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
    while len(list(Path(os.environ.get("DDPJOB_TEST_SNAP_DIR") or "/dev/shm").glob(pattern))) < world:
        if time.monotonic() > deadline:
            raise RuntimeError(f"trainer_plugins: no snapshot of step {step} on all {world} ranks in {timeout} s")
        time.sleep(0.02)


def signalling_cnn(num_classes: int = 10) -> nn.Module:
    return SignallingCNN(num_classes)


# ---------------------------------------------------------------- stragglers (DDPJOB_TEST_STRAGGLE)
def _straggle() -> tuple[bool, int, str, float]:
    """(this rank is the slow one, from which call, how, seconds per call: for "share", the
    share of its own compute). DDPJOB_TEST_STRAGGLE = "RANK:CALL:HOW:AMOUNT", RANK "*": every
    rank (the whole job slowed); HOW compute (a busy-wait of AMOUNT s in the backward pass),
    device (a sleep of AMOUNT s there: a slow GPU, whose rank's thread waits blocked in a
    synchronize, never runnable, so a loaded host's queue for its cores neither hides nor adds to it),
    share (AMOUNT x the CPU time of the step's own forward and backward so far, spent again at
    its end), data (a sleep of AMOUNT s per batch in the dataset), datashare (AMOUNT x the median
    CPU time of a step before, spent in the dataset per batch), datawait (a sleep of AMOUNT x the
    median wall-clock step before, per batch) or hog (AMOUNT CPU hogs on the rank's core, 0:
    three). CPU time, not wall time: on a busy host the extra work takes as long as real work would."""
    spec = os.environ.get("DDPJOB_TEST_STRAGGLE", "")
    if not spec:
        return False, 0, "", 0.0
    rank, call, how, secs = spec.split(":")
    me = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"
    return rank in (me, "*"), int(call), how, float(secs)


def _spin(seconds: float, clock: Any = time.perf_counter) -> None:
    """Busy-wait `seconds` of `clock`: wall time, or time.thread_time for that much work (a
    rank kept off its core meanwhile is slower still, as real extra work would be)."""
    end = clock() + seconds
    while clock() < end:
        pass


class StragglingCNN(SignallingCNN):
    """signalling_cnn, slow on one rank as DDPJOB_TEST_STRAGGLE says (compute or hog)."""

    def __init__(self, num_classes: int) -> None:
        super().__init__(num_classes)
        self._slow, self._from, self._how_slow, self._secs = _straggle()
        self._forwards = 0
        self._hog: Any = None
        self._began = 0.0  # this forward's start (share)
        if self._slow and self._how_slow == "share":
            # the first layer's weight gets its gradient about last: the step's compute is done
            next(self.parameters()).register_post_accumulate_grad_hook(self._share)
        if self._how_slow == "hog" and hasattr(os, "sched_setaffinity"):
            cores = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {cores[-1] if self._slow else cores[0]})

    def _share(self, _p: Any) -> None:
        if self._forwards >= self._from and self._began:
            _spin(self._secs * (time.thread_time() - self._began), time.thread_time)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._began = time.thread_time()  # share: this step's own work so far, in CPU time
        out = super().forward(x)
        if self.training and self._slow:
            self._forwards += 1
            if self._forwards >= self._from:
                if self._how_slow == "compute" and out.requires_grad:
                    out.register_hook(lambda g: (_spin(self._secs), g)[1])
                elif self._how_slow == "device" and out.requires_grad:
                    out.register_hook(lambda g: (time.sleep(self._secs), g)[1])
                elif self._how_slow == "hog" and self._hog is None:
                    import subprocess
                    import sys

                    core = str(sorted(os.sched_getaffinity(0))[-1])
                    # three spinners by default: against one, the scheduler's credit for the time
                    # the rank sleeps in its collectives leaves it ~1.5 times slower, the flagging
                    # threshold itself (a CI run missed it); against three, 2.5 times or more
                    # at nice -10 (about 9 times a nice-0 thread's share of the core) where we may:
                    # the scheduler then moves all other work, a stressed pass's included, to the
                    # other core, and rank 1 stays far slower than rank 0 however busy the host is
                    # (at nice 0, beside stress-ng and the cluster tier, both ranks queued alike and
                    # nothing was named)
                    self._hog = [subprocess.Popen(["taskset", "-c", core, sys.executable, "-c", "while True: pass"],
                                                  preexec_fn=_favoured)
                                 for _ in range(int(self._secs) or 3)]
                    import atexit

                    for hog in self._hog:
                        atexit.register(hog.kill)
        return out


def _favoured() -> None:
    """In a hog's child before exec: nice -10 where the user may raise priority (root), else as is."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    except OSError:
        pass


def straggling_cnn(num_classes: int = 10) -> nn.Module:
    return StragglingCNN(num_classes)


class _SlowSynthetic(torch.utils.data.Dataset):
    """A synthetic CIFAR-sized set whose samples come late on the straggling rank (data)."""

    def __init__(self, n: int, seed: int, batch: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(n, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self._slow, self._from, self._how_slow, self._secs = _straggle()
        self._batch, self._served = batch, 0
        self._batch_began: list[float] = []  # datashare: when each batch was asked for

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._served += 1
        batch_no = (self._served - 1) // self._batch + 1  # which batch of this rank (= forward call)
        if self._slow and (self._served - 1) % self._batch == 0:  # a batch begins
            if self._how_slow == "data" and batch_no >= self._from:
                time.sleep(self._secs)
            elif self._how_slow in ("datashare", "datawait"):
                # AMOUNT x the median step before: datashare as CPU work in the loader (a step
                # 1 + AMOUNT as long, busy or not), datawait as a sleep of that many times the
                # median wall-clock step (a slowdown relative to the run's own speed, whatever
                # the host's load was when the baseline was taken)
                clock = time.thread_time if self._how_slow == "datashare" else time.perf_counter
                began = self._batch_began
                if batch_no >= self._from and len(began) > 2:
                    gaps = sorted(b - a for a, b in zip(began, began[1:]))
                    if self._how_slow == "datashare":
                        _spin(self._secs * gaps[len(gaps) // 2], time.thread_time)
                    else:
                        time.sleep(self._secs * gaps[len(gaps) // 2])
                else:
                    began.append(clock())
        return self.x[i], self.y[i]


def slow_synthetic(root: str, train: bool) -> torch.utils.data.Dataset:
    """data.dataset = "trainer_plugins:slow_synthetic": 1024 train / 128 test samples; the batch
    size of the straggler tests' jobs (16) tells where a batch begins."""
    return _SlowSynthetic(1024 if train else 128, 1 if train else 2, int(os.environ.get("DDPJOB_TEST_BATCH", "16")))
