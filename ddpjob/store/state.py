"""What a checkpoint holds and how training gets it back: the bridge between trainer.py and the
atomic store in commit.py.

A checkpoint is taken at an optimizer-step boundary: model.pt, optimizer.pt, trainer.pt
(progress, GradScaler) from rank 0 and rank-<R>.pt (RNG states) from every rank; with the data
order a function of (seed, epoch, step) that is all a bit-exact continuation needs. Resuming at
another world size keeps the global batch by changing the accumulation (elastic resume).
"""

from __future__ import annotations

import hashlib
import os
import random
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from ddpjob import rundir
from ddpjob.config import JobConfig, accumulation_for
from ddpjob.console import print0
from ddpjob.errors import DDPJobError
from ddpjob.node import dist
from ddpjob.node.dist import DistContext
from ddpjob.store import commit, rng, schedule, snapshot


@dataclass
class Progress:
    """The trainer's own state, checkpointed like the model (torchtitan's idea)."""

    step: int = 0
    accumulation: int = 1
    global_batch: int = 0
    world_size: int = 1
    best_acc: float | None = None
    last_eval_acc: float | None = None
    last_eval_loss: float | None = None
    last_eval_step: int | None = None
    resumed_from: int | None = None

    def record_eval(self, step: int, acc: float, loss: float) -> None:
        self.last_eval_step, self.last_eval_acc, self.last_eval_loss = step, acc, loss
        self.best_acc = acc if self.best_acc is None else max(self.best_acc, acc)


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict without DDP's `module.` or torch.compile's `_orig_mod.` prefixes."""
    out = {}
    for k, v in model.state_dict().items():
        for prefix in ("module.", "_orig_mod."):
            while k.startswith(prefix):
                k = k[len(prefix):]
        out[k] = v
    return out


def save_plain(path: Path, obj: Any) -> None:
    """torch.save, atomically (temp file + fsync + rename): readers never see half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _seed_for(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=4).digest(), "little")


