"""P11, a preemption storm: a real `ddpjob sbatch` + `sbatch` job on the SLURM test cluster
(partition `low`, 2 nodes x 1 task) is preempted `preemptions` times, about `every_s` apart, by
`sbatch --partition=high --nodes=2 --exclusive` jobs, each time released as soon as SLURM has
requeued it, and then trains to the end. Compared with an uninterrupted run of the same job (2
local ranks, the same config.json): final model and optimizer tensors (torch.equal) and every
per-step loss. Figures from the run's own ledger: bench/storm_ledger.py.

Not in the default `python -m bench` set (it needs the cluster and ~15 minutes): run it by name,
`python -m bench P11` (`--tiny`: 2 preemptions of a short job, for the cluster test). The
uninterrupted reference depends only on the job config and ddpjob's code, so it is kept in the
work dir and reused (`python -m bench.storm --reference-only` makes it alone).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import slurmctl
from bench.storm_ledger import train_records
from ddpjob.fileio import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "jobs" / "smoke.toml"


@dataclass(frozen=True)
class StormSize:
    preemptions: int
    every_s: float  # from one preemption's submission to the next
    min_run_s: float  # ... but no sooner than this after the attempt's first step
    model: str
    steps: int
    batch: int  # per rank
    # > 0: paced by steps, not the clock: preemption k is submitted once attempt k-1 has trained
    # this many steps past its first (the --tiny run in CI, where a busy machine trains slower)
    every_steps: int = 0


# ~6 minutes of training on the 2-core test machine (resnet8, ~55 ms a step), five preemptions
FULL = StormSize(preemptions=5, every_s=60.0, min_run_s=20.0, model="resnet8", steps=6000, batch=32)
# ~25 steps a second on the idle 2-core test machine: each attempt trains its 60 steps and the
# ~1-3 s SLURM takes to preempt it, and the last one the rest (about 400 steps)
TINY = StormSize(preemptions=2, every_s=0.0, min_run_s=0.0, model="cnn_tiny", steps=700, batch=32,
                 every_steps=60)


def overrides(size: StormSize) -> list[str]:
    """jobs/smoke.toml (synthetic data, no download) as the storm's job: one loss line per step
    (every loss is compared), a periodic checkpoint as a real job keeps, evaluation only at the
    end (inside the loop it would count as training time), room for the requeues."""
    return [f"train.model={json.dumps(size.model)}", f"train.max_steps={size.steps}",
            f"train.batch_size={size.batch}", "train.log_every=1", f"train.eval_every={size.steps}",
            "train.threads=1", "checkpoint.every_steps=500", "slurm.tasks_per_node=1",
            'slurm.partition="low"', f"slurm.max_requeues={size.preemptions + 5}", 'slurm.time="00:30:00"']


def _ddpjob(*argv: str, cwd: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "ddpjob", *argv], capture_output=True, text=True,
                         cwd=cwd, env=slurmctl.clean_env(OMP_NUM_THREADS="1"), timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"ddpjob {argv[0]} failed ({out.returncode}): {(out.stdout + out.stderr)[-2000:]}")
    return out.stdout


def sets(size: StormSize) -> list[str]:
    return [a for o in overrides(size) for a in ("--set", o)]


def prepare(work: Path, sets: list[str]) -> tuple[Path, Path, str]:
    """A fresh run dir + batch script from `ddpjob sbatch` (jobs/smoke.toml, 2 nodes, `sets`:
    --set arguments); the reference key is the hash of its config.json and frozen code (what
    decides every bit of the training). P12 (bench/killstorm.py) prepares its job here too."""
    run, script = work / "storm-run", work / "storm.sbatch"
    shutil.rmtree(run, ignore_errors=True)
    _ddpjob("sbatch", str(JOB), "--nodes", "2", *sets, "-o", str(script), "--run-dir", str(run), cwd=work)
    code = json.loads((run / "code.json").read_text())["hash"]
    key = hashlib.sha256((run / "config.json").read_bytes() + code.encode()).hexdigest()[:16]
    return run, script, key


def reference(work: Path, sets: list[str], key: str, log: Callable[[str], None]) -> tuple[Path, bool]:
    """The same job, never interrupted: 2 local ranks (`ddpjob submit --backend local`; gloo on
    2 ranks gives the same bits under srun and locally, test_runner.py). Reused when done."""
    ref = work / f"reference-{key}"
    if (ref / "COMPLETED").is_file() and (ref / "final" / "model.pt").is_file():
        return ref, True
    shutil.rmtree(ref, ignore_errors=True)
    log(f"  uninterrupted reference run (2 local ranks) in {ref}")
    _ddpjob("submit", str(JOB), "--backend", "local", "--nodes", "2", *sets, "--wait",
            "--run-dir", str(ref), cwd=work)
    if not (ref / "COMPLETED").is_file():
        raise RuntimeError(f"the reference run {ref} did not complete")
    return ref, False


def events(run: Path, kind: str, **match: Any) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(run / "events.jsonl") if e.get("event") == kind and "rank" not in e
            and all(e.get(k) == v for k, v in match.items())]


def wait_for(what: str, check: Callable[[], Any], job: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} after {timeout:.0f} s (job {job}: {slurmctl.state(job)})")
        if not slurmctl.active(job) and not (value := check()):
            raise RuntimeError(f"job {job} ended ({slurmctl.state(job)}) before {what}")
        time.sleep(0.2)
    return value


def storm(work: Path, run: Path, script: Path, size: StormSize,
          log: Callable[[str], None]) -> tuple[str, list[str], float]:
    """Submit, preempt `size.preemptions` times, release each requeue at once, wait for the
    end. Returns (job id, the high jobs' ids, seconds the release waited in all)."""
    env = slurmctl.clean_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    slurmctl.wait_free(timeout=600)
    job = slurmctl.sbatch(script, cwd=work, env=env)
    high = work / "high.sh"  # the preempting job: both nodes, exclusive, one second
    high.write_text("#!/bin/bash\nsleep 1\n")
    highs: list[str] = []
    held = 0.0
    try:
        log(f"  P11: storm job {job} submitted ({size.steps} steps)")
        last: float | None = None  # when the previous high job was submitted
        for k in range(1, size.preemptions + 1):
            started = wait_for(f"first step of attempt {k - 1}",
                               lambda: events(run, "first_step", restart=k - 1), job, 600)[0]
            if size.every_steps:  # the loss lines (log_every = 1) say how far it has trained
                target = int(started["step"]) + size.every_steps
                wait_for(f"step {target}", lambda: any(r["step"] >= target for r in train_records(run)), job, 600)
            else:  # the first one half a period in: the job must still be training after the last
                first = time.monotonic()
                due = first + size.every_s / 2 if last is None else max(last + size.every_s, first + size.min_run_s)
                time.sleep(max(0.0, due - time.monotonic()))
            if events(run, "stop", reason="finished"):
                raise RuntimeError(f"P11: the job finished before preemption {k}: give it more steps")
            highs.append(slurmctl.sbatch(high, "--partition=high", "--nodes=2",
                                         "--exclusive", "--time=2", "--job-name=p11-high",
                                         f"--output={work / 'high-%j.out'}", cwd=work, env=env))
            last = time.monotonic()
            stop = wait_for(f"stop {k}", lambda: events(run, "stop", restart=k - 1), job, 300)[0]
            if stop.get("reason") != "preemption" or stop.get("requeued") is not True:
                raise RuntimeError(f"P11: stop {k} was not a requeued preemption: {stop}")
            slurmctl.wait_state(job, {"PENDING"}, timeout=120)
            pending = time.monotonic()
            slurmctl.wait_done(highs[-1], timeout=300)
            # slurmd refuses a credential made in the second the last incarnation ended ("Job
            # credential revoked": the job would end FAILED), so never release sooner than 2 s
            wait = max(0.0, pending + 2.0 - time.monotonic())
            time.sleep(wait)
            held += wait
            slurmctl.release(job)
            log(f"  P11: preemption {k} (high job {highs[-1]}): stopped at step {stop['step']}, "
                f"released {time.monotonic() - last:.1f} s after the high job was submitted")
        end = slurmctl.wait_done(job, timeout=3600)
        if end != "COMPLETED":
            raise RuntimeError(f"P11: storm job {job} ended {end}; see {run / 'logs'}")
    finally:
        for j in [job, *highs]:
            if slurmctl.active(j):
                slurmctl.cancel(j)
    return job, highs, held


def _differences(a: Any, b: Any, where: str, out: list[str]) -> None:
    """torch.equal over nested dicts/lists of tensors (dtype included) and plain values."""
    import torch

    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)):
            out.append(where)
    elif isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            out.append(f"{where} (keys)")
        else:
            for k in a:
                _differences(a[k], b[k], f"{where}.{k}", out)
    elif isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            out.append(f"{where} (length)")
        else:
            for i, (x, y) in enumerate(zip(a, b)):
                _differences(x, y, f"{where}[{i}]", out)
    elif a != b:
        out.append(where)


