"""P8, one GPU: images/s, the loader's share of the step and seconds per epoch of
jobs/cifar10_resnet18.toml as shipped and with one setting changed (fp32, compile,
cudnn.benchmark, the seeds' network), beside the seeds' recipe on the same GPU and data.

Each arm is its own process, run one after another: two processes side by side (P1-P7's
lockstep) would share the one GPU. ddpjob's arms are `ddpjob run` itself, one rank, with
`train.log_every` = one epoch, so metrics.jsonl's record at the end of epoch 2 is that epoch's
window exactly (img_s, data_ms = host time waiting in next(batches), step_ms; the window ends
in the loss's .item(), which waits for the GPU). Epoch 1 holds the warm-up (cuDNN's algorithm
search, compilation, the loader's start) and is left out. The seeds' arm (`python -m bench.p8
seeds`) is the seeds' loop timed the same way. `python -m bench.p8 loaders` times each data
pipeline alone over one epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import harness

if TYPE_CHECKING:
    from bench.suite import Bench, Row

EPOCHS = 2  # figures from the second
SEEDS_WORKERS = 8  # the seeds' DataLoader(num_workers=8)
BATCH = 128  # per GPU, as jobs/cifar10_resnet18.toml
# (label, per-GPU batch, overrides of jobs/cifar10_resnet18.toml); the first is the job as shipped
JOB_ARMS: list[tuple[str, int, list[str]]] = [
    ("job as shipped (bf16, CIFAR stem, deterministic kernels)", BATCH, []),
    ("fp32 (train.amp = \"off\")", BATCH, ['train.amp="off"']),
    ("bf16 + train.compile", BATCH, ["train.compile=true"]),
    ("cudnn.benchmark (train.deterministic = false)", BATCH, ["train.deterministic=false"]),
    ("the seeds' network (train.cifar_stem = false)", BATCH, ["train.cifar_stem=false"]),
    # a batch large enough that the GPU, not the host's kernel launches, sets the pace
    ("job as shipped", 4 * BATCH, []),
    ("fp32 (train.amp = \"off\")", 4 * BATCH, ['train.amp="off"']),
]
SEEDS_NETWORK = 4  # the arm the seeds' recipe is compared with: the same network and batch


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = os.pathsep.join([str(harness.ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _call(args: list[str], log: Path, timeout: float = 900) -> None:
    with open(log, "w") as out:
        proc = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, cwd=harness.ROOT, env=_env(),
                              timeout=timeout)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{' '.join(args[:4])} exited {proc.returncode}: {tail}")


def _batch(b: Bench, batch: int) -> int:
    return batch if not b.sizes.tiny else b.sizes.batch * batch // BATCH


def _common(b: Bench, batch: int) -> list[str]:
    """The overrides every ddpjob arm shares."""
    spe = b.sizes.n_train // batch
    common = [f"data.root={json.dumps(str(b.root))}", f"train.epochs={EPOCHS}", "train.max_steps=0",
              f"train.log_every={spe}", f"train.batch_size={batch}", "checkpoint.every_minutes=0",
              "checkpoint.every_steps=0", "slurm.tasks_per_node=1", "slurm.gpus_per_node=1"]
    if b.sizes.tiny:
        common.append(f"train.model={json.dumps(b.sizes.model)}")
    return common


def job_arm(b: Bench, name: str, batch: int, overrides: list[str]) -> dict[str, float]:
    """`ddpjob run` of the job file on one GPU; epoch 2's window from metrics.jsonl."""
    from ddpjob.rundir import read_jsonl

    common = _common(b, batch)
    run_dir = b.base / "P8" / name
    if run_dir.exists():
        import shutil
        shutil.rmtree(run_dir)
    args = [sys.executable, "-m", "ddpjob", "run", str(harness.JOB), "--run-dir", str(run_dir)]
    for o in common + overrides:
        args += ["--set", o]
    started = time.monotonic()
    _call(args, b.base / "P8" / f"{name}.log")
    wall = time.monotonic() - started
    spe = b.sizes.n_train // batch
    rec = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("step") == EPOCHS * spe and "img_s" in r]
    if not rec:
        raise RuntimeError(f"P8 {name}: no metrics record at step {EPOCHS * spe} in {run_dir}")
    r = rec[-1]
    acc = [x["eval_acc"] for x in read_jsonl(run_dir / "metrics.jsonl") if "eval_acc" in x]
    return {"img_s": r["img_s"], "data_ms": r["data_ms"], "step_ms": r["step_ms"],
            "epoch_s": r["step_ms"] * spe / 1000, "wall_s": wall, "accuracy": acc[-1] if acc else float("nan")}


