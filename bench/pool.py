"""Worker processes and the two ways suite.py runs an arm against another.

A Pool is one `python -m bench.worker` process per rank (pinned to one core each, one torch
thread, one gloo group), kept for the whole run: start-up is paid once. There are two pools
per world size, "a" and "b", so the two arms of a comparison live in different processes.

- `lockstep()`: both arms run a trial at the same time, but take turns step by step: each
  rank stops at its mark after every step (worker.Gate) until the parent lets it go, in the
  order A B B A A B ... So A's step i and B's step i run within a second of each other, under
  the same conditions on a machine whose neighbours come and go; a waiting process uses no CPU.
- `interleave()`: whole trials in turn (A, B, A, B, ...), for what cannot stop mid-way.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.harness import ROOT, Arm, Trial, free_port

GO = {"go": True}


class WorkerError(RuntimeError):
    pass


class Pool:
    def __init__(self, world: int, name: str, base: Path, timeout_s: float = 900) -> None:
        self.world, self.name, self.timeout_s = world, name, timeout_s
        self.dir = base / f"pool-{name}"
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
        self.ask({"hello": True})

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def send(self, msg: dict[str, Any]) -> None:
        line = (json.dumps(msg) + "\n").encode()
        for p in self.procs:
            assert p.stdin is not None
            try:
                p.stdin.write(line)
                p.stdin.flush()
            except OSError:
                raise self._error("a worker is gone") from None

    def receive(self, what: str) -> list[dict[str, Any]]:
        """One message from every rank, in rank order."""
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

    def ask(self, msg: dict[str, Any]) -> list[dict[str, Any]]:
        self.send(msg)
        return self.receive(str(msg.get("kind") or next(iter(msg))))

    @staticmethod
    def command(arm: Arm, params: dict[str, Any]) -> dict[str, Any]:
        return {"kind": arm.kind, "setup": arm.setup, "params": params}

    def _error(self, what: str) -> WorkerError:
        self.kill()
        tail = "\n".join(f"--- {p.name} ---\n" + p.read_text(errors="replace")[-3000:] for p in self.logs)
        return WorkerError(f"bench workers {self.name}: {what}\n{tail}")

    def reset(self) -> None:
        """Drop the built arms (data sets, batches, models): the next benchmark starts clean."""
        if self.alive():
            self.ask({"reset": True})

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
        self._pools: dict[str, Pool] = {}

    def get(self, world: int, slot: str) -> Pool:
        name = f"{world}{slot}"
        pool = self._pools.get(name)
        if pool is None or not pool.alive():
            pool = self._pools[name] = Pool(world, name, self.base)
        return pool

    def reset(self) -> None:
        for pool in self._pools.values():
            pool.reset()

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


def _run_dir(base: Path, arm: Arm, i: int) -> Path:
    path = base / "runs" / f"{arm.name}-{i}"
    shutil.rmtree(path, ignore_errors=True)
    return path


def lockstep(pools: Pools, a: Arm, b: Arm, trials: int, steps: int, base: Path,
             params: Callable[[Arm, int], dict[str, Any]] = lambda arm, i: {},
             log: Callable[[str], None] = print) -> tuple[list[Trial], list[Trial]]:
    """`trials` trials of A and B side by side, `steps` marks each, taking turns at every mark."""
    pa, pb = pools.get(a.world, "a"), pools.get(b.world, "b")
    out: tuple[list[Trial], list[Trial]] = ([], [])
    for i in range(trials):
        t0 = time.monotonic()
        dirs = [_run_dir(base, arm, i) for arm in (a, b)]
        for pool, arm, run_dir in ((pa, a, dirs[0]), (pb, b, dirs[1])):
            # set-up and the first step of each alone; then strict turns
            cmd = {"trial": i, "run_dir": str(run_dir), "gate": True, **params(arm, i)}
            pool.send(Pool.command(arm, cmd))
            _expect_gate(pool.receive(f"{arm.name} step 1"), 1, arm)
        for step in range(2, steps + 1):
            order = ((pa, a), (pb, b)) if step % 2 == 0 else ((pb, b), (pa, a))
            for pool, arm in order:
                pool.send(GO)
                _expect_gate(pool.receive(f"{arm.name} step {step}"), step, arm)
        for pool, arm, results in ((pa, a, out[0]), (pb, b, out[1])):
            pool.send(GO)  # past the last mark: the trial ends (the trainer evaluates and saves)
            results.append(pool.receive(f"{arm.name} trial end"))
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
        log(f"  {a.name} | {b.name} trial {i + 1}/{trials}: {time.monotonic() - t0:.1f} s")
    return out


def _expect_gate(replies: list[dict[str, Any]], step: int, arm: Arm) -> None:
    got = {r.get("gate") for r in replies}
    if got != {step}:
        raise WorkerError(f"arm {arm.name}: expected every rank at mark {step}, got {replies}")


def interleave(pools: Pools, arms: Sequence[Arm], trials: int, base: Path,
               params: Callable[[Arm, int], dict[str, Any]] = lambda arm, i: {},
               log: Callable[[str], None] = print) -> dict[str, list[Trial]]:
    """Whole trials in the order A, B, A, B, ... (arm k runs in pool slot "a" or "b")."""
    results: dict[str, list[Trial]] = {a.name: [] for a in arms}
    for i in range(trials):
        for k, arm in enumerate(arms):
            run_dir = _run_dir(base, arm, i)
            t0 = time.monotonic()
            pool = pools.get(arm.world, "ab"[k % 2])
            results[arm.name].append(pool.ask(Pool.command(arm, {"trial": i, "run_dir": str(run_dir),
                                                                 **params(arm, i)})))
            shutil.rmtree(run_dir, ignore_errors=True)
            log(f"  {arm.name} trial {i + 1}/{trials}: {time.monotonic() - t0:.1f} s")
    return results
