"""The benchmarks P1-P10: each builds its two arms, runs them side by side and returns rows.

Most figures come from `pool.lockstep`: arm A (ddpjob) and arm B (the reference) run at the
same time and take turns step by step, and a trial's ratio is B's median step time over A's
(after `warm` steps: first-iteration costs such as DDP's bucket rebuild are left out); the
figure is the median over trials. run.py prints the rows; bench/README.md explains each id.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import harness
from bench.core import Bench, Row
from bench.harness import Arm, Trial, median, rate, step_costs


@dataclass
class Compared:
    """A against B over the same steps: per-trial ratios of steps/s (median step), by wall
    time (the figure: steps/s is what a user gets) and by CPU time (shown alongside)."""

    wall: list[float]
    cpu: list[float]
    a_rate: float  # median over trials of A's steps/s
    b_rate: float

    @staticmethod
    def of(a: list[Trial], b: list[Trial], start: int, end: int, a_scale: float = 1.0,
           b_scale: float = 1.0, b_end: int | None = None) -> Compared:
        """Steps start+1..end (B: ..b_end); `*_scale`: images per step, when the two sides
        make different steps (P5)."""
        b_end = end if b_end is None else b_end

        def pairs(clock: str) -> list[float]:
            return [a_scale * rate(x, start, end, clock) / (b_scale * rate(y, start, b_end, clock))
                    for x, y in zip(a, b)]

        return Compared(pairs("wall"), pairs("cpu"), median([rate(x, start, end) for x in a]),
                        median([rate(y, start, b_end) for y in b]))

    def row(self, id: str, measure: str, goal: str, need: float, digits: int = 2,
            **details: Any) -> Row:
        r = median(self.wall)
        return Row(id, measure, goal, f"{r:.{digits}f}x", r >= need,
                   {"trial_ratios": [round(x, 3) for x in self.wall],
                    "by_cpu_time": f"{median(self.cpu):.{digits}f}x {[round(x, 3) for x in self.cpu]}",
                    **details})


# ------------------------------------------------------------------------------------ P1
def p1(b: Bench) -> list[Row]:
    import torch

    from ddpjob.train.precision import amp_dtype_for, dtype_name

    s = b.sizes
    # The precision pinned to what "auto" means on this CPU: the trainer's auto times bf16 against
    # fp32 when the run begins, and on a busy host that race can pick fp32 while the bare loop
    # (which cannot measure) computes in bf16; P1 compares one computation, not that choice.
    amp = dtype_name(amp_dtype_for("auto", torch.device("cpu")))  # "bf16" or "off": a train.amp value
    cfg = b.config(2, f"train.amp={json.dumps(amp)}")
    a, bare = b.lockstep(Arm("P1-ddpjob", "fit", 2, {"config": cfg}),
                         Arm("P1-bare", "bare", 2, {"config": cfg}))
    c = Compared.of(a, bare, s.warm, s.warm + s.steps)
    losses_a, losses_b = [t[0]["loss"] for t in a], [t[0]["loss"] for t in bare]
    equal = bool(losses_a[0]) and all(x == y for x in losses_a for y in losses_b)
    first = losses_b[0]
    row = c.row("P1", "trainer steps/s / bare DDP loop (2 ranks x 1 thread)", ">= 0.97x; equal losses",
                0.97, digits=3, ddpjob_steps_s=round(c.a_rate, 3), bare_steps_s=round(c.b_rate, 3),
                loss_steps=len(first),
                loss_first=", ".join(f"{first[k]:.4f}" for k in sorted(first, key=int)[:3]),
                ddpjob_loss=losses_a[0], bare_loss=first)
    row.measured += f"; losses {'equal' if equal else 'DIFFER'}"
    row.passed = bool(row.passed) and equal
    return [row]


# ------------------------------------------------------------------------------------ P9
def p9(b: Bench) -> list[Row]:
    """The public API's cost: examples/charlm/train.py as written against the same script with
    job.steps/job.log replaced by a plain range and a hand-written loss all-reduce."""
    s = b.sizes
    steps = s.warm + s.steps
    cfg = harness.charlm_config(steps)
    a, hand = b.lockstep(Arm("P9-api", "charlm", 2, {"config": cfg, "mode": "api"}),
                         Arm("P9-hand", "charlm", 2, {"config": cfg, "mode": "hand"}))
    c = Compared.of(a, hand, s.warm, steps)
    equal = all(x[0]["loss"] == y[0]["loss"] for x, y in zip(a, hand)) and bool(a[0][0]["loss"])
    row = c.row("P9", "charlm example: API loop steps/s / same loop by hand (2 ranks x 1 thread)",
                ">= 0.99x; equal losses", 0.99, digits=3, api_steps_s=round(c.a_rate, 3),
                hand_steps_s=round(c.b_rate, 3), api_loss=a[0][0]["loss"], hand_loss=hand[0][0]["loss"])
    row.measured += f"; losses {'equal' if equal else 'DIFFER'}"
    row.passed = bool(row.passed) and equal
    return [row]


# ------------------------------------------------------------------------------------ P10
def p10(b: Bench) -> list[Row]:
    """The stop vote off the critical path: the charlm API loop (P9's A arm) with
    train.stop_vote = "overlap" against the same loop with the blocking "sync" vote."""
    s = b.sizes
    steps = s.warm + s.steps
    over, sync = b.lockstep(
        Arm("P10-overlap", "charlm", 2, {"config": harness.charlm_config(steps, "overlap"), "mode": "api"}),
        Arm("P10-sync", "charlm", 2, {"config": harness.charlm_config(steps, "sync"), "mode": "api"}))
    c = Compared.of(over, sync, s.warm, steps)
    equal = all(x[0]["loss"] == y[0]["loss"] for x, y in zip(over, sync)) and bool(over[0][0]["loss"])
    step_ms = 1000.0 / c.b_rate if c.b_rate else 0.0
    row = c.row("P10", "charlm API loop, overlapped stop vote / blocking vote, steps/s (2 ranks x 1 thread)",
                ">= 1.0x; equal losses", 1.0, digits=3, overlap_steps_s=round(c.a_rate, 3),
                sync_steps_s=round(c.b_rate, 3), sync_step_ms=round(step_ms, 2))
    row.measured += f"; sync step {step_ms:.1f} ms; losses {'equal' if equal else 'DIFFER'}"
    row.passed = bool(row.passed) and equal
    return [row]


# ------------------------------------------------------------------------------------ P13
def p13(b: Bench) -> list[Row]:
    """In-memory snapshots (checkpoint.snapshot_every, store/memsnap.py): the same run with a
    snapshot after every step against none, side by side. By mean step time (window_rate): the
    copy and the background write land in the steps around each snapshot, which a median
    would leave out. The cost of one snapshot, as a fraction of a step, gives the interval
    that keeps it within 1% (the goal): N >= cost / 0.01."""
    import math

    s = b.sizes
    steps = s.warm + s.steps
    rows = []
    models = [("jobs/smoke.toml's network (cnn_tiny)", "cnn_tiny")] + ([] if s.tiny else [(s.model, s.model)])
    for label, model in models:
        over = [f"train.model={json.dumps(model)}", "checkpoint.every_steps=0"]
        snap, none = b.lockstep(Arm("P13-snapshot", "fit", 2, {"config": b.config(2, *over, "checkpoint.snapshot_every=1")}),
                                Arm("P13-none", "fit", 2, {"config": b.config(2, *over)}), steps=steps)
        ratios = [harness.window_rate(y, s.warm, steps) / harness.window_rate(x, s.warm, steps)
                  for x, y in zip(snap, none)]
        cost = max(0.0, median(ratios) - 1.0)  # one snapshot, as a fraction of a step
        every = max(1, math.ceil(cost / 0.01))
        step_ms = 1000.0 / median([harness.window_rate(y, s.warm, steps) for y in none])
        rows.append(Row("P13", f"a snapshot after every step / none, mean step time, {label} (2 ranks x 1 thread)",
                        "<= 1% of the step time at the interval", f"{1 + cost:.3f}x: one snapshot = {100 * cost:.1f}% "
                        f"of a {step_ms:.0f} ms step, so snapshot_every >= {every} keeps it <= 1%", True,
                        {"trial_ratios": [round(r, 3) for r in ratios], "step_ms": round(step_ms, 1),
                         "interval_for_1pct": every}))
    return rows


# ------------------------------------------------------------------------------------ P14
def p14(b: Bench) -> list[Row]:
    """The straggler watch's cost (rank/straggler.py): the same run with the watch on
    (train.straggler_window = 20: two perf_counter stamps and two forward pre-hooks per step, a
    hook on each parameter's gradient accumulation, two more vote slots per rank, rank 0's
    medians every 10 steps) against
    it off, side by side, by mean step time. Goal: <= 1% of the step time."""
    s = b.sizes
    steps = s.warm + s.steps
    over = ['train.model="cnn_tiny"', "checkpoint.every_steps=0"]
    on, off = b.lockstep(Arm("P14-watch", "fit", 2, {"config": b.config(2, *over, "train.straggler_window=20")}),
                         Arm("P14-off", "fit", 2, {"config": b.config(2, *over, "train.straggler_window=0")}),
                         steps=steps)
    ratios = [harness.window_rate(y, s.warm, steps) / harness.window_rate(x, s.warm, steps) for x, y in zip(on, off)]
    cost = median(ratios) - 1.0
    step_ms = 1000.0 / median([harness.window_rate(y, s.warm, steps) for y in off])
    return [Row("P14", "straggler watch on / off, mean step time, jobs/smoke.toml's network (2 ranks x 1 thread)",
                "<= 1% of the step time", f"{1 + cost:.3f}x ({100 * cost:+.1f}% of a {step_ms:.0f} ms step)",
                cost <= 0.01, {"trial_ratios": [round(r, 3) for r in ratios], "step_ms": round(step_ms, 1)})]


# ------------------------------------------------------------------------------------ P2
def p2(b: Bench) -> list[Row]:
    s = b.sizes
    cfg = b.config(2)
    a, seeds = b.lockstep(Arm("P2-ddpjob", "fit", 2, {"config": cfg}),
                          Arm("P2-seeds", "seeds", 2, {"config": cfg}))
    c = Compared.of(a, seeds, s.warm, s.warm + s.steps)
    img = 2 * s.batch
    rows = [c.row("P2", "default recipe / seeds' recipe, images/s (2 ranks x 1 thread)", ">= 1.5x", 1.5,
                  ddpjob_img_s=round(img * c.a_rate, 1), seeds_img_s=round(img * c.b_rate, 1))]
    if s.tiny:  # a cold compile takes minutes: tests/unit/test_compile.py checks the path in CI
        return rows
    # train.compile: the same steps compiled (the compile falls in the warm-up steps; P7 counts it)
    a, seeds = b.lockstep(Arm("P2c-ddpjob", "fit", 2, {"config": b.config(2, "train.compile=true")}),
                          Arm("P2c-seeds", "seeds", 2, {"config": cfg}))
    c = Compared.of(a, seeds, s.warm, s.warm + s.steps)
    rows.append(c.row("P2", "default recipe with train.compile / seeds' recipe, images/s (2 ranks x 1 thread)",
                      ">= 1.5x", 1.5, ddpjob_img_s=round(img * c.a_rate, 1),
                      seeds_img_s=round(img * c.b_rate, 1)))
    return rows


# ------------------------------------------------------------------------------------ P3
def p3(b: Bench) -> list[Row]:
    s = b.sizes
    cfg = b.config(1)
    n = {"P3-ddpjob": s.loader_batches, "P3-pil": s.pil_batches}
    # whole trials in turn: a ddpjob batch takes ~1 ms, too short to take turns at
    a, pil = b.interleave([Arm("P3-ddpjob", "tensor_loader", 1, {"config": cfg}),
                           Arm("P3-pil", "pil_loader", 1, {"config": cfg})],
                          params=lambda arm, i: {"batches": n[arm.name]})
    # "steps" are batches here; both loaders make batches of the same size
    c = Compared.of(a, pil, 0, s.loader_batches, b_end=s.pil_batches)
    return [c.row("P3", "ddpjob loader / per-sample PIL pipeline, images/s (1 core)", ">= 10x", 10.0,
                  ddpjob_img_s=round(s.batch * c.a_rate), pil_img_s=round(s.batch * c.b_rate))]


# ------------------------------------------------------------------------------------ P4
def p4(b: Bench) -> list[Row]:
    s = b.sizes
    cfg = b.config(1)
    a, ready = b.lockstep(Arm("P4-loader", "train_loop", 1, {"config": cfg, "source": "loader"}),
                          Arm("P4-ready", "train_loop", 1, {"config": cfg, "source": "ready"}))
    c = Compared.of(a, ready, s.warm, s.warm + s.steps)
    return [c.row("P4", "data stall: (loader + train) / train on ready tensors (1 core)", ">= 0.98x",
                  0.98, digits=3, loader_steps_s=round(c.a_rate, 3), ready_steps_s=round(c.b_rate, 3))]


# ------------------------------------------------------------------------------------ P5
def p5(b: Bench) -> list[Row]:
    """Three times: on the seeds' network (as everywhere else), the same with bf16 gradient
    compression, and on the job file's own network (CIFAR stem: ~8x the step time for the
    same 45 MB of gradients to all-reduce)."""
    s = b.sizes
    rows = []
    for label, stem, warm, steps in (("seeds' network", [], s.warm, s.steps),
                                     # the 2-rank arm's gradients travel as bfloat16: half the
                                     # 45 MB all-reduce that bounds this network (README)
                                     ("seeds' network, train.grad_compression = bf16",
                                      ['train.grad_compression="bf16"'], s.warm, s.steps),
                                     ("job file's network (CIFAR stem)",
                                      ["train.cifar_stem=true"], s.stem_warm, s.stem_steps)):
        over = [*stem, f"train.max_steps={warm + steps}"]
        two, one = b.lockstep(Arm("P5-2ranks", "fit", 2, {"config": b.config(2, *over)}),
                              Arm("P5-1rank", "fit", 1, {"config": b.config(1, *over)}),
                              steps=warm + steps, trials=s.slow_trials)
        c = Compared.of(two, one, warm, warm + steps, a_scale=2 * s.batch, b_scale=s.batch)
        row = c.row("P5", f"2 ranks x 1 thread / 1 rank x 1 thread, images/s, {label}", ">= 1.7x",
                    1.7, two_ranks_img_s=round(2 * s.batch * c.a_rate, 1),
                    one_rank_img_s=round(s.batch * c.b_rate, 1))
        # 2 ranks need both cores, 1 rank leaves the neighbours the other: on a busy machine the
        # wall clock is against the 2 ranks (README); the CPU-time ratio is what an idle one gives
        row.measured += f" (CPU time: {median(c.cpu):.2f}x)"
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------ P6
def _in(rank: dict[str, Any], e: dict[str, Any], start: int, end: int) -> bool:
    """Whether a timed call began between the end of step `start` and the end of step `end`,
    by this rank's own marks: a rank may reach the save before rank 0 has logged the step
    (rank 0 also writes metrics.jsonl), and rank 0's clock would leave that save out."""
    return rank["marks"][str(start)][0] <= e["at"] < rank["marks"][str(end)][0]