def _device() -> Any:
    import torch

    # the CPU only so that the modes can be tried where no GPU is
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _seed_loader(root: str, batch: int, workers: int, seed: int) -> tuple[Any, Any]:
    """The seeds' pipeline: torchvision CIFAR10 + PIL transforms, DataLoader(num_workers=8) with a
    DistributedSampler (world 1), no pinned memory."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from bench.recipes import _pil_dataset

    ds = _pil_dataset(root)
    sampler: DistributedSampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=seed)
    # drop_last: every step a full batch, as ddpjob's arms (the seeds keep a last short batch)
    return DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=workers, drop_last=True,
                      persistent_workers=workers > 0), sampler


def seeds_main(root: str, batch: int, amp: str, out: Path) -> None:
    """The seeds' loop (001's resnet_ddp.py on one GPU): torchvision ResNet-18, SGD lr 0.1 momentum
    0.9 weight decay 1e-5, cross-entropy, `.to(device)` per batch; `amp` bf16 = autocast as 000."""
    import torch
    import torch.nn as nn
    import torchvision

    device = _device()
    torch.manual_seed(0)
    loader, sampler = _seed_loader(root, batch, SEEDS_WORKERS, 0)
    model = torchvision.models.resnet18(num_classes=10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-5)
    criterion = nn.CrossEntropyLoss()
    windows = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        start, data, steps = time.perf_counter(), 0.0, 0
        it = iter(loader)
        while True:
            t0 = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                break
            data += time.perf_counter() - t0
            x, y = x.to(device), y.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp == "bf16"):
                loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
        loss.item()  # waits for the GPU: closes the epoch's window, as the trainer's log step does
        wall = time.perf_counter() - start
        windows.append({"img_s": steps * batch / wall, "data_ms": 1000 * data / steps,
                        "step_ms": 1000 * wall / steps, "epoch_s": wall})
    out.write_text(json.dumps(windows[-1]))


def loaders_main(root: str, batch: int, out: Path) -> None:
    """Each pipeline alone over one epoch into the GPU: ddpjob's loader (the data set on the GPU,
    augmentation there) and the seeds' (PIL in 8 workers, then `.to(device)`)."""
    import torch

    from ddpjob.train import data

    device = _device()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    result = {}
    loader = data.make_train_loader(data.load_cifar10(root, train=True), micro_batch=batch, accumulation=1,
                                    rank=0, world_size=1, seed=0, augment=True, device=device,
                                    channels_last=True)
    for epoch in range(2):  # the second epoch timed
        sync()
        t0, n = time.perf_counter(), 0
        for micro in loader.batches(epoch):
            n += sum(len(mb[0]) for mb in micro)
        sync()
        result["ddpjob"] = n / (time.perf_counter() - t0)
    seeds, sampler = _seed_loader(root, batch, SEEDS_WORKERS, 0)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        t0, n = time.perf_counter(), 0
        for x, y in seeds:
            x, y = x.to(device), y.to(device)
            n += len(x)
        sync()
        result["seeds"] = n / (time.perf_counter() - t0)
    out.write_text(json.dumps(result))


def _text(fs: list[dict[str, float]]) -> str:
    """Medians over the trials; the images/s range when there are several."""
    ips = [f["img_s"] for f in fs]
    spread = f" ({min(ips):.0f}-{max(ips):.0f})" if len(fs) > 1 else ""
    share = harness.median([100 * f["data_ms"] / f["step_ms"] for f in fs])
    epoch = harness.median([f["epoch_s"] for f in fs])
    return f"{harness.median(ips):.0f}{spread} img/s; loader {share:.1f}% of the step; {epoch:.2f} s/epoch"


