"""One rank of a benchmark worker pool: `python -m bench.worker` (started by harness.Pool).

Pins itself to one core, uses one torch thread and joins the pool's gloo group. Then, for each
JSON line on stdin {kind, setup, params}, builds that arm once (ddpjob's trainer, a reference
recipe from recipes.py, a loader...), runs one trial and answers with one JSON line on the
reply pipe (rank 0's carries the measurements). EOF on stdin ends it.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from bench import harness, recipes
from bench.marks import GATE, Marks


def _config(spec: dict[str, Any]) -> Any:
    from ddpjob import jobfile

    return jobfile.from_json(spec["config"])


# -------------------------------------------------------------------------- ddpjob's arms
_fit_marks: Marks | None = None


def _mark_log_steps() -> None:
    """Mark every rank's clocks where the trainer logs a training step (job.log runs on every
    rank: it averages the loss over the ranks; only rank 0 writes). A measuring hook only: the
    trainer's computation is untouched."""
    from ddpjob import api

    original = api.Job.log
    if getattr(original, "bench_hook", False):
        return

    def log(self: Any, step: int, **kw: Any) -> Any:
        out = original(self, step, **kw)
        if _fit_marks is not None and "loss" in kw:
            _fit_marks.mark(step)
        return out

    log.bench_hook = True  # type: ignore[attr-defined]
    api.Job.log = log  # type: ignore[method-assign]


_ckpt_events: list[dict[str, Any]] | None = None  # P6 timings of this trial
_nesting = threading.local()  # P6: depth of timed checkpoint calls on this thread


def _time_checkpoints() -> None:
    """P6: time what a checkpoint costs the training loop, where it happens: the main thread
    blocked in StateStore.save / commit_pending / finish_pending (wall), and the CPU the
    background writer thread takes (on a 1-core rank, from the training thread)."""
    from ddpjob.store import snapshot
    from ddpjob.store.state import StateStore

    def wrap(cls: Any, name: str, clock: Any) -> None:
        original = getattr(cls, name)
        if getattr(original, "bench_hook", False):
            return

        def timed(self: Any, *args: Any, **kw: Any) -> Any:
            # save() calls finish_pending() (and that commit_pending()): only the outermost call
            # of a thread counts, or a save that waits for the previous write counts it twice
            outer = not getattr(_nesting, "depth", 0)
            _nesting.depth = getattr(_nesting, "depth", 0) + 1
            t0, c0 = time.time(), clock()
            try:
                return original(self, *args, **kw)
            finally:
                _nesting.depth -= 1
                if _ckpt_events is not None and outer:
                    _ckpt_events.append({"what": name, "at": t0, "s": clock() - c0})

        timed.bench_hook = True  # type: ignore[attr-defined]
        setattr(cls, name, timed)

    for name in ("save", "commit_pending", "finish_pending"):
        wrap(StateStore, name, time.perf_counter)
    wrap(snapshot.AsyncWrite, "_run", time.thread_time)  # runs in the writer thread


def fit(spec: dict[str, Any], ctx: Any) -> recipes.Trial:
    """ddpjob's trainer, exactly as `ddpjob run` calls it, into a fresh run dir per trial;
    the losses are the trainer's own metrics.jsonl records."""
    from ddpjob import api
    from ddpjob.train import trainer

    cfg = _config(spec)
    _mark_log_steps()
    _time_checkpoints()

    def trial(params: dict[str, Any]) -> dict[str, Any]:
        global _fit_marks, _ckpt_events
        run_dir = Path(params["run_dir"])
        run_dir.mkdir(parents=True, exist_ok=True)
        marks, events = Marks(), list[dict[str, Any]]()
        _fit_marks, _ckpt_events = marks, events
        job = api.init(cfg, run_dir=run_dir)  # joins the process group the pool made
        try:
            trainer.fit(job)
        finally:
            job.close()
            _fit_marks = _ckpt_events = None
        if ctx.env.rank != 0:
            return {"marks": marks, "checkpoint": events}
        losses: dict[str, float] = {}
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r["kind"] == "train":
                losses[str(r["step"])] = r["loss"]
        return {"marks": marks, "checkpoint": events, "loss": losses}

    return trial


