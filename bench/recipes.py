"""The reference arms: what people write by hand, measured against ddpjob in suite.py.

`bare_ddp` is the hand-written DDP loop of P1 (the trainer's exact computation with the data
already in tensors, so its loss trace must equal the trainer's bit for bit); `seeds` is the
recipe from the project's seeds (torchvision ResNet-18, PIL transforms, DataLoader +
DistributedSampler, fp32) for P2; `pil_loader` is that data pipeline alone for P3. Each
builder runs once per worker process and returns the function that runs one trial.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn as nn

from ddpjob.config import JobConfig
from ddpjob.node.dist import DistContext
from ddpjob.train import arrays, data, models
from ddpjob.train.tensorloader import TensorLoader

from bench.marks import Marks

Trial = Callable[[dict[str, Any]], dict[str, Any]]


def _amp_dtype(cfg: JobConfig) -> torch.dtype | None:
    from ddpjob.train.trainer import amp_dtype_for  # the same precision choice, nothing else

    return amp_dtype_for(cfg.train.amp, torch.device("cpu"))


def _record(marks: Marks, losses: dict[str, float], step: int, loss: torch.Tensor,
            rank: int, world: int) -> None:
    """What a hand-written loop logs: the mean loss over ranks (one all-reduce), printed by
    rank 0 (the trainer's log line costs the same); then the step's mark."""
    loss = loss.detach().to(torch.float64)  # averaged in float64, as the trainer's job.log does
    if world > 1:
        tdist.all_reduce(loss)
        loss /= world
    losses[str(step)] = value = float(loss.item())
    if rank == 0:
        print(f"step {step} loss {value:.4f}", flush=True)
    marks.mark(step)


def time_batches(batches: Any, n: int) -> dict[str, Any]:
    """Marks around each of `n` batches of an iterator (P3: "step" i = batch i), and the
    images per batch."""
    marks, it = Marks(), iter(batches)
    marks.mark(0)
    for i in range(n):
        x, _ = next(it)
        marks.mark(i + 1)
    return {"marks": marks, "batch": len(x)}


# ------------------------------------------------------------------------------ P1: bare DDP
def bare_ddp(spec: dict[str, Any], ctx: DistContext) -> Trial:
    """Hand-written DDP loop: same model, optimizer, precision and batches as the trainer."""
    from ddpjob import jobfile

    cfg = jobfile.from_json(spec["config"])
    t, rank, world = cfg.train, ctx.env.rank, ctx.env.world_size
    total = t.max_steps
    train = data.load_cifar10(cfg.data.root, train=True)
    loader = TensorLoader(train, micro_batch=t.batch_size, accumulation=1, rank=rank,
                               world_size=world, seed=t.seed, augment=cfg.data.augment,
                               channels_last=t.channels_last)
    # The data already in tensors: every batch of the run, made before the clock starts.
    batches = [mb[0] for mb in itertools.islice(loader.batches(0), total)]
    steps_per_epoch, amp = loader.steps_per_epoch, _amp_dtype(cfg)
    warmup = t.warmup_steps or round(t.warmup_epochs * steps_per_epoch)
    fmt = torch.channels_last if t.channels_last else torch.contiguous_format

    def lr_at(step: int) -> float:  # linear warmup, then cosine to zero
        if warmup > 0 and step < warmup:
            return t.lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, total - warmup)
        return t.lr * 0.5 * (1.0 + math.cos(math.pi * min(frac, 1.0)))

    def trial(params: dict[str, Any]) -> dict[str, Any]:
        torch.manual_seed(t.seed)
        model = models.build_model(t.model, t.num_classes, cifar_stem=t.cifar_stem)
        model.to(memory_format=fmt)
        decay = [p for p in model.parameters() if p.ndim > 1]
        no_decay = [p for p in model.parameters() if p.ndim <= 1]
        optimizer = torch.optim.SGD([{"params": decay, "weight_decay": t.weight_decay},
                                     {"params": no_decay, "weight_decay": 0.0}],
                                    lr=t.lr, momentum=t.momentum, nesterov=t.nesterov, fused=True)
        ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
        loss_fn = nn.CrossEntropyLoss(label_smoothing=t.label_smoothing)
        marks = Marks()
        losses: dict[str, float] = {}
        for step, (x, y) in enumerate(batches):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            with torch.autocast("cpu", dtype=amp or torch.float32, enabled=amp is not None):
                loss = loss_fn(ddp(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if (step + 1) % t.log_every == 0:
                _record(marks, losses, step + 1, loss, rank, world)
        return {"marks": marks, "loss": losses}

    return trial


# --------------------------------------------------------------------- P2/P3: the seeds' way
def _pil_dataset(root: str) -> Any:
    """torchvision's CIFAR10 dataset and transforms, as the seeds use them. (No md5s: the
    benchmark writes its own CIFAR-10-format files; torchvision skips the check for None.)"""
    import torchvision
    import torchvision.transforms as T

    class LocalCIFAR10(torchvision.datasets.CIFAR10):
        train_list = [[f"data_batch_{i}", None] for i in range(1, 6)]
        test_list = [["test_batch", None]]
        meta = {"filename": "batches.meta", "key": "label_names", "md5": None}

    transform = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
                           T.Normalize(arrays.CIFAR10_MEAN, arrays.CIFAR10_STD)])
    return LocalCIFAR10(root=root, train=True, download=False, transform=transform)


def _pil_loader(root: str, batch: int, rank: int, world: int, seed: int) -> Any:
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    ds = _pil_dataset(root)
    sampler: DistributedSampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True,
                                                     seed=seed)
    # num_workers=0: each rank owns one core; worker processes would only share it.
    return DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=0, drop_last=True), sampler


def seeds(spec: dict[str, Any], ctx: DistContext) -> Trial:
    """The seeds' recipe: torchvision ResNet-18 (10 classes), PIL transforms, DataLoader +
    DistributedSampler, fp32, plain SGD with momentum."""
    import torchvision
    from ddpjob import jobfile

    cfg = jobfile.from_json(spec["config"])
    t, rank, world = cfg.train, ctx.env.rank, ctx.env.world_size
    loader, sampler = _pil_loader(cfg.data.root, t.batch_size, rank, world, t.seed)

    def trial(params: dict[str, Any]) -> dict[str, Any]:
        torch.manual_seed(t.seed)
        model = torchvision.models.resnet18(num_classes=t.num_classes)
        ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
        optimizer = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum,
                                    weight_decay=t.weight_decay)
        criterion = nn.CrossEntropyLoss()
        sampler.set_epoch(params.get("trial", 0))
        marks = Marks()
        losses: dict[str, float] = {}
        for step, (x, y) in enumerate(itertools.islice(loader, t.max_steps)):
            optimizer.zero_grad()
            loss = criterion(ddp(x), y)
            loss.backward()
            optimizer.step()
            if (step + 1) % t.log_every == 0:
                _record(marks, losses, step + 1, loss, rank, world)
        return {"marks": marks, "loss": losses}

    return trial


def pil_loader(spec: dict[str, Any], ctx: DistContext) -> Trial:
    """P3's reference: the seeds' per-sample PIL pipeline alone, `batches` batches per trial."""
    from ddpjob import jobfile

    cfg = jobfile.from_json(spec["config"])
    loader, sampler = _pil_loader(cfg.data.root, cfg.train.batch_size, 0, 1, cfg.train.seed)

    def trial(params: dict[str, Any]) -> dict[str, Any]:
        sampler.set_epoch(params.get("trial", 0))
        return time_batches(((x, y) for x, y in loader), params["batches"])

    return trial