def _seeds_arm(b: Bench, amp: str, batch: int) -> dict[str, float]:
    out = b.base / "P8" / f"seeds-{amp}.json"
    _call([sys.executable, "-m", "bench.p8", "seeds", str(b.root), str(batch), amp, str(out)],
          b.base / "P8" / f"seeds-{amp}.log")
    return dict(json.loads(out.read_text()))


def p8(b: Bench) -> list[Row]:
    """Trials interleave the arms (arm 1..n, then again), so a slow spell of the host hits all
    arms alike; at batch 128 the host's kernel launches set the pace and figures move by a
    fifth between trials."""
    import torch

    from bench.suite import Row

    name = "GPU: images/s, loader share of step time, bf16 vs fp32"
    if not torch.cuda.is_available():
        return [Row("P8", name, "report", "not measured: no CUDA GPU on this machine", None)]
    gpu = torch.cuda.get_device_name(0)
    b.root = harness.dataset(b.base, b.sizes)  # generated CIFAR-10-format files, not downloaded
    (b.base / "P8").mkdir(parents=True, exist_ok=True)
    batch, trials = _batch(b, BATCH), b.sizes.slow_trials
    seeds_labels = [f"the seeds' recipe ({'fp32' if amp == 'off' else 'bf16 autocast'}, PIL, "
                    f"{SEEDS_WORKERS} workers)" for amp in ("off", "bf16")]
    figures: list[list[dict[str, float]]] = [[] for _ in range(len(JOB_ARMS) + 2)]
    for trial in range(trials):
        for i, (label, arm_batch, overrides) in enumerate(JOB_ARMS):
            b.log(f"  P8 trial {trial + 1}/{trials}: {label}, batch {arm_batch} ...")
            figures[i].append(job_arm(b, f"job{i}", _batch(b, arm_batch), overrides))
        for k, amp in enumerate(("off", "bf16")):
            b.log(f"  P8 trial {trial + 1}/{trials}: {seeds_labels[k]} ...")
            figures[len(JOB_ARMS) + k].append(_seeds_arm(b, amp, batch))
    rows: list[Row] = []
    for i, (label, arm_batch, _) in enumerate(JOB_ARMS):
        rows.append(Row("P8", f"{gpu}, batch {_batch(b, arm_batch)}, epoch 2 of {EPOCHS}: {label}", "report",
                        _text(figures[i]), None,
                        {"accuracy_after_2_epochs": [f["accuracy"] for f in figures[i]],
                         "img_s": [f["img_s"] for f in figures[i]]}))
    for k, label in enumerate(seeds_labels):
        fs = figures[len(JOB_ARMS) + k]
        rows.append(Row("P8", f"{gpu}, batch {batch}, epoch 2 of {EPOCHS}: {label}", "report", _text(fs), None,
                        {"img_s": [round(f["img_s"], 1) for f in fs]}))
    ratios = [a["img_s"] / s["img_s"] for a, s in zip(figures[SEEDS_NETWORK], figures[len(JOB_ARMS)])]
    rows.append(Row("P8", "the seeds' network: ddpjob (bf16, GPU loader) / the seeds' recipe (fp32), images/s, "
                    "median of the trials' ratios", "report", f"{harness.median(ratios):.2f}x", None,
                    {"trial_ratios": [round(r, 3) for r in ratios]}))
    out = b.base / "P8" / "loaders.json"
    _call([sys.executable, "-m", "bench.p8", "loaders", str(b.root), str(batch), str(out)],
          b.base / "P8" / "loaders.log")
    alone = json.loads(out.read_text())
    rows.append(Row("P8", "loader alone into the GPU, images/s: ddpjob's / the seeds' (8 workers)", "report",
                    f"{alone['ddpjob']:.0f} / {alone['seeds']:.0f}", None))
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m bench.p8")
    sub = ap.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("seeds")
    s.add_argument("root")
    s.add_argument("batch", type=int)
    s.add_argument("amp", choices=["off", "bf16"])
    s.add_argument("out", type=Path)
    lo = sub.add_parser("loaders")
    lo.add_argument("root")
    lo.add_argument("batch", type=int)
    lo.add_argument("out", type=Path)
    a = ap.parse_args()
    if a.mode == "seeds":
        seeds_main(a.root, a.batch, a.amp, a.out)
    else:
        loaders_main(a.root, a.batch, a.out)