def tensor_loader(spec: dict[str, Any], ctx: Any) -> recipes.Trial:
    """P3: ddpjob's CIFAR loader alone (the job file's augmentation and layout), one core."""
    from ddpjob.train import data

    cfg = _config(spec)
    t = cfg.train
    train = data.load_cifar10(cfg.data.root, train=True)
    loader = data.make_train_loader(train, micro_batch=t.batch_size, accumulation=1, rank=0,
                                    world_size=1, seed=t.seed, augment=cfg.data.augment,
                                    channels_last=t.channels_last)

    def trial(params: dict[str, Any]) -> dict[str, Any]:
        return recipes.time_batches((mb[0] for mb in loader.batches(params["trial"])), params["batches"])

    return trial


def train_loop(spec: dict[str, Any], ctx: Any) -> recipes.Trial:
    """P4: the trainer's train_step over ddpjob's loader ("loader") or over the same batches
    made beforehand ("ready"); both arms are otherwise the same code."""
    import torch
    import torch.nn as nn
    from ddpjob.train import data, models, trainer

    cfg = _config(spec)
    t = cfg.train
    train = data.load_cifar10(cfg.data.root, train=True)
    loader = data.make_train_loader(train, micro_batch=t.batch_size, accumulation=1, rank=0,
                                    world_size=1, seed=t.seed, augment=cfg.data.augment,
                                    channels_last=t.channels_last)
    total = t.max_steps
    ready = list(itertools.islice(loader.batches(0), total)) if spec["source"] == "ready" else None
    torch.manual_seed(t.seed)
    model = models.build_model(t.model, t.num_classes, cifar_stem=t.cifar_stem)
    model.to(memory_format=torch.channels_last if t.channels_last else torch.contiguous_format)
    optimizer = trainer.build_optimizer(model, cfg)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=t.label_smoothing)
    amp = trainer.amp_dtype_for(t.amp, torch.device("cpu"))

    def trial(params: dict[str, Any]) -> dict[str, Any]:
        source = ready if ready is not None else loader.batches(0)
        marks = Marks()
        for step, micro in enumerate(itertools.islice(source, total)):
            trainer.train_step(model, optimizer, scaler, micro, loss_fn=loss_fn, amp_dtype=amp)
            marks.mark(step + 1)
        return {"marks": marks}

    return trial


def async_save(spec: dict[str, Any], ctx: Any) -> recipes.Trial:
    """P6: how long an async checkpoint of ResNet-18 + SGD state blocks the training loop
    (StateStore.save(blocking=False): the snapshot to host memory; the write runs behind)."""
    import torch
    import torch.nn.functional as F
    from ddpjob.node import dist
    from ddpjob.store.state import StateStore
    from ddpjob.train import models, trainer

    cfg = _config(spec)
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, async_save=True))  # what P6 measures
    t = cfg.train
    torch.manual_seed(t.seed)
    model = models.build_model(t.model, t.num_classes, cifar_stem=t.cifar_stem)
    optimizer = trainer.build_optimizer(model, cfg)
    F.cross_entropy(model(torch.randn(8, 3, 32, 32)), torch.zeros(8, dtype=torch.long)).backward()
    optimizer.step()  # momentum buffers exist from here on: the real optimizer state
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def trial(params: dict[str, Any]) -> dict[str, Any]:
        store = StateStore(cfg, ctx.env, Path(params["run_dir"]), control=dist.Control(ctx), restart=0)
        state = {"model": model, "optimizer": optimizer, "scaler": scaler}
        blocking = []
        for k in range(params["saves"]):
            t0 = time.perf_counter()
            store.save(k + 1, state, blocking=False)
            blocking.append(time.perf_counter() - t0)
            store.finish_pending()  # the training steps between two saves, in the real loop
        return {"blocking_s": blocking}

    return trial


