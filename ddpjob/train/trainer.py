"""The built-in trainer: a client of ddpjob's public API (api.py) like any user script.

`main()` is the default `train.entry`; `fit(job)` reads top to bottom (build, resume, loop,
finish) and `train_step()` is one optimizer step (accumulation with no_sync, autocast, scaler,
clip). The stop vote, checkpoints, requeue and resume all come from `job`: nothing here is a
private shortcut.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import ddpjob
from ddpjob.train import data, models, syncbn
from ddpjob.train.precision import (CUDA_GRAPH_MODES, amp_dtype_for, compile_mode_for, dtype_name,
                                    resolve_auto_amp)
from ddpjob.api import Job
from ddpjob.config import JobConfig, accumulation_for
from ddpjob.errors import DDPJobError
from ddpjob.node.metrics import Meter, Progress as Bar

Batch = tuple[torch.Tensor, torch.Tensor]


def main() -> None:
    """The built-in trainer as an entry: `train.entry = ""` (the default) runs this."""
    fit(ddpjob.init())


@dataclass
class FitResult:
    step: int
    total_steps: int
    accuracy: float | None = None
    resumed_from: int | None = None
    vote_s: float = 0.0  # time spent in the per-step stop all-reduce (reported by benchmarks)
    steps_run: int = 0


@dataclass
class Progress:
    """The trainer's own state, checkpointed like the model (torchtitan's idea): the global
    batch that defines "step N" at any world size, and the evaluation record."""

    global_batch: int = 0
    # what train.amp = "auto" chose when the run began ("bf16" or "off"): kept, so a resumed run
    # computes in the same precision whatever a new measurement would say
    amp: str | None = None
    best_acc: float | None = None
    last_eval_acc: float | None = None
    last_eval_step: int | None = None

    def record_eval(self, step: int, acc: float) -> None:
        self.last_eval_step, self.last_eval_acc = step, acc
        self.best_acc = acc if self.best_acc is None else max(self.best_acc, acc)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, value)


def fit(job: Job) -> FitResult:
    cfg = job.config
    t, device = cfg.train, job.device
    amp_dtype = amp_dtype_for(t.amp, device)
    fmt = torch.channels_last if t.channels_last else torch.contiguous_format

    # ---- model: the same seed on every rank, so every rank starts from identical weights
    # (DDP also broadcasts rank 0's at wrap time; this keeps single-process runs identical too)
    torch.manual_seed(t.seed)
    raw = models.build_model(t.model, t.num_classes, cifar_stem=t.cifar_stem,
                             pretrained=t.pretrained, freeze_backbone=t.freeze_backbone)
    if t.sync_batchnorm and job.world_size > 1:  # before DDP: DDP must see the final modules
        raw = syncbn.convert(raw, device)
    raw.to(device)
    raw.to(memory_format=fmt)  # channels_last for 4-d weights
    # One code path for every precision: the scaler is a no-op unless fp16 (bf16 needs none).
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    mode = compile_mode_for(t.compile_mode, device)
    if t.compile:
        # In place and inside DDP: DDP's forward calls the compiled module. torch.compile of the
        # DDP wrapper breaks its graph in DDP's forward (torch 2.14: Logger.set_runtime_stats_and_log)
        # and then compiled nothing at all on 2 ranks; and the state_dict keeps its names.
        raw.compile(mode=mode)
    graphs = t.compile and device.type == "cuda" and mode in CUDA_GRAPH_MODES
    model = job.wrap(raw)  # DDP (+ rank-ordered reduction for >2 ranks), or sharded in place (fsdp)
    optimizer = build_optimizer(raw, cfg)  # after wrap: fully_shard replaces the parameters
    train_set, test_set = data.build_datasets(cfg.data.dataset, cfg.data.root, t.seed,
                                              cfg.data.synthetic_train, cfg.data.synthetic_test)
    progress = Progress(global_batch=t.batch_size * job.world_size
                        * accumulation_for(cfg, job.world_size))

    # ---- resume: last, because building the model and data above consumed random numbers
    state = {"model": model, "optimizer": optimizer, "scaler": scaler, "progress": progress}
    start = job.resume(state)

    # ---- data: the position in the data is the global optimizer step, at any world size.
    # Elastic resume keeps the global batch (and so the meaning of "step N"); the accumulation
    # absorbs the change in world size.
    per_step = t.batch_size * job.world_size
    if progress.global_batch % per_step:
        raise DDPJobError(
            f"the checkpoint at step {start} was trained with a global batch of "
            f"{progress.global_batch}, which {job.world_size} ranks x batch_size {t.batch_size} "
            "cannot reproduce",
            f"resume with a world size and batch_size whose product divides {progress.global_batch}")
    accumulation = progress.global_batch // per_step
    old = job.resumed_world_size
    if old is not None and old != job.world_size:
        old_accumulation = progress.global_batch // (t.batch_size * old)
        bar_note = (f"elastic resume: world size {old} -> {job.world_size}, accumulation "
                    f"{old_accumulation} -> {accumulation}, global batch {progress.global_batch} kept, "
                    f"data continues at step {start}")
    else:
        bar_note = ""
    loader = data.make_train_loader(
        train_set, num_workers=cfg.data.num_workers, micro_batch=t.batch_size,
        accumulation=accumulation, rank=job.rank, world_size=job.world_size, seed=t.seed,
        augment=cfg.data.augment, device=device, channels_last=t.channels_last)
    amp_dtype, amp_note = resolve_auto_amp(job, progress, amp_dtype, loader, resumed=start > 0)
    spe = loader.steps_per_epoch
    total = t.max_steps or t.epochs * spe
    warmup = t.warmup_steps or round(t.warmup_epochs * spe)

    def lr_at(step: int) -> float:
        return lr_schedule(step, base=t.lr, total=total, warmup=warmup, schedule=t.schedule,
                           steps_per_epoch=spe, step_epochs=t.lr_step_epochs, gamma=t.lr_gamma)

    loss_fn = nn.CrossEntropyLoss(label_smoothing=t.label_smoothing)
    eval_due = (lambda s: s % t.eval_every == 0) if t.eval_every else (lambda s: s % spe == 0)

    # ---- the loop: job.steps() votes on stopping and saves between steps
    meter = Meter(images_per_step=loader.global_batch)
    bar = Bar(total, start, enabled=job.is_rank0)
    result = FitResult(step=start, total_steps=total, resumed_from=start or None)
    bar.message(f"training {t.model} on {cfg.data.dataset}: {job.world_size} rank(s) x batch "
                f"{t.batch_size} x accumulation {accumulation} = global batch {loader.global_batch}, "
                f"{spe} steps/epoch, steps {start}..{total}, amp {dtype_name(amp_dtype)}")
    if amp_note:
        bar.message(amp_note)
    if bar_note:
        bar.message(bar_note)
    batches = None
    try:
        for step in job.steps(state, total, accumulation=accumulation):
            epoch, within = divmod(step, spe)
            if batches is None or within == 0:
                batches = meter.timed(job.timed(loader.batches(epoch, within)))  # job: the straggler watch's data wait
            micro_batches = next(batches)
            lr = lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            if graphs:  # a new step: the CUDA graphs may reuse the last step's output memory
                torch.compiler.cudagraph_mark_step_begin()
            loss = train_step(model, optimizer, scaler, micro_batches, loss_fn=loss_fn,
                              amp_dtype=amp_dtype, grad_clip=t.grad_clip)
            done = step + 1
            if t.log_sample_ids:
                job.log_samples(done, epoch, loader.sample_ids(epoch, within))  # both loaders
            meter.step_done()
            result.steps_run += 1
            if done % t.log_every == 0 or done == total:
                timing = meter.window()
                # the loss average is the only host sync of the step
                logged = job.log(done, average=["loss"], epoch=epoch, loss=loss, lr=lr, **timing)
                bar.update(done, epoch, logged["loss"], lr, timing)
            if eval_due(done) or done == total:
                evaluating = time.perf_counter()
                job.broadcast_buffers(raw)  # rank 0's BatchNorm statistics: one model evaluated
                # eager under CUDA graphs: eval mode and the short last batch would each compile
                # and record graphs of their own, for a pass that runs once an epoch
                with torch.compiler.set_stance("force_eager") if graphs else contextlib.nullcontext():
                    acc, eval_loss = evaluate(raw, test_set, job, batch_size=max(t.batch_size, 256),
                                              amp_dtype=amp_dtype, channels_last=t.channels_last)
                progress.record_eval(done, acc)
                # eval_s: the goodput ledger's "eval" (ledger/goodput.py)
                job.log(done, epoch=(done - 1) // spe, eval_acc=acc, eval_loss=eval_loss,
                        eval_s=round(time.perf_counter() - evaluating, 4))
                bar.message(f"eval step {done}: accuracy {acc:.4f} loss {eval_loss:.4f}")
                meter.pause()
    finally:
        bar.close()

    # ---- the end: job.steps() wrote the final checkpoint; the plain weights and the marker
    result.step, result.accuracy, result.vote_s = total, progress.last_eval_acc, job.vote_s
    job.finish(raw, accuracy=result.accuracy, best_accuracy=progress.best_acc)
    vote_us = 1e6 * job.vote_s / max(result.steps_run, 1)
    bar.message(f"finished: step {total}, accuracy {result.accuracy} (stop vote {vote_us:.0f} us/step)")
    return result


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               micro_batches: Sequence[Batch], *, loss_fn: Callable[..., torch.Tensor],
               amp_dtype: torch.dtype | None, grad_clip: float = 0.0) -> torch.Tensor:
    """One optimizer step over `len(micro_batches)` micro-batches; returns the mean loss, detached
    and still on the device (reading it with .item() would wait for the device: callers do
    that only at logging steps)."""
    n = len(micro_batches)
    device_type = micro_batches[0][0].device.type
    total = torch.zeros((), device=micro_batches[0][0].device)
    sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2's no_sync
    for i, (x, y) in enumerate(micro_batches):
        # no_sync on all but the last micro-step: gradients accumulate locally and DDP
        # all-reduces once per optimizer step instead of once per micro-batch.
        no_sync = getattr(model, "no_sync", None)  # DDP, also behind torch.compile
        if sync is not None:  # FSDP: unsharded gradients accumulate, one reduce-scatter at the end
            sync(i == n - 1)
        with (contextlib.nullcontext() if i == n - 1 or no_sync is None else no_sync()):
            with torch.autocast(device_type, dtype=amp_dtype or torch.float32,
                                enabled=amp_dtype is not None):
                loss = loss_fn(model(x), y)
            # Each micro-batch loss is a mean over its own samples; dividing by n makes the
            # accumulated gradient the mean over the whole optimizer-step batch, i.e. the same
            # gradient (and so the same lr) as one batch n times larger.
            scaler.scale(loss / n).backward()
        total += loss.detach()
    if grad_clip > 0:
        scaler.unscale_(optimizer)  # clip the true gradients, not the fp16-scaled ones
        nn.utils.clip_grad_norm_(model.parameters(), grad_clip, foreach=True)
    scaler.step(optimizer)  # skips the step if fp16 gradients overflowed
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return total / n


@torch.no_grad()
def evaluate(model: nn.Module, test_set: Any, job: Job, *, batch_size: int,
             amp_dtype: torch.dtype | None, channels_last: bool) -> tuple[float, float]:
    """Accuracy and mean loss over the whole test set, each rank evaluating a contiguous share.
    Counts are summed exactly (float64 holds integers exactly), so accuracy equals a
    one-process evaluation; the loss sum differs only by summation order."""
    was_training = model.training
    model.eval()
    device = job.device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # correct, count, loss sum
    for x, y in data.eval_batches(test_set, batch_size=batch_size, rank=job.rank,
                                  world_size=job.world_size, device=device,
                                  channels_last=channels_last,
                                  same_count=job.config.train.strategy == "fsdp"):
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            logits = model(x)
        logits = logits.float()
        sums[0] += (logits.argmax(1) == y).sum()
        sums[1] += y.numel()
        sums[2] += F.cross_entropy(logits, y, reduction="sum").double()
    job.all_reduce(sums)
    model.train(was_training)
    correct, count, loss_sum = sums.tolist()
    return correct / max(count, 1), loss_sum / max(count, 1)


# ------------------------------------------------------------------------- building blocks
def build_optimizer(model: nn.Module, cfg: JobConfig) -> torch.optim.Optimizer:
    """SGD (momentum, nesterov) or AdamW over the trainable parameters; no weight decay on
    biases and normalisation weights (1-d tensors): decaying them only hurts accuracy."""
    t = cfg.train
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim > 1]
    no_decay = [p for p in params if p.ndim <= 1]
    groups = [g for g in ({"params": decay, "weight_decay": t.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    # fused: one kernel for all parameters (CPU and CUDA in torch >= 2.4); foreach otherwise.
    # DTensor (fsdp) has a sharding rule for fused Adam(W) but none for fused SGD, whose
    # failure would come only at the first step.
    fast: dict[str, Any] = {"fused": True}
    slow: dict[str, Any] = {"foreach": True}
    from ddpjob.node.fsdp import is_sharded

    attempts = (slow,) if t.optimizer == "sgd" and is_sharded(model) else (fast, slow)
    for attempt in attempts:
        try:
            if t.optimizer == "adamw":
                return torch.optim.AdamW(groups, lr=t.lr, **attempt)
            return torch.optim.SGD(groups, lr=t.lr, momentum=t.momentum,
                                   nesterov=t.nesterov and t.momentum > 0, **attempt)
        except (RuntimeError, TypeError, ValueError):
            continue
    raise AssertionError("unreachable: foreach optimizers always exist")


def lr_schedule(step: int, *, base: float, total: int, warmup: int, schedule: str,
                steps_per_epoch: int, step_epochs: int, gamma: float) -> float:
    """The lr of optimizer step `step` (0-based): a pure function of the step, so a resumed run
    needs nothing but the step to continue the schedule."""
    if warmup > 0 and step < warmup:
        return base * (step + 1) / warmup
    if schedule == "constant":
        return base
    if schedule == "step":
        return base * gamma ** ((step // steps_per_epoch) // step_epochs)
    frac = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1.0 + math.cos(math.pi * min(frac, 1.0)))
