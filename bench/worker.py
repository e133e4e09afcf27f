"""One rank of a benchmark worker pool: `python -m bench.worker` (started by harness.Pool).

Pins itself to one core, uses one torch thread and joins the pool's gloo group. Then, for each
JSON line on stdin {kind, setup, params}, builds that arm once (ddpjob's trainer, a reference
recipe from recipes.py, a loader...), runs one trial and answers with one JSON line on the
reply pipe (rank 0's carries the measurements). EOF on stdin ends it.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench import harness, recipes


def _config(spec: dict[str, Any]) -> Any:
    from ddpjob import config

    return config.from_json(spec["config"])


# -------------------------------------------------------------------------- ddpjob's arms
def fit(spec: dict[str, Any], ctx: Any) -> recipes.Trial:
    """ddpjob's trainer, exactly as `ddpjob run` calls it, into a fresh run dir per trial.
    The timestamps are the trainer's own metrics.jsonl records."""
    from ddpjob import preemption, trainer

    cfg = _config(spec)

    def trial(params: dict[str, Any]) -> dict[str, Any]:
        run_dir = Path(params["run_dir"])
        run_dir.mkdir(parents=True, exist_ok=True)
        trainer.fit(cfg, ctx, run_dir, preemption.StopFlag())
        if ctx.env.rank != 0:
            return {}
        times: dict[str, float] = {}
        losses: dict[str, float] = {}
        windows = []
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r["kind"] == "train":
                times[str(r["step"])], losses[str(r["step"])] = r["time"], r["loss"]
                windows.append({"step": r["step"], "data_ms": r["data_ms"], "step_ms": r["step_ms"]})
        return {"times": times, "loss": losses, "windows": windows}

    return trial


def tensor_loader(spec: dict[str, Any], ctx: Any) -> recipes.Trial:
    """P3: ddpjob's CIFAR loader alone (the job file's augmentation and layout), one core."""
    from ddpjob import data

    cfg = _config(spec)
    t = cfg.train
    train = data.load_cifar10(cfg.data.root, train=True)
    loader = data.make_train_loader(train, micro_batch=t.batch_size, accumulation=1, rank=0,
                                    world_size=1, seed=t.seed, augment=cfg.data.augment,
                                    channels_last=t.channels_last)

    def trial(params: dict[str, Any]) -> dict[str, Any]:
        n = params["batches"]
        t0 = time.perf_counter()
        images = sum(len(mb[0][0]) for mb in itertools.islice(loader.batches(params["trial"]), n))
        return {"seconds": time.perf_counter() - t0, "images": images}

    return trial


def train_loop(spec: dict[str, Any], ctx: Any) -> recipes.Trial:
    """P4: the trainer's train_step over ddpjob's loader ("loader") or over the same batches
    made beforehand ("ready"); both arms are otherwise the same code."""
    import torch
    import torch.nn as nn
    from ddpjob import data, models, trainer

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
        times: dict[str, float] = {}
        for step, micro in enumerate(itertools.islice(source, total)):
            trainer.train_step(model, optimizer, scaler, micro, loss_fn=loss_fn, amp_dtype=amp)
            if (step + 1) % t.log_every == 0:
                times[str(step + 1)] = time.time()
        return {"times": times}

    return trial


def async_save(spec: dict[str, Any], ctx: Any) -> recipes.Trial:
    """P6: how long an async checkpoint of ResNet-18 + SGD state blocks the training loop
    (TrainState.save(blocking=False): the snapshot to host memory; the write runs behind)."""
    import torch
    import torch.nn.functional as F
    from ddpjob import models, trainer, trainstate

    cfg = _config(spec)
    t = cfg.train
    torch.manual_seed(t.seed)
    model = models.build_model(t.model, t.num_classes, cifar_stem=t.cifar_stem)
    optimizer = trainer.build_optimizer(model, cfg)
    F.cross_entropy(model(torch.randn(8, 3, 32, 32)), torch.zeros(8, dtype=torch.long)).backward()
    optimizer.step()  # momentum buffers exist from here on: the real optimizer state
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def trial(params: dict[str, Any]) -> dict[str, Any]:
        state = trainstate.TrainState(cfg, ctx, Path(params["run_dir"]))
        state.progress.global_batch = t.batch_size
        blocking = []
        for k in range(params["saves"]):
            t0 = time.perf_counter()
            state.save(k + 1, model, optimizer, scaler, blocking=False)
            blocking.append(time.perf_counter() - t0)
            state.finish_pending()  # the training steps between two saves, in the real loop
        return {"blocking_s": blocking}

    return trial


KINDS = {"fit": fit, "bare": recipes.bare_ddp, "seeds": recipes.seeds,
         "tensor_loader": tensor_loader, "pil_loader": recipes.pil_loader,
         "train_loop": train_loop, "async_save": async_save}


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    reply = os.fdopen(int(os.environ["BENCH_REPLY_FD"]), "w")

    def send(msg: dict[str, Any]) -> None:
        reply.write(json.dumps(msg) + "\n")
        reply.flush()

    ctx = None
    built: dict[str, recipes.Trial] = {}  # one per (kind, setup): setup is paid once per arm
    try:
        harness.pin_to(rank)
        from ddpjob import dist
        from ddpjob.cluster import ClusterEnv

        env = ClusterEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                         master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]),
                         source="torchrun")
        ctx = dist.init_process_group(env, backend="gloo", timeout_s=900, threads=1)
        for line in sys.stdin:
            msg = json.loads(line)
            if "kind" in msg:
                key = json.dumps([msg["kind"], msg["setup"]], sort_keys=True)
                if key not in built:
                    built[key] = KINDS[msg["kind"]](msg["setup"], ctx)
                send({"rank": rank, **built[key](msg["params"])})
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
