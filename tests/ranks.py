"""Start N local `ddpjob run` ranks the way torchrun does (RANK, WORLD_SIZE, MASTER_* ...).

Shared by tests/ranks/test_runner.py, test_trainer.py, test_preemption_local.py, test_equivalence.py:
real processes, one per rank, each with its own log file, on a fresh port.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import zygote
from clirun import wait_for

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
PYTHON = sys.executable
# train.stop_vote = "overlap" (the default): the vote started after the step a stop request
# lands in is read one step later, so every rank stops LAG steps after the sync vote would
LAG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "DDPJOB_",
                                "TORCHELASTIC", "GROUP_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                # the test plugins (models without BN, self-signalling models) live in tests/
                "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)])})
    env.update(extra or {})
    return env


class Ranks:
    """`world` processes running `python -m ddpjob run ARGS` with torchrun's variables."""

    def __init__(self, args: list[str], world: int, log_dir: Path, *, job_id: str | None = "test",
                 restart: int = 0, extra_env: dict[str, str] | None = None,
                 per_rank_env: dict[int, dict[str, str]] | None = None, cwd: Path | None = None) -> None:
        port = free_port()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.logs = [log_dir / f"rank-{r}.restart-{restart}.log" for r in range(world)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.started = time.monotonic()
        for rank in range(world):
            env = base_env(extra_env)
            env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)})
            if job_id is not None:  # like ddpjob's local backend
                env.update({"DDPJOB_JOB_ID": job_id, "DDPJOB_RESTART_COUNT": str(restart)})
            env.update((per_rank_env or {}).get(rank, {}))
            where = cwd or REPO
            # forked from the session's warm server where it imported what this rank would
            base = base_env()
            command = (zygote.command(["ddpjob", "run", *args], log_dir, base) if zygote.eligible(env, where, base)
                       else [PYTHON, "-m", "ddpjob", "run", *args])
            with open(self.logs[rank], "wb") as out:
                self.procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                   cwd=where))

    def signal(self, signum: int, ranks: list[int] | None = None) -> None:
        for r in ranks if ranks is not None else range(len(self.procs)):
            if self.procs[r].poll() is None:
                os.kill(self.procs[r].pid, signum)

    def wait(self, timeout: float = 120) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.dump_stacks()
            self.kill()
            raise AssertionError(f"ranks still running after {timeout} s:\n{self.output()}") from None

    def dump_stacks(self, wait_s: float = 5.0) -> None:
        """A hung rank tells where it waits: SIGABRT to each living rank and its children
        (DataLoader workers), whose faulthandler (enabled by ddpjob's hang watch, inherited
        across fork) writes every thread's stack into the rank log."""
        alive = [p.pid for p in self.procs if p.poll() is None]
        for pid in [c for pid in alive for c in _descendants(pid)] + alive:
            try:
                os.kill(pid, signal.SIGABRT)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.1)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def output(self, rank: int | None = None) -> str:
        ranks = [rank] if rank is not None else range(len(self.logs))
        return "\n".join(f"--- rank {r} ---\n" + self.logs[r].read_text(errors="replace")[-8000:]
                         for r in ranks)


def _descendants(pid: int) -> list[int]:
    """Children first-level and below, from /proc (Linux)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        kids = [int(c) for t in tasks for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
    except OSError:
        return out
    for kid in kids:
        out += [kid, *_descendants(kid)]
    return out


def run(args: list[str], world: int, log_dir: Path, timeout: float = 120, **kw: Any) -> tuple[list[int], Ranks]:
    ranks = Ranks(args, world, log_dir, **kw)
    return ranks.wait(timeout), ranks


def write_job(path: Path, **sections: dict[str, Any]) -> Path:
    """A small job file; values are written as TOML literals."""
    lines = ['name = "t"']
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def metrics(run_dir: Path, kind: str = "train") -> dict[int, dict[str, Any]]:
    """step -> last record of that kind (a re-run step overwrites the earlier one)."""
    out: dict[int, dict[str, Any]] = {}
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("kind") == kind:
                out[rec["step"]] = rec
    return out


def events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def final_state(run_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(final model state_dict, optimizer state of the newest checkpoint)."""
    model = torch.load(run_dir / "final" / "model.pt", weights_only=True)
    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    opt = torch.load(newest / "optimizer.pt", weights_only=True)
    return model, opt


def assert_bit_equal(a: Any, b: Any, where: str = "") -> None:
    """Recursive torch.equal over nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), \
            f"{where}: tensors differ (max |diff| {(a.double() - b.double()).abs().max().item():.3e})"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys differ"
        for k in a:
            assert_bit_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bit_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def signal_when_paused(ranks: Ranks, paused: int, signum: int = signal.SIGUSR2,
                       to: list[int] | None = None, timeout: float = 120) -> None:
    """Send `signum` (to the ranks `to`, default all) once rank `paused` says "paused at call"
    (trainer_plugins' DDPJOB_TEST_SIGNAL="RANK:CALL::pause"): the rank waits in that training
    step until the signal arrives, so the stop lands at that step however busy the machine is."""
    wait_for(lambda: "paused at call" in ranks.output(paused)
             or any(p.poll() is not None for p in ranks.procs), timeout, f"rank {paused} to pause")
    ranks.signal(signum, to)


def tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of one tag as TensorBoard itself reads RUN_DIR/tb (its EventAccumulator,
    which applies the purge events a resumed attempt writes)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]
