"""What the benchmarks share: sizes (full and --tiny), the data set, the job config, arms,
pinning, and the arithmetic that turns marks into step times.

suite.py builds arms from these and runs them through pool.py; worker.py marks every step.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "jobs" / "cifar10_resnet18.toml"


@dataclass(frozen=True)
class Sizes:
    """How much work one run does: the real figures, or --tiny for CI."""

    tiny: bool
    model: str  # torchvision resnet18 for the figures (see README: why without the CIFAR stem)
    n_train: int
    n_test: int
    batch: int  # per rank
    warm: int  # optimizer steps before the timed window (first-iteration costs, DDP rebuild)
    steps: int  # optimizer steps in the timed window
    trials: int  # per arm (P1-P4)
    slow_trials: int  # per arm where a trial takes long (P5, P6, P7)
    stem_warm: int  # P5 on the CIFAR-stem network (~2 s per step per core): fewer steps
    stem_steps: int
    ckpt_every: int  # P6: checkpoint interval in steps
    ckpt_tail: int  # P6: steps run after the checkpoint (its background write lands there)
    ckpt_often: int  # P6's second interval (same run length): steady-state checkpoints are timed
    loader_batches: int  # P3: batches per loader trial (ddpjob's loader)
    pil_batches: int  # P3: batches per PIL trial
    saves: int  # P6: async saves timed


FULL = Sizes(tiny=False, model="resnet18", n_train=50_000, n_test=512, batch=128, warm=3,
             steps=12, trials=5, slow_trials=3, stem_warm=2, stem_steps=4, ckpt_every=50, ckpt_tail=15,
             ckpt_often=10,
             loader_batches=100, pil_batches=10, saves=6)
TINY = Sizes(tiny=True, model="cnn_tiny", n_train=1024, n_test=64, batch=32, warm=2, steps=4,
             trials=1, slow_trials=1, stem_warm=1, stem_steps=2, ckpt_every=4, ckpt_tail=2, ckpt_often=2, loader_batches=4,
             pil_batches=2, saves=2)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def cores() -> list[int]:
    """The cores this process may run on (ranks are pinned to one each, round robin)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def pin_to(core_index: int) -> None:
    """Pin the calling process to its share of the cores: one core per rank."""
    if hasattr(os, "sched_setaffinity"):
        all_cores = cores()
        os.sched_setaffinity(0, {all_cores[core_index % len(all_cores)]})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def work_dir(path: str | None) -> Path:
    base = Path(path) if path else Path(tempfile.gettempdir()) / f"ddpjob-bench-{os.getuid()}"
    base.mkdir(parents=True, exist_ok=True)
    return base


def dataset(base: Path, sizes: Sizes) -> Path:
    """A CIFAR-10-format folder written by ddpjob.train.fixtures (cached: writing 50k images takes a
    while); returns the data root to put in `data.root`."""
    from ddpjob.train import fixtures

    root = base / f"cifar-{sizes.n_train}-{sizes.n_test}"
    done = root / "COMPLETE"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        fixtures.write_cifar10_folder(root, n_train=sizes.n_train, n_test=sizes.n_test, seed=0)
        done.write_text("ok\n")
    return root


def job_config(root: Path, sizes: Sizes, world: int, *overrides: str) -> str:
    """jobs/cifar10_resnet18.toml, as users submit it, with the benchmark's overrides; JSON."""
    from ddpjob import jobfile

    base = [f"data.root={json.dumps(str(root))}", f"train.model={json.dumps(sizes.model)}",
            # the seeds' network (torchvision's stem); see the README's Performance section
            "train.cifar_stem=false",
            f"train.batch_size={sizes.batch}", f"train.max_steps={sizes.warm + sizes.steps}",
            # a timestamp (and the mean loss over ranks) every step: the figures are medians
            # of step times, which shrug off the other processes of a shared machine
            "train.log_every=1", "train.threads=1", "train.backend=\"gloo\"",
            # the job file compiles (a GPU's win, bench P8); on these CPUs compiling gains nothing
            # (P2's compiled row says so) and takes minutes: the rows that want it say so
            "train.compile=false",
            f"slurm.tasks_per_node={world}", "slurm.gpus_per_node=0", "slurm.cpus_per_task=1"]
    return jobfile.resolve(JOB, [*base, *overrides]).to_json()


CHARLM = Path(__file__).resolve().parents[1] / "examples" / "charlm" / "job.toml"


def charlm_config(steps: int, stop_vote: str = "overlap") -> str:
    """examples/charlm/job.toml for P9/P10: `steps` steps, no DataLoader workers (the pool pins
    a rank to one core), no periodic checkpoints (both arms would pay them alike), JSON."""
    from ddpjob import jobfile

    return jobfile.resolve(CHARLM, [f"user.max_steps={steps}", "user.num_workers=0",
                                   "user.print_every=1000000", "user.sample_chars=1",
                                   "checkpoint.every_steps=0", "train.threads=1",
                                   f"train.stop_vote=\"{stop_vote}\"",
                                   "train.backend=\"gloo\"", "slurm.tasks_per_node=2"]).to_json()


@dataclass(frozen=True)
class Arm:
    """One side of a comparison: which code (`kind`, see worker.KINDS), on how many ranks,
    built from `setup` (a job config and a few options)."""

    name: str
    kind: str
    world: int
    setup: dict[str, Any]


Trial = list[dict[str, Any]]  # one trial: every rank's answer, each with "marks"


def step_costs(trial: Trial, start: int, end: int, clock: str = "wall") -> list[float]:
    """Seconds per step for steps start+1 .. end: the largest over the ranks (they wait for
    each other at every all-reduce). Each rank marks [wall, CPU time of its process] at the
    end of every step and again when it goes on (worker.Gate; the same when not gated), so a
    step is (end of this one) - (go-on of the previous one): waiting at a gate never counts."""
    k = {"wall": 0, "cpu": 1}[clock]
    return [max(r["marks"][str(i)][k] - r["marks"][str(i - 1)][2 + k] for r in trial)
            for i in range(start + 1, end + 1)]


def rate(trial: Trial, start: int, end: int, clock: str = "wall") -> float:
    """Steps per second of the median step: robust to the odd slow step a neighbour causes."""
    return 1.0 / median(step_costs(trial, start, end, clock))


def window_rate(trial: Trial, start: int, end: int, clock: str = "wall") -> float:
    """Mean steps per second over steps start+1 .. end (every slow step counts)."""
    return (end - start) / sum(step_costs(trial, start, end, clock))


def machine() -> dict[str, str]:
    """What the figures came from: CPU model, cores, torch version, load."""
    import platform

    import torch

    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return {"cpu": model, "cores": str(len(cores())), "torch": torch.__version__,
            "python": platform.python_version(), "load": load}
