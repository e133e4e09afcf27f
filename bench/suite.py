"""The benchmarks P1-P8: each builds its two arms, interleaves their trials and returns rows.

A row's figure is the median over trial pairs of A_i / B_i (pairs taken back to back, so a
machine that slows down for a while slows both sides of the pair). Step rates come from
timestamps taken after `warm` steps, so first-iteration costs (DDP's bucket rebuild, allocator
warm-up) are left out. run.py prints the rows; README.md explains each id.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import Arm, Sizes, interleave, median, window_rate


@dataclass
class Row:
    id: str
    measure: str
    goal: str
    measured: str
    passed: bool | None  # None: no goal to pass (or not measured)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Bench:
    sizes: Sizes
    base: Path  # work dir: data, workers' logs, run dirs
    root: Path  # the CIFAR-10-format data root
    log: Callable[[str], None] = print
    pools: harness.Pools = field(init=False)

    def __post_init__(self) -> None:
        self.pools = harness.Pools(self.base)

    def config(self, world: int, *overrides: str) -> str:
        return harness.job_config(self.root, self.sizes, world, *overrides)

    def run(self, arms: list[Arm], trials: int | None = None,
            params: Callable[[Arm, int], dict[str, Any]] = lambda arm, i: {}) -> list[list[dict[str, Any]]]:
        try:
            out = interleave(self.pools, arms, trials or self.sizes.trials, self.base, params, log=self.log)
        finally:
            self.pools.reset()
        return [out[a.name] for a in arms]

    def close(self) -> None:
        self.pools.close()


def _ratio_row(id: str, measure: str, goal: str, ratios: list[float], need: float,
               **details: Any) -> Row:
    r = median(ratios)
    return Row(id, measure, goal, f"{r:.2f}x", r >= need,
               {"pair_ratios": [round(x, 3) for x in ratios], **details})


def _rates(results: list[dict[str, Any]], start: int, end: int) -> list[float]:
    return [window_rate(r["times"], start, end) for r in results]


# ------------------------------------------------------------------------------------ P1
def p1(b: Bench) -> list[Row]:
    s = b.sizes
    cfg = b.config(2)
    a, bare = b.run([Arm("P1-ddpjob", "fit", 2, {"config": cfg}), Arm("P1-bare", "bare", 2, {"config": cfg})])
    ra, rb = _rates(a, s.warm, s.warm + s.steps), _rates(bare, s.warm, s.warm + s.steps)
    equal = all(x["loss"] == y["loss"] for x in a for y in bare) and bool(a[0]["loss"])
    ratio = median([x / y for x, y in zip(ra, rb)])
    first = bare[0]["loss"]
    shown = ", ".join(f"{first[k]:.4f}" for k in sorted(first, key=int)[:3])
    return [Row("P1", "trainer steps/s / bare DDP loop (2 ranks x 1 thread)", ">= 0.97x; equal losses",
                f"{ratio:.2f}x; losses {'equal' if equal else 'DIFFER'}", ratio >= 0.97 and equal,
                {"pair_ratios": [round(x / y, 3) for x, y in zip(ra, rb)],
                 "ddpjob_steps_s": round(median(ra), 3), "bare_steps_s": round(median(rb), 3),
                 "loss_steps": len(first), "loss_first": shown,
                 "ddpjob_loss": a[0]["loss"], "bare_loss": first})]


# ------------------------------------------------------------------------------------ P2
def p2(b: Bench) -> list[Row]:
    s = b.sizes
    cfg = b.config(2)
    a, seeds = b.run([Arm("P2-ddpjob", "fit", 2, {"config": cfg}), Arm("P2-seeds", "seeds", 2, {"config": cfg})])
    ra, rb = _rates(a, s.warm, s.warm + s.steps), _rates(seeds, s.warm, s.warm + s.steps)
    img = 2 * s.batch
    return [_ratio_row("P2", "default recipe / seeds' recipe, images/s (2 ranks x 1 thread)", ">= 1.5x",
                       [x / y for x, y in zip(ra, rb)], 1.5,
                       ddpjob_img_s=round(img * median(ra), 1), seeds_img_s=round(img * median(rb), 1))]


# ------------------------------------------------------------------------------------ P3
def p3(b: Bench) -> list[Row]:
    s = b.sizes
    cfg = b.config(1)
    n = {"P3-ddpjob": s.loader_batches, "P3-pil": s.pil_batches}
    a, pil = b.run([Arm("P3-ddpjob", "tensor_loader", 1, {"config": cfg}),
                    Arm("P3-pil", "pil_loader", 1, {"config": cfg})],
                   params=lambda arm, i: {"batches": n[arm.name]})
    ia = [r["images"] / r["seconds"] for r in a]
    ib = [r["images"] / r["seconds"] for r in pil]
    return [_ratio_row("P3", "ddpjob loader / per-sample PIL pipeline, images/s (1 core)", ">= 10x",
                       [x / y for x, y in zip(ia, ib)], 10.0,
                       ddpjob_img_s=round(median(ia)), pil_img_s=round(median(ib)))]


# ------------------------------------------------------------------------------------ P4
def p4(b: Bench) -> list[Row]:
    s = b.sizes
    cfg = b.config(1)
    a, ready = b.run([Arm("P4-loader", "train_loop", 1, {"config": cfg, "source": "loader"}),
                      Arm("P4-ready", "train_loop", 1, {"config": cfg, "source": "ready"})])
    ra, rb = _rates(a, s.warm, s.warm + s.steps), _rates(ready, s.warm, s.warm + s.steps)
    return [_ratio_row("P4", "data stall: (loader + train) / train on ready tensors (1 core)",
                       ">= 0.98x", [x / y for x, y in zip(ra, rb)], 0.98,
                       loader_steps_s=round(median(ra), 3), ready_steps_s=round(median(rb), 3))]


# ------------------------------------------------------------------------------------ P5
def p5(b: Bench) -> list[Row]:
    s = b.sizes
    two, one = b.run([Arm("P5-2ranks", "fit", 2, {"config": b.config(2)}),
                      Arm("P5-1rank", "fit", 1, {"config": b.config(1)})])
    ia = [2 * s.batch * r for r in _rates(two, s.warm, s.warm + s.steps)]
    ib = [s.batch * r for r in _rates(one, s.warm, s.warm + s.steps)]
    return [_ratio_row("P5", "2 ranks x 1 thread / 1 rank x 1 thread, images/s (batch/rank kept)",
                       ">= 1.7x", [x / y for x, y in zip(ia, ib)], 1.7,
                       two_ranks_img_s=round(median(ia), 1), one_rank_img_s=round(median(ib), 1))]


# ------------------------------------------------------------------------------------ P6
def p6(b: Bench) -> list[Row]:
    s = b.sizes
    every = s.ckpt_every
    tail = 4 * s.log_every  # steps after the save: the background write finishes in the window
    total = every + tail
    common = (f"train.max_steps={total}", "checkpoint.async=true", "checkpoint.every_minutes=0")
    with_ckpt, without = b.run([
        Arm("P6-ckpt", "fit", 2, {"config": b.config(2, *common, f"checkpoint.every_steps={every}")}),
        Arm("P6-none", "fit", 2, {"config": b.config(2, *common, "checkpoint.every_steps=0")})])
    # The window [total - every, total] holds exactly one checkpoint (at step `every`).
    ra, rb = _rates(with_ckpt, total - every, total), _rates(without, total - every, total)
    ratios = [x / y for x, y in zip(ra, rb)]
    (saves,) = b.run([Arm("P6-save", "async_save", 1, {"config": b.config(1)})], trials=1,
                     params=lambda arm, i: {"saves": s.saves})
    ms = [1000 * x for x in saves[0]["blocking_s"]]
    steady = median(ms[1:]) if len(ms) > 1 else ms[0]
    r = median(ratios)
    return [
        Row("P6", f"steps/s with an async checkpoint every {every} steps / none (2 ranks)", ">= 0.99x",
            f"{r:.3f}x", r >= 0.99, {"pair_ratios": [round(x, 4) for x in ratios],
                                      "ckpt_steps_s": round(median(ra), 3), "none_steps_s": round(median(rb), 3)}),
        Row("P6", "blocking time of an async save (ResNet-18 + SGD state)" if not s.tiny
            else f"blocking time of an async save ({s.model} + SGD state)", "<= 50 ms",
            f"{steady:.1f} ms", steady <= 50, {"each_ms": [round(x, 1) for x in ms],
                                               "note": "median of saves after the first (the first allocates)"}),
    ]


# ------------------------------------------------------------------------------------ P7
def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class _Ranks:
    """`ddpjob run JOB.toml --run-dir D` on 2 ranks, as torchrun / the local backend start them."""

    def __init__(self, b: Bench, run_dir: Path, overrides: list[str], restart: int) -> None:
        port = harness.free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs = [run_dir.parent / f"{run_dir.name}-rank{r}-restart{restart}.log" for r in range(2)]
        self.started = time.time()
        for rank in range(2):
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "DDPJOB_"))}
            env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        # not a SLURM job id: the stop never calls scontrol
                        "DDPJOB_JOB_ID": "bench", "DDPJOB_RESTART_COUNT": str(restart),
                        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
            cmd = [sys.executable, "-m", "ddpjob", "run", str(harness.JOB), "--run-dir", str(run_dir)]
            for o in overrides:
                cmd += ["--set", o]
            with open(self.logs[rank], "wb") as out:
                self.procs.append(subprocess.Popen(
                    cmd, cwd=harness.ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                    preexec_fn=(lambda r=rank: harness.pin_to(r))))

    def signal(self, signum: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signum)

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in self.procs]
        except subprocess.TimeoutExpired:
            for p in self.procs:
                p.kill()
                p.wait()
            raise RuntimeError(f"ddpjob run ranks still running after {timeout} s:\n{self.output()}") from None

    def output(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in self.logs)


def _first_step_time(run_dir: Path, restart: int, timeout: float, ranks: _Ranks) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        recs = [r for r in _metrics(run_dir) if r["kind"] == "train" and r.get("restart") == restart]
        if recs:
            return recs[0]
        if any(p.poll() is not None for p in ranks.procs):
            break
        time.sleep(0.02)
    raise RuntimeError(f"no first step of restart {restart} in {run_dir}:\n{ranks.output()}")


def p7(b: Bench) -> list[Row]:
    s = b.sizes
    stop_after = 2  # signal once this step is logged: the stop lands at a step boundary soon after
    overrides = [f"data.root={json.dumps(str(b.root))}", f"train.model={json.dumps(s.model)}",
                 "train.cifar_stem=false", f"train.batch_size={s.batch}", "train.log_every=1",
                 "train.threads=1", "train.backend=\"gloo\"", "slurm.tasks_per_node=2",
                 "slurm.gpus_per_node=0", "slurm.cpus_per_task=1"]
    cold_s, resume_s, lost = [], [], []
    for i in range(s.trials):
        run_dir = b.base / "runs" / f"P7-{i}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        total = 1000  # never reached: the signal stops the first run, the second is stopped too
        ov = [*overrides, f"train.max_steps={total}"]
        cold = _Ranks(b, run_dir, ov, restart=0)
        first = _first_step_time(run_dir, 0, 600, cold)
        cold_s.append(first["time"] - cold.started)
        while max((r["step"] for r in _metrics(run_dir) if r["kind"] == "train"), default=0) < stop_after:
            time.sleep(0.02)
        cold.signal(signal.SIGUSR2)
        codes = cold.wait(300)
        if codes != [3, 3]:
            raise RuntimeError(f"P7: the signalled ranks exited {codes}, expected 3 (requeue):\n{cold.output()}")
        done = max(r["step"] for r in _metrics(run_dir) if r["kind"] == "train" and r["restart"] == 0)
        again = _Ranks(b, run_dir, ov, restart=1)
        first = _first_step_time(run_dir, 1, 600, again)
        resume_s.append(first["time"] - again.started)
        start = [e for e in _events(run_dir) if e.get("event") == "start" and e.get("restart") == 1]
        resumed = start[0].get("resumed_step") if start else None
        # Steps lost: done before the stop but not in the checkpoint (they must be run again).
        lost.append(done - (resumed if resumed is not None else 0))
        again.signal(signal.SIGUSR2)
        again.wait(300)
        b.log(f"  P7 trial {i}: cold start {cold_s[-1]:.2f} s, resumed start {resume_s[-1]:.2f} s, "
              f"stopped after step {done}, resumed from {resumed}")
    ratios = [r / c for r, c in zip(resume_s, cold_s)]
    worst = max(lost)
    ratio = median(ratios)
    return [Row("P7", "steps lost after a signalled stop (USR2, 2 ranks)", "<= 1", str(worst), worst <= 1,
                {"lost": lost}),
            Row("P7", "start to first resumed step / cold start to first step", "<= 1.2x",
                f"{ratio:.2f}x", ratio <= 1.2, {"pair_ratios": [round(x, 3) for x in ratios],
                                                "cold_s": [round(x, 2) for x in cold_s],
                                                "resumed_s": [round(x, 2) for x in resume_s]})]


# ------------------------------------------------------------------------------------ P8
def p8(b: Bench) -> list[Row]:
    import torch

    if torch.cuda.is_available():
        measured, passed = "not measured: GPU present but the GPU benchmark is not implemented", None
    else:
        measured, passed = "not measured: no GPU lent", None
    return [Row("P8", "GPU: images/s, loader share of step time, bf16 vs fp32", "report", measured, passed)]


BENCHMARKS: dict[str, Callable[[Bench], list[Row]]] = {
    "P1": p1, "P2": p2, "P3": p3, "P4": p4, "P5": p5, "P6": p6, "P7": p7, "P8": p8}