def _checkpoint_cost(trial: Trial, start: int, end: int) -> float:
    """Seconds the checkpoints after step `start` (up to step `end`) took from the training
    loop, the most over the ranks: main thread blocked in save/commit (wall) plus the writer
    thread's CPU (taken from the rank's core)."""
    return max(sum(e["s"] for e in r["checkpoint"] if _in(r, e, start, end)) for r in trial)


def _parts(trials: list[Trial], start: int, end: int, per: int = 1) -> dict[str, dict[str, int]]:
    """Where the cost went, per rank: ms per timed call kind (save, commit_pending,
    finish_pending, _run = the writer thread's CPU) between the marks of steps `start` and
    `end`, divided by `per` checkpoints, median over the trials."""
    out: dict[str, dict[str, int]] = {}
    for rank in range(len(trials[0])):
        kinds = sorted({e["what"] for t in trials for e in t[rank]["checkpoint"]})
        out[f"rank {rank}"] = {k: round(1000 * median([sum(
            e["s"] for e in t[rank]["checkpoint"] if e["what"] == k and _in(t[rank], e, start, end))
            for t in trials]) / per) for k in kinds}
    return out


def _excess(trial: Trial, warm: int, every: int, total: int) -> float:
    """Wall time the steps after the checkpoint took beyond the median step before it."""
    typical = median(step_costs(trial, warm, every if every > warm else total))  # (--tiny: none before)
    return sum(d - typical for d in step_costs(trial, every, total))