def compare_state(run: Path, ref: Path) -> tuple[list[str], int]:
    """The final model (final/model.pt) and the optimizer of the newest (final) checkpoint;
    returns (what differs, tensors compared)."""
    import torch

    def load(d: Path) -> dict[str, Any]:
        newest = max((d / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        return {"model": torch.load(d / "final" / "model.pt", weights_only=True),
                "optimizer": torch.load(newest / "optimizer.pt", weights_only=True)}

    a, b = load(run), load(ref)
    diff: list[str] = []
    _differences(a, b, "", diff)
    count = 0
    stack: list[Any] = [a]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            count += 1
        elif isinstance(x, dict):
            stack += list(x.values())
        elif isinstance(x, (list, tuple)):
            stack += list(x)
    return diff, count


def evals(run: Path) -> dict[int, Any]:
    return {r["step"]: r.get("eval_acc") for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "eval"}


def _main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.storm", description="P11's reference run alone")
    ap.add_argument("--reference-only", action="store_true", required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--work", help="the bench work folder (default: as python -m bench)")
    args = ap.parse_args(argv)
    from bench import harness

    work = harness.work_dir(args.work) / "P11"
    work.mkdir(parents=True, exist_ok=True)
    size = TINY if args.tiny else FULL
    _, _, key = prepare(work, sets(size))
    ref, reused = reference(work, sets(size), key, print)
    print(f"reference {'reused' if reused else 'made'}: {ref}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
