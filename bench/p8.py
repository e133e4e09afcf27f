"""P8, one GPU: ddpjob's recipe against the seeds' at equal batch, the precision `amp = "auto"`
picks, torch.compile's modes and an async checkpoint every 10 steps (issue 25).

Every ddpjob arm is `ddpjob run jobs/cifar10_resnet18.toml` itself, one rank, with
`train.log_every` = one epoch, so metrics.jsonl's record at the end of epoch 2 is that epoch's
window exactly (img_s, data_ms = host time waiting in next(batches), step_ms; the window ends in
the loss's .item(), which waits for the GPU). Epoch 1 holds the warm-up (kernel choice, CUDA
graph recording, the loader's start) and is left out. The seeds' arm (`python -m bench.p8 seeds`)
is the seeds' loop timed the same way. Each arm is its own process, one after another: two side by
side would share the one GPU.

The plan:
1. **Cold compiles**, all at once (compiling is host work on many cores): ddpjob's default (the
   job file compiles, `compile_mode = "auto"`: CUDA graphs) at batch 128 and 512 and
   max-autotune-no-cudagraphs at 128, on the seeds' network, each into a cache of its own. Their
   start-up (launch to the end of the first step) is the cold start of a compiled run; measured
   side by side, it is an upper bound.
2. **Trials**, the arms interleaved (arm 1..n, then again), so a slow spell of the host hits all
   alike: at batch 128 and 512, the seeds' recipe (fp32, PIL, 8 workers), ddpjob's default
   recipe on the seeds' network (the job file with `cifar_stem = false`: compiled, `amp = "auto"`)
   with its cached graphs (a resumed start), the same eager (`compile = false`), and eager in the
   precision auto did not pick; max-autotune-no-cudagraphs from its cache; the default with an
   async checkpoint every 10 steps.
3. **The job as shipped** (CIFAR stem) for a few steps, for the precision auto picks there.

`--budget-s` (a lent GPU's time is short): an arm that would end past it is not started and its
row says so. Each finished arm is appended to WORK/P8/arms.jsonl at once.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from bench import harness
from bench.core import Bench, Row

EPOCHS = 2  # figures from the second
SEEDS_WORKERS = 8  # the seeds' DataLoader(num_workers=8)
BATCHES = (128, 512)  # per GPU: launch-bound, and large enough that the GPU sets the pace
SEEDS_NET = ("train.cifar_stem=false",)  # torchvision's ResNet-18 as the seeds build it
AMP = {"bf16": 'train.amp="bf16"', "fp32": 'train.amp="off"'}
EAGER = ("train.compile=false",)
AUTOTUNED = "max-autotune-no-cudagraphs"  # compiled without CUDA graphs, kernels timed: at 128 only
PROBE_STEPS = 20  # the shipped job's arm: enough for auto's measurement and a first step
# a first guess of an arm's seconds, until the same arm has run once (the budget's check)
GUESS_S = {"seeds": 30.0, "job": 35.0, "cold": 240.0}
_AUTO = re.compile(r"amp auto: (bf16|fp32) \(a training step measured ([0-9.]+) ms in bf16, ([0-9.]+) ms in fp32")


@dataclass(frozen=True)
class Arm:
    key: str  # run dir and log name
    label: str
    batch: int  # per GPU, before --tiny's scaling
    overrides: tuple[str, ...] = ()
    seeds: bool = False  # the seeds' loop (fp32) instead of `ddpjob run`
    cache: str = ""  # torch.compile's cache, shared by a mode's cold and warm arm
    steps: int = 0  # > 0: only this many steps (no epoch window)


def default_arm(batch: int, phase: str = "cached graphs") -> Arm:
    """The job file on the seeds' network: compiled into CUDA graphs (compile_mode auto), amp auto."""
    return Arm(f"default-{batch}-{phase.split()[0]}", f"ddpjob default (compiled, amp auto), batch {batch}, "
               f"{phase}", batch, SEEDS_NET, cache=f"default-{batch}")


def eager_arm(batch: int) -> Arm:
    return Arm(f"eager-{batch}", f"ddpjob eager (amp auto), batch {batch}", batch, SEEDS_NET + EAGER)