def p6(b: Bench) -> list[Row]:
    s = b.sizes
    every, often, total = s.ckpt_every, s.ckpt_often, s.ckpt_every + s.ckpt_tail
    common = (f"train.max_steps={total}", "checkpoint.async=true", "checkpoint.every_minutes=0")
    cfg_often = b.config(2, *common, f"checkpoint.every_steps={often}")
    # Whole trials in turn, not lockstep: the background writer would run during the other
    # arm's steps. The checkpoints are timed where they happen (worker.py).
    ck, ck_often, no = b.interleave(trials=s.slow_trials, arms=[
        Arm("P6-ckpt", "fit", 2, {"config": b.config(2, *common, f"checkpoint.every_steps={every}")}),
        Arm("P6-ckpt-often", "fit", 2, {"config": cfg_often}),
        Arm("P6-none", "fit", 2, {"config": b.config(2, *common, "checkpoint.every_steps=0")})])
    step_s = median([1 / rate(t, s.warm, total) for t in no])  # a step without checkpoints
    # mark `every` ends the step the checkpoint follows; the final save after `total` is not counted
    costs = [_checkpoint_cost(t, every, total) for t in ck]
    cost_s = median(costs)
    r = every * step_s / (every * step_s + cost_s)
    excess = median([_excess(t, s.warm, every, total) for t in ck]) - \
        median([_excess(t, s.warm, every, total) for t in no])
    rows = [Row("P6", f"steps/s with an async checkpoint every {every} steps / none (2 ranks)", ">= 0.99x",
                f"{r:.3f}x", r >= 0.99,
                {"checkpoint_cost_ms": [round(1000 * c) for c in costs], "step_ms": round(1000 * step_s, 1),
                 "parts_ms": _parts(ck, every, total),
                 "by_excess_step_time": f"{every * step_s / (every * step_s + max(excess, 0)):.3f}x "
                                        f"(cost {1000 * excess:.0f} ms)"})]
    rows.append(_p6_often(s.warm, often, total, ck_often, no, step_s, cfg_often))
    (saves,) = b.interleave([Arm("P6-save", "async_save", 1, {"config": b.config(1)})], trials=1,
                            params=lambda arm, i: {"saves": s.saves})
    ms = [1000 * x for x in saves[0][0]["blocking_s"]]
    steady = median(ms[1:]) if len(ms) > 1 else ms[0]
    rows.append(Row("P6", "blocking time of an async save (ResNet-18 + SGD state)" if not s.tiny
                    else f"blocking time of an async save ({s.model} + SGD state)", "<= 50 ms",
                    f"{steady:.1f} ms", steady <= 50, {"each_ms": [round(x, 1) for x in ms],
                                                       "note": "median of saves 2.. (the first allocates)"}))
    return rows


