"""P15, the machinery at 2 to 32 ranks: the same small `ddpjob sbatch` job (`cnn_tiny`, 2 tasks
per node, a checkpoint every 10 steps; ~12 s of steps before the stop, `plan`) at 2, 4, 8, 16
and 32 ranks on the SLURM test cluster grown to 16 nodes (`tests/cluster/start.sh --nodes 16`,
all on this machine), stopped once by the time-limit warning (`scancel --signal=USR2`: every rank stops at
the same step, checkpoints, rank 0 requeues the job) and resumed to the end.

What is counted (trustworthy at any rank count on 2 cores):
  slurmctld RPCs       by message type (`sdiag`, reset before each size), per attempt. The
                       driver sends 3 of them (the submit, the signal, the release of the
                       requeued job) and otherwise watches the run dir, never slurmctld.
  store requests       TCP segments the ranks send to rank 0's TCPStore (`ss -ti`: data_segs_out
                       of every connection to the master port, per process), per second and per
                       step per rank, over ~12 s of the first attempt
  files per checkpoint per rank
What is timed (with 2 cores, times at 16 and 32 ranks mostly measure CPU contention):
  the start to the first step, the stop vote per step, the checkpoint's blocking time, the
  recovery after the stop by phase, `ddpjob status RUN`.

Only by name: `python -m bench P15` (~15 minutes); `--tiny`: 2 and 4 ranks.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import slurmctl, storm
from ddpjob.ledger import phases as phases_mod
from ddpjob.fileio import read_jsonl

FULL = (2, 4, 8, 16, 32)
TINY = (2, 4)
EVERY = 10  # checkpoint.every_steps
FIRST = 5  # the store requests are counted from this step to two steps before the stop
DRIVER_RPCS = {"REQUEST_SUBMIT_BATCH_JOB": 1, "REQUEST_KILL_JOB": 1, "REQUEST_UPDATE_JOB": 1}

_SDIAG = re.compile(r"^\s+([A-Z_0-9]+)\s+\(\s*\d+\)\s+count:(\d+)\b", re.M)
_SS_USER = re.compile(r'users:\(\("[^"]*",pid=(\d+),')
_SS_SEGS = re.compile(r"\bdata_segs_out:(\d+)\b")


def plan(ranks: int) -> tuple[int, int]:
    """(the step the stop comes at, max_steps). The hang watch asks the store on a clock, so the
    first attempt should last ~12 s at every size: a step takes ~8 ms x ranks on this machine."""
    stop = max(20, math.ceil(12.0 / (0.008 * ranks)))
    return stop, stop + 20


def overrides(ranks: int) -> list[str]:
    steps = plan(ranks)[1]
    return [f"train.max_steps={steps}", "train.batch_size=8", "train.log_every=1", f"train.eval_every={steps}",
            "train.threads=1", f"checkpoint.every_steps={EVERY}", f"data.synthetic_train={max(2048, 16 * ranks * 8)}",
            "data.synthetic_test=256", f"slurm.tasks_per_node={min(2, ranks)}", 'slurm.partition="wide"',
            "slurm.max_requeues=3", 'slurm.time="00:20:00"']


def parse_sdiag(text: str) -> dict[str, int]:
    """{message type: count} of sdiag's "by message type" section."""
    part = text.split("by message type", 1)[-1].split("by user", 1)[0]
    return {name: int(n) for name, n in _SDIAG.findall(part)}


def parse_ss(text: str) -> dict[int, int]:
    """`ss -tinpH state established dport = :PORT`: {client pid: data segments sent}, summed over
    its connections (a rank holds two: its process group's store client and its hang watch's)."""
    out: dict[int, int] = {}
    pid: int | None = None
    for line in text.splitlines():
        user = _SS_USER.search(line)
        if user:
            pid = int(user[1])
            continue
        segs = _SS_SEGS.search(line)
        if segs and pid is not None:
            out[pid] = out.get(pid, 0) + int(segs[1])
            pid = None
    return out


def store_segments(port: int) -> dict[int, int]:
    out = subprocess.run(["ss", "-tinpH", "state", "established", "dport", "=", f":{port}"],
                         capture_output=True, text=True, timeout=30)
    return parse_ss(out.stdout)


def _ddpjob(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ddpjob", *argv], capture_output=True, text=True, cwd=cwd,
                          env=slurmctl.clean_env(OMP_NUM_THREADS="1"), timeout=900)


def _last_step(run: Path, restart: int) -> int:
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl")
             if r.get("kind") == "train" and r.get("restart") == restart and isinstance(r.get("step"), int)]
    return max(steps, default=0)


def _until(what: str, check: Callable[[], Any], job: str, timeout: float) -> Any:
    """Wait on the run dir, not on slurmctld (whose RPCs are counted); sacct (slurmdbd) says
    whether the job died meanwhile, every 10 s."""
    deadline, asked = time.monotonic() + timeout, time.monotonic()
    while not (value := check()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"P15: no {what} after {timeout:.0f} s (job {job})")
        if time.monotonic() - asked > 10:
            asked = time.monotonic()
            state = slurmctl.accounted(job)
            if state in slurmctl.FINAL - {"PREEMPTED"} and not (value := check()):
                raise RuntimeError(f"P15: job {job} ended {state} before {what}")
        time.sleep(0.2)
    return value


