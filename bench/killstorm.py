"""P12, a hard-kill storm: a real `ddpjob sbatch` + `sbatch` job on the SLURM test cluster
(partition `wide`, 2 nodes x 1 task and 1 spare node, `on_node_loss = "continue"`, in-memory
snapshots every few steps) loses a rank to `kill -9` `kills` times, each at a step drawn from a
seeded generator, and then one node (set DOWN, its processes killed, its /dev/shm snapshots
removed: the test nodes share one machine's memory). Nothing announces these failures: srun ends
the other ranks, the batch script's one decision restarts them inside the allocation, and they
resume from the newest snapshot (the spare, which holds none, gets the replica and its rank's RNG
file from the survivor's snapshot: store/peers.py). Compared with the same job uninterrupted (2
local ranks, bench/storm.py).

A failure is caused at its step, not by a timer: the driver reads rank 0's per-step metrics line
and kills the chosen rank once the step is reached; the figures are read afterwards from what the
run recorded (the step each attempt last logged, where the next one resumed), so a kill that
lands a step late changes nothing measured. Per failure: steps lost, and recovery by phase:
  detect and tear down   the kill -> the decision's crash record (srun saw the task die, ended
                         the others, the decision wrote its record)
  restart                the record -> the new ranks' processes started (srun again)
  start-up               process start -> the loop, less the load (imports, process group, model)
  load                   the snapshot or checkpoint load
  first step             the loop's start -> the first step done

Not in the default `python -m bench` set: run it by name, `python -m bench P12` (~10 minutes;
`--tiny`: 2 kills, no node loss). The cluster grows to 3 nodes for it and is given back after.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import slurmctl, storm
from ddpjob.store import memsnap

PHASES = ("detect and tear down", "restart", "start-up", "load", "first step")


@dataclass(frozen=True)
class KillSize:
    kills: int
    node_down: bool
    steps: int
    gap: tuple[int, int]  # steps trained after a resume before the next failure (drawn, inclusive)
    every_steps: int  # the durable checkpoint's interval
    seed: int = 12


# cnn_tiny (jobs/smoke.toml's network), ~60-130 ms a step on the 2-core test machine
FULL = KillSize(kills=10, node_down=True, steps=1000, gap=(40, 70), every_steps=100)
TINY = KillSize(kills=2, node_down=False, steps=240, gap=(25, 40), every_steps=50)


def overrides(size: KillSize) -> list[str]:
    """The job: one loss line per step (every loss is compared), a durable checkpoint, a spare
    node, and no host quarantine: the driver's random kills are no host's fault (with the
    default, a host whose ranks died twice would be left out, and ten kills on three hosts would
    leave none). The failure settings are the defaults: max_failures (20) and the in-memory
    snapshots at the interval "auto" measures."""
    return [f"train.max_steps={size.steps}", "train.batch_size=32", "train.log_every=1",
            f"train.eval_every={size.steps}", "train.threads=1", f"checkpoint.every_steps={size.every_steps}",
            "slurm.tasks_per_node=1", 'slurm.partition="wide"', 'slurm.on_node_loss="continue"',
            f"slurm.spare_nodes={1 if size.node_down else 0}", "slurm.exclude_after=0", 'slurm.time="00:30:00"']


def auto_intervals(log: str) -> list[int]:
    """The snapshot interval "auto" chose in each attempt, from rank 0's log (store/memsnap.py's
    line "in-memory snapshots every N steps (snapshot_every = "auto"): ...")."""
    import re

    return [int(n) for n in re.findall(r"in-memory snapshots every ([0-9]+) steps \(snapshot_every", log)]


def rank_process(job: str, rank: int) -> tuple[int, str] | None:
    """(pid, node) of the job's rank `rank`: the process that trains, which is the one a node's
    warm-start server forked for it (node/warm.py: named ddpjob-rRANK, its parent a server with
    the job's environment), else the `python -u -m ddpjob run` srun started with
    SLURM_PROCID=rank (not srun itself, not the batch script's decision)."""
    for p in Path("/proc").iterdir():
        try:
            if not p.name.isdigit() or (p / "comm").read_text().strip() != f"ddpjob-r{rank}":
                continue
            parent = (p / "stat").read_text().rsplit(")", 1)[1].split()[1]
            env = _environ(Path("/proc", parent))
        except (OSError, IndexError):
            continue
        if env.get(b"SLURM_JOB_ID") == job.encode():
            return int(p.name), env.get(b"SLURMD_NODENAME", b"?").decode()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
            if not (cmd and b"python" in os.path.basename(cmd[0]) and b"ddpjob" in cmd and b"run" in cmd):
                continue
            env = _environ(p)
        except OSError:
            continue
        if env.get(b"SLURM_JOB_ID") == job.encode() and env.get(b"SLURM_PROCID") == str(rank).encode():
            return int(p.name), env.get(b"SLURMD_NODENAME", b"?").decode()
    return None


def _environ(proc: Path) -> dict[bytes, bytes]:
    """The environment a process started with (/proc/PID/environ)."""
    return dict(kv.split(b"=", 1) for kv in (proc / "environ").read_bytes().split(b"\0") if b"=" in kv)


def lose_node(job: str, node: str) -> None:
    """`node` fails under the job: DOWN in the controller, its processes killed, its memory gone."""
    slurmctl._run(["scontrol", "update", f"nodename={node}", "state=down", "reason=ddpjob-bench-P12"])
    pids = slurmctl._run(["scontrol", "listpids", job, node], check=False).stdout.splitlines()[1:]
    for line in pids:
        if line.split()[:1] and line.split()[0].isdigit():
            try:
                os.kill(int(line.split()[0]), 9)
            except ProcessLookupError:
                pass
    for tree in memsnap.SHM.glob(f"ddpjob-{os.getuid()}/{job}-*/{node}"):
        shutil.rmtree(tree, ignore_errors=True)


class Progress:
    """Rank 0's newest logged train step of an attempt, read from metrics.jsonl as it grows."""

    def __init__(self, run: Path) -> None:
        self.path, self.offset = run / "metrics.jsonl", 0
        self.last: dict[Any, int] = {}
        self._tail = b""

    def step(self, restart: int) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return 0
        self.offset += len(data)
        *lines, self._tail = (self._tail + data).split(b"\n")
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("kind") == "train" and isinstance(rec.get("step"), int):
                self.last[rec.get("restart")] = max(self.last.get(rec.get("restart"), 0), rec["step"])
        return int(self.last.get(restart, 0))


class ShmWatch(threading.Thread):
    """The job's /dev/shm tree while it runs: the most bytes and the most snapshot folders one
    rank held at once."""

    def __init__(self, job: str) -> None:
        super().__init__(daemon=True)
        self.job, self.max_bytes, self.max_per_rank = job, 0, 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.25):
            total = 0
            for root in memsnap.SHM.glob(f"ddpjob-{os.getuid()}/{self.job}-*"):
                for rank in root.glob("*/rank-*"):
                    try:  # snapshots and staging folders; not one being deleted (".del-")
                        held = sum(1 for p in rank.iterdir() if p.name.startswith(("step-", ".tmp-step-")))
                        self.max_per_rank = max(self.max_per_rank, held)
                        total += sum(f.stat().st_size for f in rank.rglob("*") if f.is_file())
                    except OSError:
                        pass  # a snapshot pruned under us
            self.max_bytes = max(self.max_bytes, total)

    def left(self) -> list[str]:
        return [str(p) for p in memsnap.SHM.glob(f"ddpjob-{os.getuid()}/{self.job}-*")]


@dataclass
class Failure:
    kind: str  # "kill -9 rank R on HOST" / "node HOST down"
    attempt: int  # the attempt it ended
    target: int  # the step the driver waited for
    killed_at: float  # time.time() of the kill
    facts: dict[str, Any] = field(default_factory=dict)


def run_storm(work: Path, run: Path, script: Path, size: KillSize,
          log: Callable[[str], None]) -> tuple[str, list[Failure], ShmWatch]:
    env = slurmctl.clean_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    slurmctl.wait_free(timeout=600)
    job = slurmctl.sbatch(script, cwd=work, env=env)
    rng = random.Random(size.seed)
    progress, shm = Progress(run), ShmWatch(job)
    shm.start()
    failures: list[Failure] = []
    downed: str | None = None
    try:
        log(f"  P12: kill storm job {job} submitted ({size.steps} steps, seed {size.seed})")
        total = size.kills + (1 if size.node_down else 0)
        for k in range(total):
            first = storm.wait_for(f"first step of attempt {k}", lambda: storm.events(run, "first_step", restart=k),
                                   job, 600)[0]
            target = int(first["step"]) + rng.randint(*size.gap)
            node_loss = k == size.kills
            rank = rng.randrange(2)
            if target >= size.steps - 5:
                raise RuntimeError(f"P12: failure {k + 1} would come at step {target} of {size.steps}: more steps")
            storm.wait_for(f"step {target} of attempt {k}", lambda: progress.step(k) >= target, job, 600)
            found = rank_process(job, rank)
            if found is None:
                raise RuntimeError(f"P12: rank {rank} of job {job} not found at step {target}")
            pid, host = found
            if node_loss:
                killed = time.time()
                lose_node(job, host)
                downed = host
                failures.append(Failure(f"node {host} down", k, target, killed))
            else:
                killed = time.time()
                os.kill(pid, 9)
                failures.append(Failure(f"kill -9 rank {rank} on {host}", k, target, killed))
            log(f"  P12: failure {k + 1}: {failures[-1].kind} at step {progress.step(k)} (target {target})")
        end = slurmctl.wait_done(job, timeout=1800)
        if end != "COMPLETED":
            raise RuntimeError(f"P12: job {job} ended {end}; see {run / 'logs'}")
    finally:
        shm.halt.set()
        if slurmctl.active(job):
            slurmctl.cancel(job)
        if downed is not None:
            slurmctl._run(["scontrol", "update", f"nodename={downed}", "state=resume"], check=False)
    return job, failures, shm


def _t(rec: dict[str, Any] | None, key: str) -> float | None:
    v = (rec or {}).get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def measure(failures: list[Failure], events: list[dict[str, Any]], records: list[dict[str, Any]],
            job: str) -> list[dict[str, Any]]:
    """Per failure: where the attempt last logged, where the next resumed, steps lost, and the
    recovery's phases (seconds). Pure: tests/unit/test_bench.py checks it on a written ledger."""
    last: dict[int, int] = {}
    for r in records:
        if isinstance(r.get("restart"), int):
            last[r["restart"]] = max(last.get(r["restart"], 0), int(r["step"]))
    out = []
    for f in failures:
        stop = next((e for e in events if e.get("event") == "stop" and "rank" not in e
                     and e.get("restart") == f.attempt and str(e.get("job_id")) == job), None)
        start = next((e for e in events if e.get("event") == "start" and e.get("restart") == f.attempt + 1), None)
        first = next((e for e in events if e.get("event") == "first_step" and e.get("restart") == f.attempt + 1), None)
        if stop is None or start is None or first is None:
            raise ValueError(f"failure in attempt {f.attempt}: no decision record, restart or first step recorded")
        resumed = int(start.get("resumed_step") or 0)
        ends = {
            "detect and tear down": (f.killed_at, _t(stop, "time")),
            "restart": (_t(stop, "time"), _t(start, "launched_time")),
            "start-up": (_t(start, "launched_time"), (_t(start, "time") or 0.0) - (_t(start, "load_s") or 0.0)),
            "load": (0.0, _t(start, "load_s")),
            "first step": (_t(start, "time"), _t(first, "time")),
        }
        phases = {name: round(b - a, 3) for name, (a, b) in ends.items() if a is not None and b is not None}
        out.append({"failure": f.kind, "reason": stop.get("reason"), "last_step": last.get(f.attempt, 0),
                    "resumed_step": resumed, "steps_lost": max(0, last.get(f.attempt, 0) - resumed),
                    "same_job": str(start.get("job_id")) == job, "phases": phases,
                    "total_s": round((_t(first, "time") or f.killed_at) - f.killed_at, 3)})
    return out


def loop_ratio(events: list[dict[str, Any]], records: list[dict[str, Any]]) -> tuple[float, float, float]:
    """(time in the step loops, wall time from the first process start to the finished stop, their
    ratio): an attempt's loop runs from its start record to its last logged step (the finished
    stop for the last)."""
    starts = [e for e in events if e.get("event") == "start"]
    done = [e for e in events if e.get("event") == "stop" and e.get("reason") == "finished" and "rank" not in e]
    if not starts or not done:
        raise ValueError("the run has no start or no finished stop")
    loops = 0.0
    for s in starts:
        times = [float(r["time"]) for r in records if r.get("restart") == s.get("restart")]
        end = _t(done[-1], "time") if s is starts[-1] else max(times, default=None)
        if end is not None and (begin := _t(s, "time")) is not None:
            loops += max(0.0, end - begin)
    wall = (_t(done[-1], "time") or 0.0) - (_t(starts[0], "launched_time") or _t(starts[0], "time") or 0.0)
    return round(loops, 3), round(wall, 3), (loops / wall if wall > 0 else 0.0)


def medians(measured: list[dict[str, Any]]) -> dict[str, float]:
    return {name: round(statistics.median(v), 3) for name in PHASES
            if (v := [m["phases"][name] for m in measured if name in m["phases"]])}
