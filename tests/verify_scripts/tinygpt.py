"""A tiny GPT-style training script on ddpjob (gradient accumulation, random windows of a token
stream, dropout), and the mistakes that break an exact resume, chosen with [user] mistake:

    ""                  right: every batch drawn from ddpjob's RNG inside the step
    prefetch            nanoGPT's: the first batch drawn before the loop, the next one while
                        this step computes, held in a variable no checkpoint sees
    own_generator       a torch.Generator per rank for the batch offsets, outside `state`
    generator_in_state  that generator put into `state` through a state_dict() wrapper: rank 0's
                        is saved and loaded into every rank
    per_rank            right again: the generator in `state` as ddpjob.PerRank(gen), each rank's
                        saved and restored as its own

tests/ranks/test_verify_ranks.py runs `ddpjob verify` on each (tinygpt.toml).
"""

from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

import ddpjob

job = ddpjob.init()
cfg = job.user
mistake = cfg["mistake"]
BLOCK, VOCAB, WIDTH, ACCUM = 16, 32, 32, 2
data = torch.randint(0, VOCAB, (4096,), generator=torch.Generator().manual_seed(1))
torch.manual_seed(0)  # the same initial weights on every rank


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(BLOCK, WIDTH)
        self.mix, self.drop, self.head = nn.Linear(WIDTH, WIDTH), nn.Dropout(0.1), nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.tok(x) + self.pos(torch.arange(x.shape[1])))
        return self.head(h + F.gelu(self.mix(h)))


class RankGenerator:
    """The hint's wrapper: state_dict()/load_state_dict() around a per-rank generator."""

    def __init__(self, g: torch.Generator) -> None:
        self.g = g

    def state_dict(self) -> dict:
        return {"state": self.g.get_state()}

    def load_state_dict(self, d: dict) -> None:
        self.g.set_state(d["state"])


model = job.wrap(TinyGPT())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
gen = torch.Generator().manual_seed(100 + job.rank)  # each rank its own offsets
state = {"model": model, "optimizer": optimizer}
if mistake == "generator_in_state":
    state["gen"] = RankGenerator(gen)
elif mistake == "per_rank":
    state["gen"] = ddpjob.PerRank(gen)


def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = gen if mistake in ("own_generator", "generator_in_state", "per_rank") else None  # None: ddpjob's RNG
    ix = torch.randint(len(data) - BLOCK - 1, (8,), generator=g)
    return (torch.stack([data[i:i + BLOCK] for i in ix]), torch.stack([data[i + 1:i + 1 + BLOCK] for i in ix]))


job.resume(state)
if mistake == "prefetch":
    X, Y = get_batch()
for step in job.steps(state, cfg["max_steps"]):
    total = 0.0
    for micro in range(ACCUM):
        if mistake != "prefetch":
            X, Y = get_batch()
        sync = model.no_sync() if micro < ACCUM - 1 and hasattr(model, "no_sync") else nullcontext()
        with sync:
            loss = F.cross_entropy(model(X).flatten(0, 1), Y.flatten()) / ACCUM  # a mean over the micro-steps
            if mistake == "prefetch":
                X, Y = get_batch()  # the next batch, drawn while this one is in flight
            loss.backward()
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    job.log(step + 1, average=["loss"], loss=total)
job.finish(model)