class TrainState:
    """Resume, periodic/stop/final saves (blocking or async) for one fit() call."""

    def __init__(self, cfg: JobConfig, ctx: DistContext, run_dir: Path) -> None:
        self.cfg, self.ctx, self.env = cfg, ctx, ctx.env
        c = cfg.checkpoint
        self.store = commit.CheckpointStore(run_dir / rundir.CHECKPOINTS, keep_last=c.keep_last,
                                            config_hash=cfg.hash())
        self.schedule = schedule.SaveSchedule(c.every_steps, c.every_minutes)
        # The stop vote runs every step: on NCCL it would sync the host with the GPU each step,
        # so control messages go through a CPU (gloo) group instead.
        self.control_group: Any = None
        self.control_device = torch.device("cpu")
        if ctx.initialized and ctx.backend == "nccl":
            self.control_group = dist.control_group()
        # Same name on every rank (they all write into it), new for each (re)start: a staging
        # folder left by a killed incarnation (stale files, half-written .tmp) is never reused.
        token = secrets.token_hex(4) if ctx.is_rank0 else None
        self.attempt = f"r{self.env.restart_count}-{dist.broadcast_object(token)}"
        self.progress = Progress()
        self._rng: dict[str, Any] | None = None
        self.world_changed = False  # resumed at another world size (elastic)
        self._saved_step: int | None = None
        self._pending: tuple[snapshot.AsyncWrite, Path, int, dict[str, Any]] | None = None

    # ---------------------------------------------------------------- resume
    def resume(self, model: nn.Module, optimizer: torch.optim.Optimizer,
               scaler: torch.amp.GradScaler) -> Progress:
        t, world = self.cfg.train, self.env.world_size
        info = None
        if self.cfg.checkpoint.resume:
            # latest() hashes whole checkpoints: rank 0 does it once, the others get the answer.
            info = self.store.latest(log=print0) if self.ctx.is_rank0 else None
            info = dist.broadcast_object(info)
        p = self.progress
        if info is None:
            p.accumulation = accumulation_for(self.cfg, world)
            p.global_batch = t.batch_size * world * p.accumulation
            p.world_size = world
            return p
        meta = info.manifest
        saved = self.store.load(info, "trainer.pt")
        for key, value in saved["progress"].items():
            if hasattr(p, key):
                setattr(p, key, value)
        p.resumed_from, self._saved_step = info.step, info.step
        p.step = info.step
        # Elastic resume: the global batch (and so the meaning of "step N") is kept; the
        # accumulation absorbs the change in world size.
        per_step = t.batch_size * world
        if p.global_batch % per_step:
            raise DDPJobError(
                f"the checkpoint at step {info.step} was trained with a global batch of {p.global_batch} "
                f"({meta.get('world_size')} ranks x accumulation {meta.get('accumulation')}), which "
                f"{world} ranks x batch_size {t.batch_size} cannot reproduce",
                f"resume with a world size and batch_size whose product divides {p.global_batch}")
        accumulation = p.global_batch // per_step
        if (p.world_size, p.accumulation) != (world, accumulation):
            print0(f"elastic resume: world size {p.world_size} -> {world}, accumulation "
                   f"{p.accumulation} -> {accumulation}, global batch {p.global_batch} kept, "
                   f"data continues at step {info.step}")
        self.world_changed = p.world_size != world
        p.accumulation, p.world_size = accumulation, world
        model.load_state_dict(self.store.load(info, "model.pt"))
        optimizer.load_state_dict(self.store.load(info, "optimizer.pt"))
        scaler.load_state_dict(saved["scaler"])
        rng_file = f"rank-{self.env.rank}.pt"
        if rng_file in meta.get("files", {}):
            self._rng = self.store.load(info, rng_file)
        print0(f"resumed from {info.path.name} (step {info.step}, restart {self.env.restart_count})")
        return p

    def restore_rng(self) -> None:
        """This rank's RNG streams: as saved, or seeded from (seed, rank, step) when starting
        fresh or when the checkpoint had no file for this rank (it grew)."""
        if self._rng is not None:
            rng.restore_rng_state(self._rng)
            return
        seed = _seed_for(self.cfg.train.seed, "rank", self.env.rank, self.progress.step)
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)

    # ---------------------------------------------------------------- saving
    def _files(self, model: nn.Module, optimizer: torch.optim.Optimizer,
               scaler: torch.amp.GradScaler) -> dict[str, Any]:
        files: dict[str, Any] = {f"rank-{self.env.rank}.pt": rng.capture_rng_state()}
        if self.ctx.is_rank0:
            files["model.pt"] = model_state(model)
            files["optimizer.pt"] = optimizer.state_dict()
            files["trainer.pt"] = {"progress": asdict(self.progress), "scaler": scaler.state_dict()}
        return files

    def _meta(self, step: int) -> dict[str, Any]:
        p = self.progress
        return {"step": step, "samples": step * p.global_batch, "world_size": self.env.world_size,
                "accumulation": p.accumulation, "global_batch": p.global_batch,
                "restart": self.env.restart_count, "job_id": self.env.job_id}

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler, *, blocking: bool) -> None:
        """Collective: every rank calls it at the same step. Blocking saves return once the
        checkpoint is committed on disk; async ones return after the copy to host memory."""
        if self._saved_step == step:
            return  # e.g. a periodic save at the step where training then stops
        self.finish_pending()
        self.progress.step = step
        staging = self.store.staging_dir(step, self.attempt)
        files = self._files(model, optimizer, scaler)
        self._saved_step = step
        self.schedule.mark_saved()  # every rank restarts its minute timer at the same save
        if blocking or not self.cfg.checkpoint.async_save:
            for name, obj in files.items():
                self.store.write(staging, name, obj)
            self.barrier()  # every rank's files are on disk before rank 0 commits
            if self.ctx.is_rank0:
                self.store.commit(staging, step, self._meta(step))
            self.barrier()  # nobody moves on (or exits) before the checkpoint exists
            return
        snap = {name: commit.CheckpointStore.snapshot(obj) for name, obj in files.items()}
        self._pending = (self.store.write_async(staging, snap), staging, step, self._meta(step))

    def async_busy(self) -> bool:
        return self._pending is not None and not self._pending[0].done()

    def commit_pending(self) -> None:
        """After the step vote said no rank is still writing: the vote was the barrier."""
        if self._pending is None:
            return
        aw, staging, step, meta = self._pending
        self._pending = None
        aw.wait()
        if self.ctx.is_rank0:
            self.store.commit(staging, step, meta)

    def finish_pending(self) -> None:
        if self._pending is not None:
            self._pending[0].wait()
            self.barrier()
            self.commit_pending()

    def barrier(self) -> None:
        if self.ctx.initialized:
            dist.barrier(self.control_group)
