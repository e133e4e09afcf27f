"""Side-by-side measurement machinery: pinned worker pools driven trial by trial.

suite.py describes each benchmark as two arms (A = ddpjob, B = the reference) and asks
`interleave()` for trials in the order A, B, A, B, ...; every figure is a median of per-pair
ratios. The trials run in long-lived `python -m bench.worker` processes (one per rank, each
pinned to one core, one torch thread), one pool per world size: start-up is paid once, and
while one pool runs a trial the other waits on a pipe, using no CPU.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
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
    log_every: int  # the trainer's log interval = the timestamps the window is read from
    trials: int  # per arm
    ckpt_every: int  # P6: checkpoint interval in steps
    loader_batches: int  # P3: batches per loader trial (ddpjob's loader)
    pil_batches: int  # P3: batches per PIL trial
    saves: int  # P6: async saves timed


FULL = Sizes(tiny=False, model="resnet18", n_train=50_000, n_test=512, batch=128, warm=5, steps=20,
             log_every=5, trials=3, ckpt_every=50, loader_batches=100, pil_batches=8, saves=6)
TINY = Sizes(tiny=True, model="cnn_tiny", n_train=1024, n_test=64, batch=32, warm=2, steps=4,
             log_every=2, trials=1, ckpt_every=4, loader_batches=4, pil_batches=2, saves=2)


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
    """A CIFAR-10-format folder written by ddpjob.fixtures (cached: writing 50k images takes a
    while); returns the data root to put in `data.root`."""
    from ddpjob import fixtures

    root = base / f"cifar-{sizes.n_train}-{sizes.n_test}"
    done = root / "COMPLETE"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        fixtures.write_cifar10_folder(root, n_train=sizes.n_train, n_test=sizes.n_test, seed=0)
        done.write_text("ok\n")
    return root


def job_config(root: Path, sizes: Sizes, world: int, *overrides: str) -> str:
    """jobs/cifar10_resnet18.toml, as users submit it, with the benchmark's overrides; JSON."""
    from ddpjob import config

    base = [f"data.root={json.dumps(str(root))}", f"train.model={json.dumps(sizes.model)}",
            # the seeds' network (torchvision's stem); see the README's Performance section
            "train.cifar_stem=false",
            f"train.batch_size={sizes.batch}", f"train.max_steps={sizes.warm + sizes.steps}",
            f"train.log_every={sizes.log_every}", "train.threads=1", "train.backend=\"gloo\"",
            f"slurm.tasks_per_node={world}", "slurm.gpus_per_node=0", "slurm.cpus_per_task=1"]
    return config.resolve(JOB, [*base, *overrides]).to_json()


class WorkerError(RuntimeError):
    pass


@dataclass(frozen=True)
class Arm:
    """One side of a comparison: which code (`kind`, see worker.KINDS), on how many ranks,
    built from `setup` (a job config and a few options)."""

    name: str
    kind: str
    world: int
    setup: dict[str, Any]


class Pool:
    """`world` worker processes, one per rank, pinned to one core each, kept for the whole run.
    Every arm with this world size runs its trials here (each worker caches one built arm per
    (kind, setup)), so A and B of a comparison run in the very same processes, and the
    interpreter/torch start-up is paid once per pool, not once per arm."""

    def __init__(self, world: int, base: Path, timeout_s: float = 900) -> None:
        self.world, self.timeout_s = world, timeout_s
        self.dir = base / f"pool-{world}"
        self.dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.replies: list[Any] = []
        self.logs = [self.dir / f"rank-{r}.log" for r in range(world)]
        for rank in range(world):
            read_fd, write_fd = os.pipe()
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
            env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                        "BENCH_REPLY_FD": str(write_fd),
                        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))})
            with open(self.logs[rank], "wb") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "bench.worker"], cwd=ROOT, env=env,
                    stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, pass_fds=(write_fd,)))
            os.close(write_fd)
            self.replies.append(os.fdopen(read_fd, "r"))
        self._send({"hello": True})

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def _send(self, msg: dict[str, Any]) -> list[dict[str, Any]]:
        line = (json.dumps(msg) + "\n").encode()
        for p in self.procs:
            assert p.stdin is not None
            try:
                p.stdin.write(line)
                p.stdin.flush()
            except OSError:
                raise self._error("a worker is gone") from None
        return self._read_all(msg.get("kind") or next(iter(msg)))

    def _read_all(self, what: str) -> list[dict[str, Any]]:
        out = []
        deadline = time.monotonic() + self.timeout_s
        for rank, reply in enumerate(self.replies):
            while True:
                ready, _, _ = select.select([reply], [], [], 1.0)
                if ready:
                    line = reply.readline()
                    if not line:
                        raise self._error(f"rank {rank} exited during {what}")
                    msg = json.loads(line)
                    if "error" in msg:
                        raise self._error(f"rank {rank} failed during {what}: {msg['error']}")
                    out.append(msg)
                    break
                if time.monotonic() > deadline:
                    raise self._error(f"rank {rank} gave no answer to {what} within {self.timeout_s:g} s")
        return out

    def _error(self, what: str) -> WorkerError:
        self.kill()
        tail = "\n".join(f"--- {p.name} ---\n" + p.read_text(errors="replace")[-3000:] for p in self.logs)
        return WorkerError(f"bench workers ({self.world} rank(s)): {what}\n{tail}")

    def trial(self, arm: Arm, params: dict[str, Any]) -> dict[str, Any]:
        assert arm.world == self.world, (arm, self.world)
        return self._send({"kind": arm.kind, "setup": arm.setup, "params": params})[0]

    def reset(self) -> None:
        """Drop the built arms (their data sets, batches, models): the next benchmark starts clean."""
        if self.alive():
            self._send({"reset": True})

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None and p.stdin is not None:
                try:
                    p.stdin.close()  # EOF: the worker leaves its loop and tears down
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for r in self.replies:
            r.close()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


class Pools:
    """Started on first use, restarted if a benchmark killed them."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self._pools: dict[int, Pool] = {}

    def get(self, world: int) -> Pool:
        pool = self._pools.get(world)
        if pool is None or not pool.alive():
            pool = self._pools[world] = Pool(world, self.base)
        return pool

    def reset(self) -> None:
        for pool in self._pools.values():
            pool.reset()

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


def interleave(pools: Pools, arms: Sequence[Arm], trials: int, base: Path,
               params: Callable[[Arm, int], dict[str, Any]] = lambda arm, i: {},
               log: Callable[[str], None] = print) -> dict[str, list[dict[str, Any]]]:
    """Trials in the order A, B, A, B, ...: slow drifts of a shared machine hit both arms alike.
    Each trial gets a fresh run dir (removed afterwards: every trainer run writes checkpoints)."""
    results: dict[str, list[dict[str, Any]]] = {a.name: [] for a in arms}
    for i in range(trials):
        for arm in arms:
            run_dir = base / "runs" / f"{arm.name}-{i}"
            shutil.rmtree(run_dir, ignore_errors=True)
            t0 = time.monotonic()
            results[arm.name].append(pools.get(arm.world).trial(
                arm, {"trial": i, "run_dir": str(run_dir), **params(arm, i)}))
            shutil.rmtree(run_dir, ignore_errors=True)
            log(f"  {arm.name} trial {i + 1}/{trials}: {time.monotonic() - t0:.1f} s")
    return results


def window_rate(times: dict[str, float], start: int, end: int) -> float:
    """Optimizer steps per second between the records at steps `start` and `end`."""
    return (end - start) / (times[str(end)] - times[str(start)])


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