def charlm(spec: dict[str, Any], ctx: Any) -> recipes.Trial:
    """P9: examples/charlm/train.py, run as `ddpjob run` runs an entry. mode "api": as written
    (job.steps: stop vote, checkpoint schedule, deadline watch; job.log: the averaged loss to
    metrics.jsonl). mode "hand": the same script with those replaced by what a hand-written
    loop does (`range`, one all-reduce of the loss and a print on rank 0), so the two arms
    differ only by the API's per-step machinery. Marks come after each step's body."""
    import runpy

    import torch
    import torch.distributed as tdist

    from ddpjob import api
    from ddpjob.rank import start

    cfg = _config(spec)
    script = str(Path(__file__).resolve().parents[1] / "examples" / "charlm" / "train.py")
    steps, log = api.Job.steps, api.Job.log

    def trial(params: dict[str, Any]) -> dict[str, Any]:
        marks, losses = Marks(), {}

        def marked_steps(self: Any, state: Any, total: int, **info: Any) -> Any:
            if spec["mode"] == "hand":
                self._store.restore_rng()  # the same RNG streams as the API arm
                source = iter(range(int(self._step or 0), total))
            else:
                source = steps(self, state, total, **info)
            for step in source:
                yield step
                marks.mark(step + 1)

        def hand_log(self: Any, step: int, *, average: Any = False, **scalars: Any) -> dict[str, Any]:
            # averaged in float64 like job.log, so equal losses mean equal training
            loss = scalars["loss"].detach().to(torch.float64)
            tdist.all_reduce(loss)
            losses[str(step)] = value = float(loss.item()) / self.world_size
            if self.is_rank0:
                print(f"step {step} loss {value:.4f}", flush=True)
            return {"loss": value, "lr": scalars.get("lr")}

        def api_log(self: Any, step: int, **kw: Any) -> dict[str, Any]:
            out = log(self, step, **kw)
            losses[str(step)] = out["loss"]
            return out

        api.Job.steps = marked_steps  # type: ignore[method-assign]
        api.Job.log = hand_log if spec["mode"] == "hand" else api_log  # type: ignore[method-assign]
        Path(params["run_dir"]).mkdir(parents=True, exist_ok=True)
        saved_argv = sys.argv
        try:
            with start.launched(start.Launch(cfg, run_dir=Path(params["run_dir"]), argv=[])):
                torch.manual_seed(0)
                runpy.run_path(script, run_name="__main__")
        finally:
            sys.argv = saved_argv
            api.Job.steps, api.Job.log = steps, log  # type: ignore[method-assign]
            job = api.current()
            if job is not None:
                job.close()
        return {"marks": marks, "loss": losses}

    return trial


KINDS = {"fit": fit, "charlm": charlm, "bare": recipes.bare_ddp, "seeds": recipes.seeds,
         "tensor_loader": tensor_loader, "pil_loader": recipes.pil_loader,
         "train_loop": train_loop, "async_save": async_save}


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    reply = os.fdopen(int(os.environ["BENCH_REPLY_FD"]), "w")

    def send(msg: dict[str, Any]) -> None:
        reply.write(json.dumps(msg) + "\n")
        reply.flush()

    GATE.send, GATE.wait = send, sys.stdin.readline
    ctx = None
    built: dict[str, recipes.Trial] = {}  # one per (kind, setup): setup is paid once per arm
    try:
        harness.pin_to(rank)
        from ddpjob.node import group
        from ddpjob.node.cluster import ClusterEnv

        env = ClusterEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                         master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]),
                         source="torchrun")
        ctx = group.init_process_group(env, backend="gloo", timeout_s=900, threads=1)
        while line := sys.stdin.readline():  # readline: the gate reads the same stream
            msg = json.loads(line)
            if "kind" in msg:
                key = json.dumps([msg["kind"], msg["setup"]], sort_keys=True)
                if key not in built:
                    built[key] = KINDS[msg["kind"]](msg["setup"], ctx)
                GATE.enabled = bool(msg["params"].get("gate"))
                try:
                    result = built[key](msg["params"])
                finally:
                    GATE.enabled = False
                send({"rank": rank, **result})
            else:  # hello / reset
                if msg.get("reset"):
                    built.clear()
                    gc.collect()
                send({"rank": rank})
    except Exception as exc:
        traceback.print_exc()
        send({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    finally:
        if ctx is not None:
            ctx.destroy(barrier_timeout_s=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