def _p6_often(warm: int, often: int, total: int, ck: list[Trial], no: list[Trial], step_s: float,
              cfg: str) -> Row:
    """A checkpoint every `often` steps, in the same run length: its cost is the mean over the
    steady-state checkpoints, those after keep_last were committed (each one's commit prunes
    the oldest, as in a long run), from the first of them to the end of the last step."""
    from ddpjob import jobfile

    keep = jobfile.from_json(cfg).checkpoint.keep_last
    saved = list(range(often, total, often))
    steady = [c for c in saved if c > keep * often] or saved  # --tiny: too few to have a steady state
    costs = [_checkpoint_cost(t, steady[0], total) / len(steady) for t in ck]
    cost_s = median(costs)
    r = often * step_s / (often * step_s + cost_s)
    # each checkpoint alone (the most over the ranks), first ones included: [trial][checkpoint]
    each = [[round(1000 * _checkpoint_cost(t, c, min(c + often, total))) for c in saved] for t in ck]
    excess = (median([_excess(t, warm, steady[0], total) for t in ck])
              - median([_excess(t, warm, steady[0], total) for t in no])) / len(steady)
    return Row("P6", f"steps/s with an async checkpoint every {often} steps / none (2 ranks)", ">= 0.99x",
               f"{r:.3f}x", r >= 0.99,
               {"checkpoint_cost_ms": [round(1000 * c) for c in costs], "step_ms": round(1000 * step_s, 1),
                "steady_checkpoints": steady, "parts_ms": _parts(ck, steady[0], total, len(steady)),
                "each_checkpoint_ms": {str(c): [e[i] for e in each] for i, c in enumerate(saved)},
                "by_excess_step_time": f"{often * step_s / (often * step_s + max(excess, 0)):.3f}x "
                                       f"(cost {1000 * excess:.0f} ms)"})


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


