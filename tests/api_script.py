"""A user script on ddpjob's public API, for tests/ranks/test_api.py: a small regression MLP with
dropout (so the RNG matters), AdamW + a LambdaLR scheduler, a map-style dataset through a plain
DataLoader with a StepSampler, a stateful object of the user's own and a plain value.

[user] keys: steps, global_batch, workers, signal_at (rank:step, e.g. "1:7": that rank sends
itself SIGUSR2 during that step: the stop is caused at that step, not by a timer), stall_at
(rank:step[:after]: that rank stops making progress in that step, before its backward pass
or, with ":after", after its optimizer step, and prints "stalled at <unix time>"), raise_at
(rank:step: that rank raises ValueError in that step, before its backward pass, while its
peers go on into DDP's all-reduce), die_at (rank:step: in the first incarnation only, that rank
SIGKILLs itself in that step, before its backward pass: kill -9, no code of ours runs), job (a
job file for runs started alone).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

import ddpjob


class Points(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(123)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.linspace(-1, 1, 8) + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class Counter:
    """The user's own state: how many samples this run has trained on."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = int(state["seen"])


def stall() -> None:
    print(f"stalled at {time.time()}", flush=True)
    threading.Event().wait()  # a deadlock in the user's code: never returns


def main() -> None:
    job = ddpjob.init(sys.argv[1] if len(sys.argv) > 1 else None)
    u = job.user
    steps, global_batch = int(u.get("steps", 20)), int(u.get("global_batch", 16))
    torch.manual_seed(0)
    model = job.wrap(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    data = Points(256)
    sampler = ddpjob.StepSampler(len(data), global_batch, seed=3)
    counter = Counter()
    state = {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler,
             "counter": counter, "note": "fresh"}
    job.resume(state)
    batches = iter(DataLoader(data, batch_sampler=sampler, num_workers=int(u.get("workers", 0))))
    who, _, when = str(u.get("signal_at", "")).partition(":")
    stall_rank, _, stall_step = str(u.get("stall_at", "")).partition(":")
    stall_step, _, stall_after = stall_step.partition(":")
    raise_rank, _, raise_step = str(u.get("raise_at", "")).partition(":")
    die_rank, _, die_step = str(u.get("die_at", "")).partition(":")
    for step in job.steps(state, steps):
        x, y, ids = next(batches)
        if who and int(who) == job.rank and int(when) == step and job.restart == 0:
            os.kill(os.getpid(), signal.SIGUSR2)  # arrives mid-step, like SLURM's warning
        loss = nn.functional.mse_loss(model(x).squeeze(1), y)
        if stall_rank and int(stall_rank) == job.rank and int(stall_step) == step and not stall_after:
            stall()
        if die_rank and int(die_rank) == job.rank and int(die_step) == step and job.restart == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if raise_rank and int(raise_rank) == job.rank and int(raise_step) == step:
            raise ValueError(f"a bug in the user's code at step {step}")
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if stall_rank and int(stall_rank) == job.rank and int(stall_step) == step and stall_after:
            stall()
        counter.seen += len(ids)
        state["note"] = f"at {step + 1}"
        logged = job.log(step + 1, average=["loss"], loss=loss, lr=sched.get_last_lr()[0])
        assert isinstance(logged["loss"], float)
        job.log_samples(step + 1, sampler.epoch_of(step), ids)
    job.finish(model, seen=counter.seen, note=state["note"])


if __name__ == "__main__":
    main()
