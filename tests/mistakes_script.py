"""A GPT-style training script on ddpjob's public API (gradient accumulation, a batch drawn from
the rank's own torch.Generator, an averaged log), for tests/ranks/test_mistake_lines.py: the
[user] key `mistake` makes it commit one of the mistakes ddpjob names with a line (rank/checks.py).

mistake: "" (none), "scaler" (an enabled GradScaler left out of state), "optimizer" (the optimizer left out of
state), "twice" (two job.log calls
of train values at one step), "master_log" (an averaged job.log on rank 0 only), "raw_generator"
(a torch.Generator in state as it is), "shared_generator" (the per-rank generator in state through
state_dict()/load_state_dict(), saved from rank 0 only), "per_rank" (the same generator through
ddpjob.PerRank: correct). Other [user] keys: steps, learning_rate (what `leraning_rate` misses), stop_at (rank 0 sends itself SIGUSR2
during that step).
Rank 0 prints "step N: K checkpoint(s)" as each step begins.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.nn as nn

import ddpjob


class Offsets:
    """The user's own per-rank batch offsets: a torch.Generator with state_dict() (a common wrap)."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.gen.set_state(state["gen"])


def main() -> None:
    job = ddpjob.init(sys.argv[1] if len(sys.argv) > 1 else None)
    mistake = str(job.user.get("mistake", ""))
    steps, lr = int(job.user.get("steps", 6)), float(job.user.get("learning_rate", 0.01))
    stop_at = int(job.user.get("stop_at", -1))
    torch.manual_seed(0)
    data = torch.randn(512, 8)
    model = job.wrap(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    offsets = Offsets(1000 + job.rank)
    state: dict = {"model": model, "optimizer": opt}
    if mistake == "optimizer":
        del state["optimizer"]
    if mistake == "scaler":
        scaler = torch.amp.GradScaler("cpu", enabled=True)  # noqa: F841 - used by the loop, not in state
    if mistake == "raw_generator":
        state["offsets"] = offsets.gen
    elif mistake == "shared_generator":
        state["offsets"] = offsets
    else:
        state["offsets"] = ddpjob.PerRank(offsets)
    job.resume(state)
    for step in job.steps(state, steps):
        if job.is_rank0:  # the test reads where each line fell against the checkpoints
            print(f"step {step}: {len(list(job.run_dir.glob('checkpoints/step-*')))} checkpoint(s)", flush=True)
        if step == stop_at and job.rank == 0:  # a stop caused at this step (as a preemption's signal)
            os.kill(os.getpid(), signal.SIGUSR2)
        for _ in range(2):  # gradient accumulation
            at = int(torch.randint(0, 500, (1,), generator=offsets.gen))
            x = data[at:at + 8]
            loss = ((model(x) - x) ** 2).mean() / 2
            loss.backward()
        opt.step()
        opt.zero_grad()
        if mistake == "master_log":
            if job.rank == 0:
                job.log(step + 1, average=True, loss=loss.detach())
        else:
            job.log(step + 1, average=True, loss=loss.detach())
        if mistake == "twice":
            job.log(step + 1, lr=lr)
    job.finish(model, at=int(torch.randint(0, 500, (1,), generator=offsets.gen)))


if __name__ == "__main__":
    main()