def one(work: Path, ranks: int, log: Callable[[str], None]) -> dict[str, Any]:
    """One size: submit, count, stop at plan()'s step, release, finish; the figures."""
    stop_at = plan(ranks)[0]
    sets = [a for o in overrides(ranks) for a in ("--set", o)]
    run, script = work / f"run-{ranks}", work / f"job-{ranks}.sbatch"
    nodes = max(1, ranks // 2)
    shutil.rmtree(run, ignore_errors=True)
    made = _ddpjob("sbatch", str(storm.JOB), "--nodes", str(nodes), *sets, "-o", str(script),
                   "--run-dir", str(run), cwd=work)
    if made.returncode != 0:
        raise RuntimeError(f"P15: ddpjob sbatch failed: {(made.stdout + made.stderr)[-1500:]}")
    slurmctl.wait_free(timeout=600)
    time.sleep(2)  # the last job's epilog messages
    slurmctl._run(["sdiag", "-r"])
    job = slurmctl.sbatch(script, cwd=work, env=slurmctl.clean_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    try:
        _until(f"step {FIRST}", lambda: _last_step(run, 0) >= FIRST, job, 900)
        head = (run / "logs" / "rank-0.log").read_text(errors="replace")
        port = int(re.search(r"master [^:\s]+:(\d+)", head)[1])  # type: ignore[index]
        before, t_before = store_segments(port), time.monotonic()
        _until(f"step {stop_at - 2}", lambda: _last_step(run, 0) >= stop_at - 2, job, 900)
        after, window_s = store_segments(port), time.monotonic() - t_before
        steps = _last_step(run, 0) - FIRST  # at most: the first sample may have come a step late
        _until(f"step {stop_at}", lambda: _last_step(run, 0) >= stop_at, job, 900)
        slurmctl._run(["scancel", "--signal=USR2", job])
        stop = _until("the requeue", lambda: storm.events(run, "stop", restart=0), job, 600)[0]
        if stop.get("requeued") is not True:
            raise RuntimeError(f"P15: the stop was not requeued: {stop}")
        time.sleep(3)  # slurmd refuses a credential made in the second the attempt ended
        slurmctl.release(job)
        _until("the end", lambda: storm.events(run, "stop", reason="finished"), job, 900)
        # then the job's end in SLURM (slurmdbd: asking it costs slurmctld nothing), so that the
        # end's own messages (the batch script's, the steps', every node's epilog) are counted
        _until("the job's end in sacct", lambda: slurmctl.accounted(job) in slurmctl.FINAL, job, 600)
        time.sleep(3)
        rpcs = parse_sdiag(slurmctl._run(["sdiag"]).stdout)
    finally:
        if slurmctl.active(job):
            slurmctl.cancel(job)
    t0 = time.perf_counter()
    status = _ddpjob("status", str(run), cwd=work)
    status_s = time.perf_counter() - t0
    events = read_jsonl(run / "events.jsonl")
    starts = [e for e in events if e.get("event") == "start"]
    first = storm.events(run, "first_step", restart=0)
    stops = [i for i, e in enumerate(events) if e.get("event") == "stop" and "rank" not in e and e.get("restart") == 0]
    vote = re.findall(r"stop vote (\d+) us/step", (run / "logs" / "rank-0.log").read_text(errors="replace"))
    ckpt = sorted((run / "checkpoints").glob("step-*"))
    sent = {pid: after.get(pid, 0) - n for pid, n in before.items()}
    blocks = [e["block_s"] for e in events if e.get("event") == "checkpoint" and isinstance(e.get("block_s"), (int, float))]
    out = {
        "ranks": ranks, "nodes": nodes, "job": job, "run": str(run),
        "first_step_s": round(first[0]["time"] - starts[0]["launched_time"], 2) if first and starts else None,
        "vote_us": int(vote[-1]) if vote else None,
        "checkpoint_block_s": round(statistics.median(blocks), 3) if blocks else None,
        "recovery": phases_mod.recovery(events, stops[0]) if stops else {},
        "status_s": round(status_s, 2), "status_ok": status.returncode == 0,
        "rpcs": rpcs, "attempts": len(starts),
        "store_segments_per_step": sorted(round(v / max(steps, 1), 2) for v in sent.values()),
        "store_segments_per_s": sorted(round(v / max(window_s, 1e-3), 3) for v in sent.values()),
        "window_steps": steps, "window_s": round(window_s, 2),
        "store_clients": len(before),
        "files_per_rank": round(len([p for p in ckpt[-1].iterdir() if p.is_file()]) / ranks, 2) if ckpt else None,
    }
    log(f"  P15: {ranks} ranks: {json.dumps({k: v for k, v in out.items() if k not in ('rpcs', 'run')})}")
    return out
