"""Small loops in the styles of real training scripts, each right or with one mistake users make,
for `ddpjob verify` (tests/ranks/test_verify_corpus.py). [user] style picks the loop, [user]
mistake the mistake ("" is the right loop):

lm      an epoch-structured language model (a GRU over a token stream split by rank, as
        PyTorch's word_language_model): a hidden state carried from step to step, evaluation and
        an lr annealed at each epoch's last step. Mistakes: lr_outside (the annealed lr kept in a
        variable that restarts at its initial value), epoch_outside (an epoch counter outside
        `state`, logged), iterator_restart (the batches from a generator made before the loop,
        which starts again at batch 0), hidden_reinit (the hidden state outside `state`).
gpt     nanoGPT's loop: random windows, gradient accumulation, AdamW, a cosine lr from the
        step, best_val_loss, a timer and a local step counter (harmless, as in nanoGPT).
        Mistakes: prefetch (a batch drawn before the loop and at the end of each step),
        own_generator / numpy_generator / random_generator (the rank's own generator for the
        offsets, outside `state`), per_rank_object (that torch generator in `state` through a
        state_dict() wrapper: rank 0's is loaded into every rank), per_rank_value (the rank's own
        data cursor as a plain value of `state`), unseeded (offsets from an unseeded generator).
vision  a small conv net on images through a StepSampler, AdamW, a StepLR, everything in
        `state`. Mistakes: optimizer_missing, scheduler_missing, scaler_missing (an enabled
        GradScaler near fp32's range, meant to skip steps: verify found its 10 steps exact
        all the same, so the test leaves it out; the GradScaler line at resume() names it), world_lr (the lr set at each step
        from the world size: a real world-size dependence).
"""

from __future__ import annotations

import math
import random
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import ddpjob

job = ddpjob.init()
cfg = job.user
style, mistake, total = cfg["style"], cfg["mistake"], cfg["max_steps"]
torch.manual_seed(0)  # the same initial weights on every rank


class Holder:
    """A tensor of the loop's (the carried hidden state) with state_dict()/load_state_dict()."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def state_dict(self) -> dict:
        return {"tensor": self.tensor}

    def load_state_dict(self, d: dict) -> None:
        self.tensor = d["tensor"]


class Cursor:
    """A generator as an object with state_dict(): the hint's wrapper, saved from rank 0 only."""

    def __init__(self, g: torch.Generator) -> None:
        self.g = g

    def state_dict(self) -> dict:
        return {"state": self.g.get_state()}

    def load_state_dict(self, d: dict) -> None:
        self.g.set_state(d["state"])


# ---------------------------------------------------------------- lm: epochs, a carried hidden state
def lm() -> None:
    vocab, bptt, bsz, width, steps_per_epoch = 16, 6, 3, 24, 3
    stream = torch.randint(0, vocab, (job.world_size * bsz * (steps_per_epoch * bptt + 1),),
                           generator=torch.Generator().manual_seed(1))
    data = stream.view(job.world_size * bsz, -1)[job.rank * bsz:(job.rank + 1) * bsz].t()  # this rank's columns

    class RNNModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.rnn, self.head = nn.Embedding(vocab, width), nn.GRU(width, width), nn.Linear(width, vocab)

        def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out, h = self.rnn(self.embed(x), h)
            return self.head(out), h

    model = job.wrap(RNNModel())
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    carried = Holder(torch.zeros(1, bsz, width)) if mistake != "hidden_reinit" else None
    state: dict = {"model": model, "optimizer": optimizer}
    if carried is not None:
        state["hidden"] = ddpjob.PerRank(carried)  # each rank carries its own columns' state
    if mistake != "epoch_outside":
        state["epoch"] = 0

    def batches():  # the batches of every epoch in order, as a user's generator function
        for _ in range(10 ** 6):
            for i in range(steps_per_epoch):
                yield data[i * bptt:(i + 1) * bptt], data[i * bptt + 1:(i + 1) * bptt + 1]

    job.resume(state)
    lr = cfg["lr"] if mistake == "lr_outside" else optimizer.param_groups[0]["lr"]
    epoch = state.get("epoch", 0) if mistake != "epoch_outside" else 0
    hidden = carried.tensor if carried is not None else torch.zeros(1, bsz, width)
    source = batches() if mistake == "iterator_restart" else None
    best_val_loss = None
    for step in job.steps(state, total):
        x, y = next(source) if source is not None else next(
            b for i, b in enumerate(batches()) if i == step % steps_per_epoch)
        for g in optimizer.param_groups:
            g["lr"] = lr
        out, hidden = model(x, hidden)
        loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        optimizer.step()
        hidden = hidden.detach()  # carried on, cut from the graph (repackage_hidden)
        if carried is not None:
            carried.tensor = hidden
        job.log(step + 1, average=["loss"], loss=loss.detach(), lr=lr, epoch=epoch)
        if (step + 1) % steps_per_epoch == 0:  # the epoch's last step: evaluate, anneal
            with torch.no_grad():
                val = F.cross_entropy(model(data[:bptt], torch.zeros(1, bsz, width))[0].flatten(0, 1),
                                      data[1:bptt + 1].flatten())
            best_val_loss = val.item() if best_val_loss is None else min(best_val_loss, val.item())
            lr, epoch = lr / 4, epoch + 1
            if mistake != "lr_outside":  # into the optimizer now: a checkpoint may come before the next step
                for g in optimizer.param_groups:
                    g["lr"] = lr
            if "epoch" in state:
                state["epoch"] = epoch
    job.finish(model)


