"""The training loop: `fit()` reads top to bottom (build, resume, loop, final save) and
`train_step()` is one optimizer step (accumulation with no_sync, autocast, scaler, clip).

runner.py calls fit() with the resolved config, the DistContext from dist.py, the run dir and
the StopFlag from preemption.py; fit() returns how it ended. What a checkpoint holds and how a
resume (also at another world size) restores it lives in store/state.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpjob import rundir
from ddpjob.config import JobConfig
from ddpjob.console import print0
from ddpjob.node import dist, preemption
from ddpjob.node.dist import DistContext
from ddpjob.node.metrics import Meter, MetricsLog, Progress
from ddpjob.store import state as trainstate
from ddpjob.train import data, models, syncbn

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class FitResult:
    step: int
    total_steps: int
    stop_code: int = preemption.NONE  # NONE: training finished
    accuracy: float | None = None
    resumed_from: int | None = None
    agree_s: float = 0.0  # time spent in the per-step stop all-reduce (reported by benchmarks)
    steps_run: int = 0

    @property
    def finished(self) -> bool:
        return self.stop_code == preemption.NONE


def fit(cfg: JobConfig, ctx: DistContext, run_dir: str | Path, stop: preemption.StopFlag,
        deadline: preemption.DeadlineWatch | None = None) -> FitResult:
    t, env, device = cfg.train, ctx.env, ctx.device
    amp_dtype = amp_dtype_for(t.amp, device)
    fmt = torch.channels_last if t.channels_last else torch.contiguous_format

    # ---- model: the same seed on every rank, so every rank starts from identical weights
    # (DDP also broadcasts rank 0's at wrap time; this keeps single-process runs identical too)
    torch.manual_seed(t.seed)
    raw = models.build_model(t.model, t.num_classes, cifar_stem=t.cifar_stem,
                             pretrained=t.pretrained, freeze_backbone=t.freeze_backbone)
    if t.sync_batchnorm and ctx.initialized:  # before DDP: DDP must see the final modules
        raw = syncbn.convert(raw, device)
    raw.to(device)
    raw.to(memory_format=fmt)  # channels_last for 4-d weights
    optimizer = build_optimizer(raw, cfg)
    # One code path for every precision: the scaler is a no-op unless fp16 (bf16 needs none).
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)

    # ---- resume: the newest valid checkpoint (weights before DDP: it then broadcasts them)
    state = trainstate.TrainState(cfg, ctx, Path(run_dir))
    progress = state.resume(raw, optimizer, scaler)
    accumulation = progress.accumulation
    if ctx.is_rank0:
        rundir.record_event(run_dir, "start", restart=env.restart_count, job_id=env.job_id,
                            world_size=env.world_size, source=env.source, host=env.hostname,
                            resumed_step=progress.resumed_from, accumulation=accumulation)

    # ---- data: the position in the data is the global optimizer step, at any world size
    train_set, test_set = data.build_datasets(cfg.data.dataset, cfg.data.root, t.seed,
                                              cfg.data.synthetic_train, cfg.data.synthetic_test)
    loader = data.make_train_loader(
        train_set, num_workers=cfg.data.num_workers, micro_batch=t.batch_size,
        accumulation=accumulation, rank=env.rank, world_size=env.world_size, seed=t.seed,
        augment=cfg.data.augment, device=device, channels_last=t.channels_last)
    if state.world_changed and isinstance(loader, data.PluginLoader):
        print0("note: plugin datasets are sharded by DistributedSampler, whose order depends on "
               "the world size: the rest of this epoch sees another sample order")
    spe = loader.steps_per_epoch
    total = t.max_steps or t.epochs * spe
    samples = None
    if t.log_sample_ids:
        if isinstance(loader, data.TensorLoader):
            samples = SampleLog(Path(run_dir), env.rank, env.restart_count, env.world_size)
        else:
            print0("note: train.log_sample_ids needs the synthetic or cifar10 dataset: off")
    warmup = t.warmup_steps or round(t.warmup_epochs * spe)

    def lr_at(step: int) -> float:
        return lr_schedule(step, base=t.lr, total=total, warmup=warmup, schedule=t.schedule,
                           steps_per_epoch=spe, step_epochs=t.lr_step_epochs, gamma=t.lr_gamma)

    # ---- wrap: DDP (+ rank-ordered reduction for >2 ranks), then compile
    model = wrap_ddp(raw, ctx, deterministic=t.deterministic_reduce)
    if t.compile:
        model = cast(nn.Module, torch.compile(model))
    loss_fn = nn.CrossEntropyLoss(label_smoothing=t.label_smoothing)
    state.restore_rng()  # last: building the model and data above consumed the global RNG

    # ---- the loop
    step = progress.step
    meter = Meter(images_per_step=loader.global_batch)
    log = MetricsLog(run_dir, enabled=ctx.is_rank0, restart=env.restart_count)
    bar = Progress(total, step, enabled=ctx.is_rank0)
    result = FitResult(step=step, total_steps=total, resumed_from=progress.resumed_from)
    bar.message(f"training {t.model} on {cfg.data.dataset}: {env.world_size} rank(s) x batch "
                f"{t.batch_size} x accumulation {accumulation} = global batch {loader.global_batch}, "
                f"{spe} steps/epoch, steps {step}..{total}, amp {_dtype_name(amp_dtype)}")
    eval_due = (lambda s: s % t.eval_every == 0) if t.eval_every else (lambda s: s % spe == 0)
    stop_agreed = preemption.NONE
    stop.current_step = step
    while step < total and not stop_agreed:
        epoch, start = divmod(step, spe)
        for micro_batches in meter.timed(loader.batches(epoch, start)):
            lr = lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = train_step(model, optimizer, scaler, micro_batches, loss_fn=loss_fn,
                              amp_dtype=amp_dtype, grad_clip=t.grad_clip)
            if samples is not None:
                ids = cast(data.TensorLoader, loader).sample_ids(epoch, step - epoch * spe)
                samples.write(step + 1, epoch, ids)
            step += 1
            stop.current_step = step
            meter.step_done()
            result.steps_run += 1
            if deadline is not None:
                deadline.observe_step(meter.last_step_s)
            if step % t.log_every == 0 or step == total:
                mean_loss = _mean_over_ranks(loss, ctx)  # the only host sync of the step
                timing = meter.window()
                log.step(step=step, epoch=epoch, loss=mean_loss, lr=lr, **timing)
                bar.update(step, epoch, mean_loss, lr, timing)
            if eval_due(step) or step == total:
                t0 = time.monotonic()
                sync_buffers(raw, ctx)
                acc, eval_loss = evaluate(raw, test_set, ctx,
                                          batch_size=max(t.batch_size, 256), amp_dtype=amp_dtype,
                                          channels_last=t.channels_last)
                progress.record_eval(step, acc, eval_loss)
                log.eval(step=step, epoch=(step - 1) // spe, eval_acc=acc, eval_loss=eval_loss)
                bar.message(f"eval step {step}: accuracy {acc:.4f} loss {eval_loss:.4f}")
                if deadline is not None:
                    deadline.observe_eval(time.monotonic() - t0)
                meter.pause()
            if step >= total:
                break  # finishing costs no more than stopping would: the final save below
            # ---- step boundary: every rank takes the same decision (one small all-reduce)
            if deadline is not None and deadline.expired():
                stop.request(preemption.DEADLINE)
            t0 = time.perf_counter()
            stop_agreed, save_due, busy = dist.agree_max(
                [stop.code, int(state.schedule.due(step)), int(state.async_busy())],
                group=state.control_group, device=state.control_device)
            result.agree_s += time.perf_counter() - t0
            if not busy:
                state.commit_pending()  # every rank's background write is done: the vote said so
            if stop_agreed or save_due:
                t0 = time.monotonic()
                state.save(step, raw, optimizer, scaler, blocking=bool(stop_agreed))
                if deadline is not None:
                    deadline.observe_checkpoint(time.monotonic() - t0)
                meter.pause()
            if stop_agreed:
                break

    # ---- the end: a final checkpoint (optimizer included), the plain weights, the marker
    result.step, result.stop_code = step, stop_agreed
    if stop_agreed:
        mine = f"; this rank got {stop.describe()}" if stop.signum is not None else ""
        bar.message(f"stopping at step {step}/{total} ({preemption.REASONS[stop_agreed]}{mine}): "
                    "checkpoint written")
    else:
        state.save(step, raw, optimizer, scaler, blocking=True)
        result.accuracy = progress.last_eval_acc
        if ctx.is_rank0:
            final = Path(run_dir) / rundir.FINAL
            final.mkdir(exist_ok=True)
            trainstate.save_plain(final / "model.pt", trainstate.model_state(raw))
            rundir.mark_completed(run_dir, step=step, accuracy=result.accuracy,
                                  best_accuracy=progress.best_acc)
        vote_us = 1e6 * result.agree_s / max(result.steps_run, 1)
        bar.message(f"finished: step {step}, accuracy {result.accuracy} "
                    f"(stop vote {vote_us:.0f} us/step)")
    bar.close()
    if samples is not None:
        samples.close()
    state.barrier()
    return result


class SampleLog:
    """train.log_sample_ids: this rank's global sample ids of every optimizer step, one JSON line
    per step in RUN_DIR/samples/rank-R.jsonl, so a test can check that each sample is used once
    per epoch, also across an elastic resume. Steps replayed after a kill are appended again:
    readers keep, per step, the lines of the newest restart."""

    def __init__(self, run_dir: Path, rank: int, restart: int, world_size: int) -> None:
        folder = run_dir / "samples"
        folder.mkdir(exist_ok=True)
        self._head = {"rank": rank, "restart": restart, "world_size": world_size}
        self._file = open(folder / f"rank-{rank}.jsonl", "a", encoding="utf-8", buffering=1)

    def write(self, step: int, epoch: int, ids: torch.Tensor) -> None:
        # Whole lines (line buffering): a kill leaves at most one torn line, which readers skip.
        record = {"step": step, "epoch": epoch, **self._head, "ids": ids.tolist()}
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
               micro_batches: Sequence[Batch], *, loss_fn: Callable[..., torch.Tensor],
               amp_dtype: torch.dtype | None, grad_clip: float = 0.0) -> torch.Tensor:
    """One optimizer step over `len(micro_batches)` micro-batches; returns the mean loss, detached
    and still on the device (reading it with .item() would wait for the device: callers do
    that only at logging steps)."""
    n = len(micro_batches)
    device_type = micro_batches[0][0].device.type
    total = torch.zeros((), device=micro_batches[0][0].device)
    for i, (x, y) in enumerate(micro_batches):
        # no_sync on all but the last micro-step: gradients accumulate locally and DDP
        # all-reduces once per optimizer step instead of once per micro-batch.
        no_sync = getattr(model, "no_sync", None)  # DDP, also behind torch.compile
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
def evaluate(model: nn.Module, test_set: Any, ctx: DistContext, *, batch_size: int,
             amp_dtype: torch.dtype | None, channels_last: bool) -> tuple[float, float]:
    """Accuracy and mean loss over the whole test set, each rank evaluating a contiguous share.
    Counts are summed exactly (float64 holds integers exactly), so accuracy equals a
    one-process evaluation; the loss sum differs only by summation order."""
    was_training = model.training
    model.eval()
    device = ctx.device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # correct, count, loss sum
    for x, y in data.eval_batches(test_set, batch_size=batch_size, rank=ctx.env.rank,
                                  world_size=ctx.env.world_size, device=device,
                                  channels_last=channels_last):
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            logits = model(x)
        logits = logits.float()
        sums[0] += (logits.argmax(1) == y).sum()
        sums[1] += y.numel()
        sums[2] += F.cross_entropy(logits, y, reduction="sum").double()
    if ctx.initialized:
        dist.all_reduce_sum(sums)
    model.train(was_training)
    correct, count, loss_sum = sums.tolist()
    return correct / max(count, 1), loss_sum / max(count, 1)


# ------------------------------------------------------------------------- building blocks
def amp_dtype_for(amp: str, device: torch.device) -> torch.dtype | None:
    """auto = bf16 where the hardware does bf16 natively (CUDA >= Ampere, CPUs with
    AVX512-BF16/AMX), else full precision; fp16 always means autocast + GradScaler."""
    if amp == "off":
        return None
    if amp == "fp16":
        return torch.float16
    if amp == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    return torch.bfloat16 if _cpu_has_native_bf16() else None


def _cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def _dtype_name(d: torch.dtype | None) -> str:
    return {None: "off", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(d, str(d))


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
    fast: dict[str, Any] = {"fused": True}
    slow: dict[str, Any] = {"foreach": True}
    for attempt in (fast, slow):
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


def wrap_ddp(model: nn.Module, ctx: DistContext, *, deterministic: bool = True) -> nn.Module:
    if not ctx.initialized:
        return model
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    ddp = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
    if deterministic and ctx.env.world_size > 2:
        # Ring all-reduce (gloo and NCCL) adds the ranks' values in an order that depends on
        # the element's offset in its bucket, and DDP rebuilds its buckets after the first
        # iteration of every process: a resumed process would sum (a+b)+c where the
        # uninterrupted one summed a+(b+c). Summing an all-gather in rank order makes the
        # result independent of bucket layout. (With 2 ranks a+b == b+a: not needed.)
        ddp.register_comm_hook(None, dist.ordered_sum_hook)
    return ddp


def sync_buffers(model: nn.Module, ctx: DistContext) -> None:
    """Rank 0's BatchNorm statistics everywhere. DDP broadcasts them at the start of each
    forward, so after the last step every other rank still holds its own update: without this,
    the ranks would evaluate slightly different models."""
    if ctx.initialized:
        for buf in model.buffers():
            dist.broadcast_tensor(buf, src=0)


def _mean_over_ranks(loss: torch.Tensor, ctx: DistContext) -> float:
    if ctx.initialized:
        loss = loss.detach().clone()
        dist.all_reduce_sum(loss)
        loss /= ctx.env.world_size
    return float(loss.item())
