"""What the trainer callbacks (hf.py, lightning.py) share: the job's stop settings, flag-only
signal handlers, the one all-reduce that makes every rank stop at the same step, rank 0's
metrics lines, and the exit with "requeue me".

Under ddpjob (`DDPJOB_RUN_DIR` set: a `[train] command` child) the settings come from the run's
config.json, the variables from rank/command.py; run elsewhere (plain torchrun) the defaults
apply and no metrics are written. torch is imported inside the functions that need it: a
callback module imports only its own trainer package at the top.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ddpjob.node import preemption

DEFAULT_SIGNALS = ("TERM", "USR2")  # [train] command_signal and [slurm] signal, by default
DEFAULT_REQUEUE_EXIT = 3  # [train] command_requeue_exit


@dataclass(frozen=True)
class Settings:
    """What a callback needs from the job: the signals that mean "stop" (SIGTERM always, the
    job's command_signal and SLURM's warning signal), the exit status that means "requeue me",
    the attempt number and where rank 0 appends its metrics lines (None: not under ddpjob)."""

    signals: tuple[str, ...] = DEFAULT_SIGNALS
    requeue_exit: int = DEFAULT_REQUEUE_EXIT
    attempt: int = 0
    metrics: Path | None = None
    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        signals: tuple[str, ...] = DEFAULT_SIGNALS
        requeue_exit = DEFAULT_REQUEUE_EXIT
        run_dir = env.get("DDPJOB_RUN_DIR")
        if run_dir and (Path(run_dir) / "config.json").is_file():
            from ddpjob import jobfile  # torch-free: the job file's schema

            cfg = jobfile.read_run_config(run_dir)
            signals = tuple(dict.fromkeys(("TERM", cfg.train.command_signal, cfg.slurm.signal)))
            requeue_exit = cfg.train.command_requeue_exit
        world = int(env.get("WORLD_SIZE", "1") or 1)
        return cls(signals=signals, requeue_exit=requeue_exit, attempt=int(env.get("DDPJOB_ATTEMPT", "0") or 0),
                   metrics=Path(env["DDPJOB_METRICS"]) if env.get("DDPJOB_METRICS") else None,
                   rank=int(env.get("RANK", "0") or 0), world_size=world,
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world)) or world))


class StopSignals:
    """The stop signals' handlers while the trainer runs: each only records that a signal came
    (ddpjob's own StopFlag, which also keeps forked DataLoader workers deaf to them). Nothing is
    saved or sent inside a handler: a collective there races the training step's own (how
    Lightning's handler hangs, Lightning issue #21406). `uninstall` puts back what was there."""

    def __init__(self, signals: tuple[str, ...]) -> None:
        self.signals = signals
        self.flag: preemption.StopFlag | None = None

    def install(self) -> None:
        if self.flag is None:
            self.flag = preemption.StopFlag.install(self.signals)

    def ours(self) -> bool:
        """Whether our handler is still the one for every stop signal (a trainer may have put its
        own back in between)."""
        return self.flag is not None and all(
            getattr(signal.getsignal(preemption.signal_number(s)), "__self__", None) is self.flag
            for s in self.signals)

    def requested(self) -> bool:
        return self.flag is not None and self.flag.code != preemption.NONE

    def uninstall(self) -> None:
        if self.flag is not None:
            self.flag.uninstall()
        self.flag = None


def agree(flag: bool) -> bool:
    """Every rank's flag combined (MAX): one all-reduce of one number per step, so that all ranks
    stop after the same step. Outside a process group of several, the flag itself."""
    import torch

    from ddpjob.node import dist  # every collective of ddpjob's goes through node/dist.py or a sibling

    if not dist.group_active():
        return flag
    on_gpu = torch.distributed.get_backend() == "nccl"  # NCCL reduces only CUDA tensors
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    vote = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    return bool(dist.all_reduce_(vote, "max", what="the callback's stop vote").item())


def barrier() -> None:
    from ddpjob.node import dist

    dist.barrier(what="the callback's save")


class Metrics:
    """Rank 0's lines in DDPJOB_METRICS (docs/commands.md): one `train` line per optimizer step
    (step, the attempt, the step's end time, loss and lr where known) and one `checkpoint` line
    per save, so that `status`, goodput, `plot` and the trackers know the real step."""

    def __init__(self, settings: Settings) -> None:
        self.path = settings.metrics if settings.rank == 0 else None
        self.attempt = settings.attempt
        self.pending: dict[str, Any] | None = None  # the last step's line, until its loss is known

    def step(self, step: int, **scalars: float | None) -> None:
        self.flush()
        self.pending = {"kind": "train", "step": int(step), "restart": self.attempt, "time": time.time(),
                        **{k: float(v) for k, v in scalars.items() if v is not None}}

    def add(self, step: int, **scalars: float | None) -> None:
        """Scalars the trainer reports later in the same step (HF logs its loss after step end)."""
        if self.pending is not None and self.pending["step"] == step:
            self.pending.update({k: float(v) for k, v in scalars.items() if v is not None})

    def checkpoint(self, step: int, path: str | Path) -> None:
        self.flush()
        self._write({"kind": "checkpoint", "step": int(step), "restart": self.attempt, "time": time.time(),
                     "path": str(path)})

    def end(self, step: int) -> None:
        """The trainer's run ended by itself at `step` (not by a stop): what the process does
        after is its interpreter's end (rank/command_end.py reads a teardown abort after it)."""
        self.flush()
        self._write({"kind": "end", "step": int(step), "restart": self.attempt, "time": time.time()})

    def flush(self) -> None:
        if self.pending is not None:
            line, self.pending = self.pending, None
            self._write(line)

    def _write(self, line: dict[str, Any]) -> None:
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")


_freeze_registered = False


def freeze_at_exit() -> None:
    """The trainer's run ended normally: when the interpreter ends (once per process, after the
    user's code that follows `train()` / `fit()`), its final garbage collection passes over what
    is still alive (gc.freeze, as ddpjob's own close() does; the kernel frees the memory and
    closes the sockets). Why: the Trainer and Lightning leave the process group standing, held by
    their DDP wrapper in reference cycles, and that collection frees it while its gloo threads
    run: "terminate called without an active exception", SIGABRT after "done at step 300".
    Measured on a 1-rank gloo group with a comm hook's callback still running at exit: 4 of 8
    ends aborted without this, 10 of 12 with destroy_process_group() at exit, 0 of 12 with this;
    with transformers imported it still aborted 1 time in 10, which rank/command_end.py reads as
    done after the callback's `end` line."""
    global _freeze_registered
    if not _freeze_registered:
        _freeze_registered = True
        atexit.register(gc.freeze)


def leave(code: int, why: str) -> None:
    """End this process with `code` now, its output and log handlers flushed, without the
    interpreter's teardown: with the process group and DDP's reducer still alive it sometimes
    aborts in torch's C++ destructors (SIGABRT instead of the status, as ddpjob's own
    node/dist.end_if_left_standing says). Code after `trainer.train()` / `fit()` does not run
    on a stop: the run is not done, its final save or evaluation would be wrong."""
    from ddpjob.node import dist

    print(why, file=sys.stderr, flush=True)
    logging.shutdown()
    dist.exit_now(code)