def precision_arm(batch: int, amp: str) -> Arm:
    return Arm(f"eager-{amp}-{batch}", f"ddpjob eager {amp}, batch {batch}", batch, SEEDS_NET + EAGER + (AMP[amp],))


def seeds_arm(batch: int) -> Arm:
    return Arm(f"seeds-{batch}", f"the seeds' recipe (fp32, PIL, {SEEDS_WORKERS} workers), batch {batch}",
               batch, seeds=True)


def autotuned_arm(phase: str) -> Arm:
    return Arm(f"autotuned-128-{phase.split()[0]}", f"compile {AUTOTUNED} (amp auto), batch 128, {phase}", 128,
               SEEDS_NET + (f'train.compile_mode="{AUTOTUNED}"',), cache="autotuned-128")


CHECKPOINTED = Arm("ckpt10-128", "ddpjob default, async checkpoint every 10 steps, batch 128", 128,
                   SEEDS_NET + ("checkpoint.every_steps=10", "checkpoint.keep_last=2"), cache="default-128")
SHIPPED = Arm("shipped-auto", f"the job as shipped (CIFAR stem, amp auto; eager), {PROBE_STEPS} steps", 128,
              EAGER, steps=PROBE_STEPS)


# ------------------------------------------------------------------------------ running an arm
def _env(cache: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = os.pathsep.join([str(harness.ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    if cache is not None:  # an exported cache wins over RUN_DIR/cache (ddpjob/node/compilecache.py)
        env["TORCHINDUCTOR_CACHE_DIR"], env["TRITON_CACHE_DIR"] = str(cache / "inductor"), str(cache / "triton")
        env["TORCH_LOGS"] = "perf_hints"  # the log says why a CUDA graph was not recorded
    return env


def _batch(b: Bench, batch: int) -> int:
    return batch if not b.sizes.tiny else b.sizes.batch * batch // 128


class Launch:
    """One arm's process, started now; `result()` waits for it and reads its figures."""

    def __init__(self, b: Bench, arm: Arm, *, cold: bool = False) -> None:
        self.b, self.arm, self.cold = b, arm, cold
        folder = b.base / "P8"
        self.run_dir, self.log = folder / arm.key, folder / f"{arm.key}.log"
        self.out = folder / f"{arm.key}.json"
        shutil.rmtree(self.run_dir, ignore_errors=True)
        cache = folder / "cache" / arm.cache if arm.cache else None
        if cache is not None and cold:
            shutil.rmtree(cache, ignore_errors=True)
        batch = _batch(b, arm.batch)
        if arm.seeds:
            args = [sys.executable, "-m", "bench.p8", "seeds", str(b.root), str(batch), str(self.out)]
        else:
            args = [sys.executable, "-m", "ddpjob", "run", str(harness.JOB), "--run-dir", str(self.run_dir)]
            for o in self._overrides(batch):
                args += ["--set", o]
        self.started, self.t0 = time.time(), time.monotonic()
        self._file: IO[str] = open(self.log, "w")
        self.proc = subprocess.Popen(args, stdout=self._file, stderr=subprocess.STDOUT, cwd=harness.ROOT,
                                     env=_env(cache))

    def _overrides(self, batch: int) -> list[str]:
        b, arm = self.b, self.arm
        spe = b.sizes.n_train // batch
        common = [f"data.root={json.dumps(str(b.root))}", f"train.batch_size={batch}",
                  "checkpoint.every_minutes=0", "checkpoint.every_steps=0", "slurm.tasks_per_node=1",
                  "slurm.gpus_per_node=1"]
        if arm.steps:
            common += [f"train.max_steps={arm.steps}", f"train.log_every={arm.steps}", "train.eval_every=0"]
        else:
            common += [f"train.epochs={EPOCHS}", "train.max_steps=0", f"train.log_every={spe}"]
        if b.sizes.tiny:
            common.append(f"train.model={json.dumps(b.sizes.model)}")
        return common + list(arm.overrides)

    def result(self, timeout: float = 1200) -> dict[str, Any]:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self._file.close()
        wall = time.monotonic() - self.t0
        text = self.log.read_text(errors="replace")
        if code != 0:
            raise RuntimeError(f"P8 {self.arm.key} exited {code}: {text[-2000:]}")
        if self.arm.seeds:
            return {**json.loads(self.out.read_text()), "wall_s": wall}
        return {**self._job_figures(), **_auto_choice(text), "wall_s": wall,
                "cudagraph_skips": text.count("skipping cudagraphs")}

    def _job_figures(self) -> dict[str, Any]:
        from ddpjob.fileio import read_jsonl
        from ddpjob.ledger import events

        batch = _batch(self.b, self.arm.batch)
        last = self.arm.steps or EPOCHS * (self.b.sizes.n_train // batch)
        records = read_jsonl(self.run_dir / "metrics.jsonl")
        rec = [r for r in records if r.get("step") == last and "img_s" in r]
        if not rec:
            raise RuntimeError(f"P8 {self.arm.key}: no metrics record at step {last} in {self.run_dir}")
        r = rec[-1]
        first = [e for e in events.read(self.run_dir) if e["event"] == "first_step"]
        acc = [x["eval_acc"] for x in records if "eval_acc" in x]
        return {"img_s": r["img_s"], "data_ms": r["data_ms"], "step_ms": r["step_ms"],
                "epoch_s": r["step_ms"] * (self.b.sizes.n_train // batch) / 1000,
                "first_step_s": first[0]["time"] - self.started if first else None,
                "graphs": first[0].get("graphs") if first else None,
                "accuracy": acc[-1] if acc else None}


def _auto_choice(log: str) -> dict[str, Any]:
    """What amp = "auto" chose, and its measurement, from the rank's log."""
    found = _AUTO.search(log)
    if not found:
        return {}
    return {"auto": found.group(1), "probe_bf16_ms": float(found.group(2)), "probe_fp32_ms": float(found.group(3))}


class Runs:
    """Each arm's figures by key and trial, appended to WORK/P8/arms.jsonl as they come; arms the
    budget left out are listed."""

    def __init__(self, b: Bench) -> None:
        self.b = b
        self.figures: dict[str, list[dict[str, Any]]] = {}
        self.skipped: list[str] = []
        self.seconds: dict[str, float] = {}
        self.file = b.base / "P8" / "arms.jsonl"
        self.file.unlink(missing_ok=True)

    def fits(self, arm: Arm, kind: str) -> bool:
        guess = self.seconds.get(arm.key, GUESS_S[kind])
        if time.monotonic() + guess <= self.b.deadline:
            return True
        self.skipped.append(arm.key)
        self.b.log(f"  P8: {arm.key} left out: the budget ends in "
                   f"{self.b.deadline - time.monotonic():.0f} s, the arm takes ~{guess:.0f} s")
        return False

    def add(self, arm: Arm, trial: int, fig: dict[str, Any]) -> None:
        self.figures.setdefault(arm.key, []).append(fig)
        self.seconds[arm.key] = fig["wall_s"]
        with open(self.file, "a", encoding="utf-8") as f:
            f.write(json.dumps({"arm": arm.key, "label": arm.label, "trial": trial, **fig}) + "\n")

    def run(self, arm: Arm, trial: int) -> None:
        if self.fits(arm, "seeds" if arm.seeds else "job"):
            self.b.log(f"  P8 trial {trial + 1}: {arm.label} ...")
            self.add(arm, trial, Launch(self.b, arm).result())


# ------------------------------------------------------------------------------ the plan
def p8(b: Bench) -> list[Row]:
    import torch

    if not torch.cuda.is_available():
        return [Row("P8", "GPU: the recipes, precision, compile modes, checkpoint cost", "report",
                    "not measured: no CUDA GPU on this machine", None)]
    b.root = harness.dataset(b.base, b.sizes)  # generated CIFAR-10-format files, not downloaded
    (b.base / "P8").mkdir(parents=True, exist_ok=True)
    runs = Runs(b)

    # 1. cold compiles, side by side
    colds = [default_arm(batch, "cold start") for batch in BATCHES] + [autotuned_arm("cold start")]
    if not b.sizes.tiny and runs.fits(colds[0], "cold"):
        # at most half the budget: the trials are what the budget is for
        limit = min(1200.0, (b.deadline - time.monotonic()) / 2)
        b.log(f"  P8: {len(colds)} cold compiles at once (at most {limit:.0f} s) ...")
        launches = [Launch(b, arm, cold=True) for arm in colds]
        ends = time.monotonic() + limit
        for launch in launches:
            try:
                runs.add(launch.arm, 0, launch.result(timeout=max(1.0, ends - time.monotonic())))
            except subprocess.TimeoutExpired:
                launch.proc.kill()
                launch.proc.wait()
                runs.skipped.append(f"{launch.arm.key} (not done after {limit:.0f} s)")

    _wait_for_quiet(b)
    # 2. the trials
    other: dict[int, Arm] = {}  # per batch: the precision auto did not pick, once it is known
    for trial in range(b.sizes.slow_trials):
        for batch in BATCHES:
            runs.run(seeds_arm(batch), trial)
            if default_arm(batch, "cold start").key in runs.figures:  # its graphs are cached
                runs.run(default_arm(batch), trial)
            runs.run(eager_arm(batch), trial)
            chosen = [f.get("auto") for f in runs.figures.get(eager_arm(batch).key, [])]
            if chosen and chosen[0]:
                other.setdefault(batch, precision_arm(batch, "fp32" if chosen[0] == "bf16" else "bf16"))
            if batch in other:
                runs.run(other[batch], trial)
        if autotuned_arm("cold start").key in runs.figures:
            runs.run(autotuned_arm("cached graphs"), trial)
        if default_arm(128, "cold start").key in runs.figures:
            runs.run(CHECKPOINTED, trial)
    # 3. what auto picks for the network the job file ships (a short run: its log line)
    runs.run(SHIPPED, 0)
    return rows(b, runs, other, torch.cuda.get_device_name(0))


def _wait_for_quiet(b: Bench) -> None:
    """Nothing is timed while b.hold exists (other GPU work beside the cold compiles)."""
    if b.hold is None or not b.hold.exists():
        return
    b.log(f"  P8: waiting until {b.hold} is gone ...")
    limit = time.monotonic() + 600
    while b.hold.exists() and time.monotonic() < limit:
        time.sleep(1)


# ------------------------------------------------------------------------------ the table
def _text(fs: list[dict[str, Any]]) -> str:
    """Medians over the trials; the images/s range when there are several."""
    ips = [f["img_s"] for f in fs]
    spread = f" ({min(ips):.0f}-{max(ips):.0f})" if len(fs) > 1 else ""
    share = harness.median([100 * f["data_ms"] / f["step_ms"] for f in fs])
    return (f"{harness.median(ips):.0f}{spread} img/s; loader {share:.1f}% of the step; "
            f"{harness.median([f['epoch_s'] for f in fs]):.2f} s/epoch")


def _ratio(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[float, list[float]]:
    """Median of the trials' ratios of images/s (trial i of A against trial i of B)."""
    ratios = [x["img_s"] / y["img_s"] for x, y in zip(a, b)]
    return harness.median(ratios), [round(r, 3) for r in ratios]


def rows(b: Bench, runs: Runs, other: dict[int, Arm], gpu: str) -> list[Row]:
    f = runs.figures
    out: list[Row] = []

    def report(measure: str, text: str, details: dict[str, Any] | None = None) -> None:
        out.append(Row("P8", f"{gpu}: {measure}", "report", text, None, details or {}))

    def starts(fs: list[dict[str, Any]]) -> list[float]:
        return [round(x["first_step_s"], 1) for x in fs if x.get("first_step_s") is not None]

    for batch in BATCHES:
        n = _batch(b, batch)
        seeds, default, eager = (f.get(arm.key, []) for arm in (seeds_arm(batch), default_arm(batch), eager_arm(batch)))
        for arm in (seeds_arm(batch), default_arm(batch), eager_arm(batch)) + ((other[batch],) if batch in other else ()):
            if arm.key in f:
                report(f"batch {n}, epoch 2 of {EPOCHS}: {arm.label}", _text(f[arm.key]),
                       {"img_s": [round(x["img_s"]) for x in f[arm.key]], "auto": [x.get("auto") for x in f[arm.key]],
                        "accuracy_after_2_epochs": [x.get("accuracy") for x in f[arm.key]]})
        for arms, what in ((default, "default recipe (compiled, amp auto)"), (eager, "recipe eager (amp auto)")):
            if arms and seeds:
                ratio, each = _ratio(arms, seeds)
                default_row = arms is default
                out.append(Row("P8", f"{gpu}: P2 at batch {n}, the seeds' network: ddpjob's {what}, GPU loader / "
                               "the seeds' recipe, images/s", ">= 1.5x" if default_row and batch == 512 else "report",
                               f"{ratio:.2f}x", ratio >= 1.5 if default_row and batch == 512 else None,
                               {"trial_ratios": each}))
        if default and eager:
            ratio, each = _ratio(default, eager)
            cold = f.get(default_arm(batch, "cold start").key, [])
            report(f"batch {n}: compiled into CUDA graphs (the default) / eager, images/s", f"{ratio:.2f}x",
                   {"trial_ratios": each, "cold_start_s": starts(cold), "cached_start_s": starts(default),
                    "eager_start_s": starts(eager), "graphs": [x.get("graphs") for x in cold + default],
                    "cudagraph_skips": [x.get("cudagraph_skips") for x in cold + default]})
        if eager and batch in other and other[batch].key in f:
            ratio, each = _ratio(eager, f[other[batch].key])
            report(f"batch {n}, eager: amp auto's pick / the other precision, images/s", f"{ratio:.2f}x",
                   {"trial_ratios": each, "picks": [x.get("auto") for x in eager],
                    "probe_ms": [(x.get("probe_bf16_ms"), x.get("probe_fp32_ms")) for x in eager]})
    eager128, tuned = f.get(eager_arm(128).key, []), f.get(autotuned_arm("cached graphs").key, [])
    if tuned and eager128:
        ratio, each = _ratio(tuned, eager128)
        report(f"batch {_batch(b, 128)}: compiled {AUTOTUNED} / eager, images/s", f"{ratio:.2f}x",
               {"trial_ratios": each, "cold_start_s": starts(f.get(autotuned_arm("cold start").key, [])),
                "cached_start_s": starts(tuned)})
    if CHECKPOINTED.key in f and default_arm(128).key in f:
        ratio, each = _ratio(f[CHECKPOINTED.key], f[default_arm(128).key])
        report(f"batch {_batch(b, 128)}: async checkpoint every 10 steps / none, images/s", f"{ratio:.3f}x",
               {"trial_ratios": each})
    if SHIPPED.key in f:
        s = f[SHIPPED.key][0]
        report("the job as shipped (CIFAR stem, batch 128): amp auto's pick",
               f"{s.get('auto', '?')} (a step: {s.get('probe_bf16_ms')} ms in bf16, {s.get('probe_fp32_ms')} ms in fp32)")
    if runs.skipped:
        report("arms the budget left out", ", ".join(runs.skipped))
    return out


# ------------------------------------------------------------------------------ the seeds' loop
def _device() -> Any:
    import torch

    # the CPU only so that the loop can be tried where no GPU is
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def seeds_main(root: str, batch: int, out: Path) -> None:
    """The seeds' loop (001's resnet_ddp.py on one GPU): torchvision ResNet-18, torchvision CIFAR10
    with PIL transforms in a DataLoader(num_workers=8) and a DistributedSampler (world 1), no
    pinned memory, SGD lr 0.1 momentum 0.9 weight decay 1e-5, cross-entropy, fp32, `.to(device)`
    per batch."""
    import torch
    import torch.nn as nn
    import torchvision
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from bench.recipes import _pil_dataset

    device = _device()
    torch.manual_seed(0)
    ds = _pil_dataset(root)
    sampler: DistributedSampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
    # drop_last: every step a full batch, as ddpjob's arms (the seeds keep a last short batch)
    loader = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=SEEDS_WORKERS, drop_last=True,
                        persistent_workers=True)
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


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m bench.p8")
    sub = ap.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("seeds")
    s.add_argument("root")
    s.add_argument("batch", type=int)
    s.add_argument("out", type=Path)
    a = ap.parse_args()
    seeds_main(a.root, a.batch, a.out)
