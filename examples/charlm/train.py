"""A character-level language model (a GRU) on examples/charlm/data/tiny.txt, trained with ddpjob.

    ddpjob submit examples/charlm/job.toml --backend local --wait
    torchrun --nproc-per-node 2 examples/charlm/train.py        # a new run dir under ./runs/

Every setting is in job.toml's [user] table (`--set user.lr=3e-3`). The data order comes from a
StepSampler, so the job can be stopped at any step and resumed, also on another number of ranks.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import ddpjob

# ---- the job: rank, device, run dir and the [user] settings (under `ddpjob run`: its job file)
job = ddpjob.init(os.path.join(os.path.dirname(__file__), "job.toml"))
cfg = job.user
torch.manual_seed(cfg["seed"])  # every rank builds the same initial weights


# ---- data: every `stride`-th window of `context` + 1 characters, a map-style dataset
class Windows(Dataset):
    def __init__(self, ids: torch.Tensor, context: int, stride: int) -> None:
        self.ids, self.context, self.stride = ids, context, stride

    def __len__(self) -> int:
        return (len(self.ids) - self.context - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[i * self.stride:i * self.stride + self.context + 1]
        return chunk[:-1], chunk[1:]  # input, and the next character at each position


path = os.path.join(os.path.dirname(__file__), cfg["data"])  # relative to this script
text = open(path, encoding="utf-8").read()
vocab = sorted(set(text))
ids = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
dataset = Windows(ids, cfg["context"], cfg["stride"])


# ---- model: embedding -> GRU -> logits over the vocabulary
class CharGRU(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.drop = nn.Dropout(dropout)
        self.gru = nn.GRU(hidden, hidden, layers, batch_first=True, dropout=dropout if layers > 1 else 0.0)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(self.drop(self.embed(x)))
        return self.head(self.drop(out))


raw = CharGRU(len(vocab), cfg["hidden"], cfg["layers"], cfg["dropout"])
model = job.wrap(raw)  # to the device, DDP (or sharded in place: [train] strategy = "fsdp")
optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])

# ---- the data order: the global batch of step g is a function of (seed, g) at any world size
sampler = ddpjob.StepSampler(len(dataset), cfg["batch_size"], cfg["seed"])
total = cfg["max_steps"] or cfg["epochs"] * sampler.steps_per_epoch
# [user] keys used only late (cosine's warmup, the final sample) are read here: ddpjob names the
# keys a script has not read by its first checkpoint (a typo trains at a default without a word)
warmup, sample_chars = cfg["warmup_steps"], cfg["sample_chars"]


# ---- the LR schedule, chosen in [user]: onecycle, or cosine with a linear warmup
def warmup_cosine(step: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


if cfg["schedule"] == "onecycle":
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg["lr"], total_steps=total)
elif cfg["schedule"] == "cosine":
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
else:
    raise SystemExit(f"charlm: user.schedule is {cfg['schedule']!r}, expected onecycle or cosine")

# ---- resume last (building the model drew random numbers), then make the loader's iterator
state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}
start = job.resume(state)
batches = iter(DataLoader(dataset, batch_sampler=sampler, num_workers=cfg["num_workers"]))
if job.is_rank0:
    print(f"charlm: {len(text)} characters, vocabulary {len(vocab)}, {len(dataset)} windows, "
          f"{sampler.steps_per_epoch} steps/epoch, steps {start}..{total}, {job.world_size} rank(s)")

# ---- the loop: job.steps() votes on stopping and saves checkpoints between steps
model.train()
logged: dict = {}
for step in job.steps(state, total):
    x, y = next(batches)
    logits = model(x.to(job.device))
    loss = F.cross_entropy(logits.flatten(0, 1), y.to(job.device).flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
    optimizer.step()
    scheduler.step()
    logged = job.log(step + 1, average=["loss"], loss=loss, lr=scheduler.get_last_lr()[0],
                     epoch=sampler.epoch_of(step))
    if cfg["log_sample_ids"]:  # for exactly-once checks: samples/rank-R.jsonl
        job.log_samples(step + 1, sampler.epoch_of(step), sampler.indices(step))
    if job.is_rank0 and ((step + 1) % cfg["print_every"] == 0 or step + 1 == total):
        print(f"step {step + 1}/{total} loss {logged['loss']:.4f} lr {logged['lr']:.2e}", flush=True)


# ---- the end: a short sample, printed by rank 0 (its own generator: no training RNG is touched)
@torch.no_grad()
def generate(prompt: str, n: int) -> str:
    raw.eval()
    gen = torch.Generator().manual_seed(cfg["seed"])
    x = torch.tensor([[vocab.index(c) for c in prompt]], device=job.device)
    for _ in range(n):
        probs = F.softmax(raw(x[:, -cfg["context"]:])[0, -1].float().cpu(), dim=-1)
        x = torch.cat([x, torch.multinomial(probs, 1, generator=gen).to(job.device)[None]], dim=1)
    return "".join(vocab[i] for i in x[0].tolist())


sample = generate("The ", sample_chars)  # every rank: with strategy fsdp a forward is a collective
if job.is_rank0:
    print("sample:", sample, flush=True)
job.finish(raw, loss=logged.get("loss"))  # RUN_DIR/final/model.pt and the COMPLETED marker