def _pinner(rank: int) -> Callable[[], None]:
    return lambda: harness.pin_to(rank)


class _Ranks:
    """`ddpjob run JOB.toml --run-dir D` on 2 ranks, as torchrun / the local backend start them."""

    def __init__(self, b: Bench, run_dir: Path, overrides: list[str], restart: int) -> None:
        port = harness.free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        run_dir.parent.mkdir(parents=True, exist_ok=True)
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
                    preexec_fn=_pinner(rank)))

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
            raise RuntimeError(f"ddpjob run ranks still running after {timeout} s:\n"
                               f"{self.output()}") from None

    def output(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in self.logs)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _first_step_time(run_dir: Path, restart: int, timeout: float, ranks: _Ranks,
                     step: int = 0) -> dict[str, Any]:
    """The first train record of this restart (at step `step` or later), once it is written."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        recs = [r for r in _metrics(run_dir)
                if r["kind"] == "train" and r.get("restart") == restart and r["step"] >= step]
        if recs:
            return recs[0]
        if any(p.poll() is not None for p in ranks.procs):
            break
        time.sleep(0.02)
    raise RuntimeError(f"no step {step or 'first'} of restart {restart} in {run_dir}:\n{ranks.output()}")


def p7(b: Bench) -> list[Row]:
    rows = _p7(b, compiled=False)
    if not b.sizes.tiny:  # a cold compile takes minutes: tests/unit/test_compile.py checks the path in CI
        rows += _p7(b, compiled=True)
    return rows


def _p7(b: Bench, compiled: bool) -> list[Row]:
    """Cold start vs resumed start, to the first step. With train.compile the cold start
    compiles (the run dir's cache is empty) and the resumed one loads the graphs from
    RUN_DIR/cache (ddpjob/node/compilecache.py)."""
    s = b.sizes
    stop_after = 2  # signal once this step is logged: the stop lands at a step boundary soon after
    overrides = [f"data.root={json.dumps(str(b.root))}", f"train.model={json.dumps(s.model)}",
                 "train.cifar_stem=false", f"train.batch_size={s.batch}", "train.log_every=1",
                 "train.threads=1", "train.backend=\"gloo\"", "slurm.tasks_per_node=2",
                 "slurm.gpus_per_node=0", "slurm.cpus_per_task=1", f"train.compile={str(compiled).lower()}"]
    tag = "P7c" if compiled else "P7"
    cold_s, resume_s, lost, graphs = [], [], [], []
    for i in range(min(s.slow_trials, 2) if compiled else s.slow_trials):  # a cold compile: minutes
        run_dir = b.base / "runs" / f"{tag}-{i}"
        shutil.rmtree(run_dir, ignore_errors=True)
        total = 1000  # never reached: the signal stops the first run, the second is stopped too
        ov = [*overrides, f"train.max_steps={total}"]
        cold = again = None
        try:
            cold = _Ranks(b, run_dir, ov, restart=0)
            first = _first_step_time(run_dir, 0, 600, cold)
            cold_s.append(first["time"] - cold.started)
            _first_step_time(run_dir, 0, 600, cold, step=stop_after)
            cold.signal(signal.SIGUSR2)
            codes = cold.wait(300)
            if codes != [3, 3]:
                raise RuntimeError(f"P7: the signalled ranks exited {codes}, expected 3 (requeue):\n"
                                   f"{cold.output()}")
            done = max(r["step"] for r in _metrics(run_dir) if r["kind"] == "train" and r["restart"] == 0)
            again = _Ranks(b, run_dir, ov, restart=1)
            first = _first_step_time(run_dir, 1, 600, again)
            resume_s.append(first["time"] - again.started)
            start = [e for e in _events(run_dir) if e.get("event") == "start" and e.get("restart") == 1]
            resumed = start[0].get("resumed_step") if start else None
            graphs.append([e.get("graphs") for e in _events(run_dir) if e.get("event") == "first_step"])
            # Steps lost: done before the stop but not in the checkpoint (they must be run again).
            lost.append(done - (resumed if resumed is not None else 0))
            again.signal(signal.SIGUSR2)
            again.wait(300)
        finally:
            for ranks in (cold, again):
                if ranks is not None:
                    ranks.kill()
            shutil.rmtree(run_dir, ignore_errors=True)  # two 90 MB checkpoints; the logs stay
        b.log(f"  {tag} trial {i}: cold start {cold_s[-1]:.2f} s, resumed start {resume_s[-1]:.2f} s, "
              f"stopped after step {done}, resumed from {resumed}, graphs {graphs[-1]}")
    ratios = [r / c for r, c in zip(resume_s, cold_s)]
    worst = max(lost)
    ratio = median(ratios)
    times = {"pair_ratios": [round(x, 3) for x in ratios], "cold_s": [round(x, 2) for x in cold_s],
             "resumed_s": [round(x, 2) for x in resume_s]}
    if compiled:
        return [Row("P7", "with train.compile: start to first resumed step (graphs from RUN_DIR/cache) / "
                    "cold start to first step (compiling)", "<= 1.2x", f"{ratio:.2f}x", ratio <= 1.2,
                    {**times, "graphs": graphs})]
    return [Row("P7", "steps lost after a signalled stop (USR2, 2 ranks)", "<= 1", str(worst), worst <= 1,
                {"lost": lost}),
            Row("P7", "start to first resumed step / cold start to first step", "<= 1.2x",
                f"{ratio:.2f}x", ratio <= 1.2, times)]


# ------------------------------------------------------------------------------------ P8
def p8(b: Bench) -> list[Row]:
    from bench import p8 as gpu  # one GPU, each arm its own process: see bench/p8.py

    return gpu.p8(b)


def p11(b: Bench) -> list[Row]:
    from bench import p11 as storm  # the SLURM driver: only imported when P11 is asked for

    return storm.p11(b)


def p12(b: Bench) -> list[Row]:
    from bench import p12 as killstorm  # the SLURM driver: only imported when P12 is asked for

    return killstorm.p12(b)


def p16(b: Bench) -> list[Row]:
    from bench import p16 as speed  # the speed watches, N runs of each case (minutes): on demand

    return speed.p16(b)


def p15(b: Bench) -> list[Row]:
    from bench import p15 as machinery  # the SLURM driver: only imported when P15 is asked for

    return machinery.p15(b)


def p17(b: Bench) -> list[Row]:
    from bench import p17 as integrations  # needs transformers and lightning: only imported when P17 is asked for

    return integrations.p17(b)


BENCHMARKS: dict[str, Callable[[Bench], list[Row]]] = {
    "P1": p1, "P2": p2, "P3": p3, "P4": p4, "P5": p5, "P6": p6, "P7": p7, "P8": p8, "P9": p9, "P10": p10,
    "P11": p11, "P12": p12, "P13": p13, "P14": p14, "P15": p15,
    "P16": p16, "P17": p17}
# Run only when named: P11, P12 and P15 need the SLURM test cluster and ~10-15 minutes, so neither
# the default set nor CI's `bench --tiny` (tests/unit/test_bench.py) may start them.
# P16 runs the same job N times per case (about 30 s a run on 2 busy cores).
# P17 needs the extras ddpjob[hf] and ddpjob[lightning] and ~5-10 minutes: only by name too.
ON_DEMAND = frozenset({"P11", "P12", "P15", "P16", "P17"})
# Ids that do not read the CIFAR-10-format data set (a first run would write 50,000 images).
NO_DATA = frozenset({"P8", "P11", "P12", "P15", "P16", "P17"})
