"""P16: the speed watches (ddpjob/rank/straggler.py, slowdown.py) on the same small job run N
times, each case caused at a step by tests/trainer_plugins.py's hooks (DDPJOB_TEST_STRAGGLE),
never by a timer:

  clean    no rank slowed, on a host at twice its cores (one CPU hog per core beside the 2
           ranks): the ranks named a straggler per run (false flags; a host line is no flag)
  30%      rank 1's compute slowed by 30% of its own from step 31 ("share": 30% more CPU work
           in its backward pass): named? steps to it
  100%     the same at 100%
  1.5x     every rank's data loading made to wait half the median wall-clock step before, per
           batch, from step 61 ("datawait": the job at 1.5x its own step time, whatever the
           host's load, as a slow filesystem would): the slowdown line? steps to it, and its
           cause (data)

The job: jobs/smoke.toml's network as trainer_plugins' straggling_cnn, 2 ranks x 1 thread, 64
samples a rank a step (a step of ~40 ms here: a window then spans most of a second, not a
quarter, and the host's moments of noise do not fill one) on the local backend, straggler_window
= slowdown_window = 20 (a window is 20 steps). Each figure is a count over the runs of one
invocation. Needs tests/ on the path (the plugins).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.core import Bench, Row
from bench.harness import ROOT
from ddpjob.ledger import events

WINDOW = 20
CASES = {  # name: (slow rank, from step, how, amount, steps)
    "clean": (None, 0, "", 0.0, 120),
    "30%": ("1", 31, "share", 0.3, 120),
    "100%": ("1", 31, "share", 1.0, 120),
    "1.5x": ("*", 61, "datawait", 0.5, 150),
}
BATCH = 64  # per rank: steps of ~40 ms here, so a window (20 steps) spans most of a second


def one(work: Path, name: str, i: int) -> list[dict[str, Any]]:
    """One run of case `name`; its straggler and slowdown events."""
    rank, at, how, amount, steps = CASES[name]
    run = work / f"{name.rstrip('%').replace('.', '_')}-{i}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDPJOB_"))}
    env.update({"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]), "OMP_NUM_THREADS": "1"})
    if rank is not None:
        env["DDPJOB_TEST_STRAGGLE"] = f"{rank}:{at}:{how}:{amount}"
    env["DDPJOB_TEST_BATCH"] = str(BATCH)  # where slow_synthetic's batches begin
    keys = {"slurm.tasks_per_node": 2, "train.max_steps": steps, "train.eval_every": 0, "train.batch_size": BATCH,
            "train.log_every": 20, "train.model": '"trainer_plugins:straggling_cnn"', "checkpoint.every_steps": 0,
            "train.straggler_window": WINDOW, "train.slowdown_window": WINDOW}
    if how.startswith("data"):
        keys["data.dataset"] = '"trainer_plugins:slow_synthetic"'
    args = [x for k, v in keys.items() for x in ("--set", f"{k}={v}")]
    out = subprocess.run([sys.executable, "-m", "ddpjob", "submit", str(ROOT / "jobs" / "smoke.toml"),
                          "--backend", "local", "--run-dir", str(run), "--wait", *args],
                         cwd=work, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"P16 {name} run {i} failed: {out.stderr[-500:]}")
    return [e for e in events.read(run) if e.get("event") in ("straggler", "slowdown")]


def hogs() -> list[subprocess.Popen[bytes]]:
    """One spinning process per core: with the 2 ranks, twice as many runnable as cores."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]


def settle(limit_s: float = 180.0) -> None:
    """Wait (at most `limit_s`) until the 1-minute load average is back within the cores: the
    clean case's hogs leave it high for a minute after they end, and a host that looks over its
    cores asks a rank for a 50% excess (rank/straggler.py's OVERSUBSCRIBED_SHARE)."""
    end = time.monotonic() + limit_s
    while os.getloadavg()[0] > 0.75 * (os.cpu_count() or 1) and time.monotonic() < end:
        time.sleep(5)


def rows(found: dict[str, list[list[dict[str, Any]]]]) -> list[Row]:
    n = {k: len(v) for k, v in found.items()}
    out = []
    clean = found.get("clean", [])
    if clean:
        false = [sum(1 for e in evs if e["event"] == "straggler" and e.get("cause") != "host") for evs in clean]
        hosts = sum(1 for evs in clean if any(e.get("cause") == "host" for e in evs))
        slow = sum(1 for evs in clean if any(e["event"] == "slowdown" for e in evs))
        out.append(Row("P16", f"no rank slowed, host at twice its cores (2 ranks + {os.cpu_count()} hogs), "
                       f"{n['clean']} runs: ranks named a straggler", "0 in 30 runs",
                       f"{sum(false)} in {n['clean']} runs (host line in {hosts}, slowdown line in {slow})",
                       sum(false) == 0, {"false_flags": false}))
    for name in ("30%", "100%"):
        if name not in found:
            continue
        steps, wrong = [], 0
        for evs in found[name]:
            named = [e for e in evs if e["event"] == "straggler" and e.get("cause") != "host"]
            hit = next((e for e in named if e["rank"] == 1 and e["cause"] == "compute"), None)
            wrong += sum(1 for e in named if e is not hit)
            if hit is not None:
                steps.append(int(hit["step"]) - CASES[name][1] + 1)
        med = statistics.median(steps) if steps else 0.0
        ok = len(steps) == n[name] and wrong == 0 and all(s <= 3 * WINDOW for s in steps)
        out.append(Row("P16", f"rank 1's compute {name} slower from step 31, {n[name]} runs: named (compute), "
                       "steps to it", "every run, within 3 windows (60 steps)",
                       f"{len(steps)}/{n[name]}" + (f", median {med:.0f} steps ({med / WINDOW:.1f} windows), most "
                                                    f"{max(steps)}" if steps else "") + f"; other names {wrong}",
                       ok, {"steps": steps}))
    if "1.5x" in found:
        steps, causes = [], []
        for evs in found["1.5x"]:
            said = next((e for e in evs if e["event"] == "slowdown" and e.get("state") == "began"
                         and e["step"] >= CASES["1.5x"][1]), None)
            if said is not None:
                steps.append(int(said["step"]) - CASES["1.5x"][1] + 1)
                causes.append(f"{said['cause']} {said['ratio']:.2f}x")
        right = sum(1 for c in causes if c.startswith("data"))
        med = statistics.median(steps) if steps else 0.0
        ok = len(steps) == n["1.5x"] and right == len(steps) and all(s <= 3 * WINDOW for s in steps)
        out.append(Row("P16", f"every rank's data wait +50% of a step from step 61, {n['1.5x']} runs: slowdown "
                       "line, steps to it, cause", "every run, within 3 windows, cause data",
                       f"{len(steps)}/{n['1.5x']}" + (f", median {med:.0f} steps ({med / WINDOW:.1f} windows), "
                                                      f"most {max(steps)}; cause data in {right}" if steps else ""),
                       ok, {"steps": steps, "said": causes}))
    return out


def p16(b: Bench) -> list[Row]:
    runs = 1 if b.sizes.tiny else b.sizes.trials
    work = b.base / "P16"
    work.mkdir(parents=True, exist_ok=True)
    found: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in CASES}
    for name in CASES:
        if name != "clean":
            settle()
        spinners = hogs() if name == "clean" else []
        try:
            for i in range(runs):
                found[name].append(one(work, name, i))
                b.log(f"  P16 {name} run {i}: " + "; ".join(
                    f"{e['event']} {e.get('cause')} step {e.get('step')}" for e in found[name][-1]))
        finally:
            for s in spinners:
                s.kill()
                s.wait()
    return rows(found)