# ---------------------------------------------------------------- gpt: nanoGPT's loop
def gpt() -> None:
    block, vocab, width, accum, batch = 8, 24, 24, 2, 4
    data = torch.randint(0, vocab, (2048,), generator=torch.Generator().manual_seed(1))

    class TinyGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(block, width)
            self.mix, self.drop, self.head = nn.Linear(width, width), nn.Dropout(0.1), nn.Linear(width, vocab)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.drop(self.tok(x) + self.pos(torch.arange(x.shape[1])))
            return self.head(h + F.gelu(self.mix(h)))

    model = job.wrap(TinyGPT())
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    gen = torch.Generator().manual_seed(100 + job.rank)
    np_rng = np.random.default_rng(None if mistake == "unseeded" else 100 + job.rank)
    py_rng = random.Random(100 + job.rank)
    state: dict = {"model": model, "optimizer": optimizer}
    if mistake == "per_rank_object":
        state["offsets"] = Cursor(gen)
    elif mistake == "per_rank_value":
        state["cursor"] = 37 * job.rank

    def offsets() -> torch.Tensor:
        n = len(data) - block - 1
        if mistake in ("own_generator", "per_rank_object"):
            return torch.randint(n, (batch,), generator=gen)
        if mistake in ("numpy_generator", "unseeded"):
            return torch.from_numpy(np_rng.integers(0, n, size=batch))
        if mistake == "random_generator":
            return torch.tensor([py_rng.randrange(n) for _ in range(batch)])
        if mistake == "per_rank_value":
            state["cursor"] = (state["cursor"] * 5 + 11) % n
            return torch.arange(batch) * 3 + state["cursor"]
        return torch.randint(n, (batch,))  # ddpjob's RNG, restored at a resume

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = offsets()
        return torch.stack([data[i:i + block] for i in ix]), torch.stack([data[i + 1:i + 1 + block] for i in ix])

    def get_lr(it: int) -> float:  # nanoGPT's: warmup, then cosine, a function of the step
        if it < 2:
            return cfg["lr"] * (it + 1) / 2
        return cfg["lr"] * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (it - 2) / max(1, total - 2)))))

    iter_num = job.resume(state)
    best_val_loss, local_iter_num, t0 = 1e9, 0, time.time()
    if mistake == "prefetch":
        X, Y = get_batch()  # fetch the very first batch
    for step in job.steps(state, total):
        lr = get_lr(step)
        for g in optimizer.param_groups:
            g["lr"] = lr
        if step % 4 == 0:  # evaluation: harmless to the training, as in nanoGPT
            with torch.no_grad():
                val = F.cross_entropy(model(data[:block][None]).flatten(0, 1), data[1:block + 1]).item()
            best_val_loss = min(best_val_loss, val)
        total_loss = 0.0
        for micro in range(accum):
            if mistake != "prefetch":
                X, Y = get_batch()
            loss = F.cross_entropy(model(X).flatten(0, 1), Y.flatten()) / accum
            if mistake == "prefetch":
                X, Y = get_batch()  # async prefetch of the next batch while the model runs
            loss.backward()
            total_loss += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t1 = time.time()
        dt, t0 = t1 - t0, t1
        job.log(step + 1, average=["loss"], loss=total_loss, lr=lr)
        iter_num, local_iter_num = iter_num + 1, local_iter_num + 1
    job.finish(model)


# ---------------------------------------------------------------- vision: images, AdamW, a schedule
def vision() -> None:
    images = torch.randn(96, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 4, (96,), generator=torch.Generator().manual_seed(2))
    model = job.wrap(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Dropout(0.1),
                                   nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 4)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    # near fp32's range and doubling at every step: its scale overflows by the third step, and
    # every step from there is skipped; a scaler started again takes two more steps
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 126, growth_interval=1,
                                  enabled=mistake == "scaler_missing")
    sampler = ddpjob.StepSampler(len(images), 8, seed=3)
    state: dict = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}
    if mistake == "optimizer_missing":
        del state["optimizer"], state["scheduler"]  # a scheduler in state needs its optimizer there
    elif mistake == "scheduler_missing":
        del state["scheduler"]
    job.resume(state)
    for step in job.steps(state, total):
        if mistake == "world_lr":  # the linear scaling rule, the schedule by hand: lr from the world size
            for g in optimizer.param_groups:
                g["lr"] = cfg["lr"] * job.world_size * 0.5 ** (step // 3)
        ids = sampler.indices(step)
        loss = F.cross_entropy(model(images[ids]), labels[ids])
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        job.log(step + 1, average=["loss"], loss=loss.detach(), lr=optimizer.param_groups[0]["lr"])
    job.finish(model)


{"lm": lm, "gpt": gpt, "vision": vision}[style]()
