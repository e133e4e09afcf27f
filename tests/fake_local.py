"""Local-backend runs without training: a run dir the supervisor (ddpjob/launch/local.py) accepts,
and fake ranks (a few lines of Python, FAKE_RANK) that make its behaviour fast and deterministic.

Shared by tests/ranks/test_local_backend.py, test_control*.py and test_runlock*.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ddpjob import fileio, jobfile

# A fake `ddpjob run RUN_DIR`: records its environment, then behaves as RUN_DIR/fake.json says.
FAKE_RANK = r'''
import json, os, signal, sys, time
run_dir = sys.argv[-1]
rank, restart = int(os.environ["RANK"]), int(os.environ["DDPJOB_RESTART_COUNT"])
mode = json.load(open(os.path.join(run_dir, "fake.json")))["mode"]
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "MASTER_ADDR", "MASTER_PORT", "DDPJOB_JOB_ID", "DDPJOB_RESTART_COUNT", "OMP_NUM_THREADS"]
rec = {k: os.environ.get(k) for k in keys}
rec["pid"] = os.getpid()
path = os.path.join(run_dir, f"fake-r{rank}-s{restart}.json")
stop = []
for s in (signal.SIGUSR2, signal.SIGTERM):
    signal.signal(s, lambda n, f: stop.append(n))
with open(path + ".tmp", "w") as f:
    json.dump(rec, f)
os.replace(path + ".tmp", path)
print(f"fake rank {rank} restart {restart} mode {mode}", flush=True)


def all_started(timeout=120):
    """A rank that fails does so once every rank of this restart has recorded its start: the
    order is caused, not hoped for (a busy machine starts the others late)."""
    world = int(os.environ["WORLD_SIZE"])
    deadline = time.time() + timeout
    while time.time() < deadline and not all(
            os.path.exists(os.path.join(run_dir, f"fake-r{r}-s{restart}.json")) for r in range(world)):
        time.sleep(0.02)


if mode == "ok":
    sys.exit(0)
if mode == "always3":
    sys.exit(3)
if mode == "fail1once" and rank == 1 and restart == 0:
    all_started()
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "fail1once" and restart > 0:
    sys.exit(0)
if mode in ("kill1", "segv1") and rank == 1:
    all_started()
    os.kill(os.getpid(), signal.SIGKILL if mode == "kill1" else signal.SIGSEGV)
if mode == "fail1" and rank == 1:
    all_started()
    sys.exit(1)
if mode == "wait" and restart > 0:
    sys.exit(0)
deadline = time.time() + 60
while not stop and time.time() < deadline:
    time.sleep(0.05)
print(f"fake rank {rank} got signal {stop}", flush=True)
sys.exit(3 if stop else 0)
'''


def make_run(tmp_path: Path, mode: str, nodes: int = 1, tasks: int = 2, max_requeues: int = 3,
             name: str = "run", max_failures: int = 0) -> Path:
    run = tmp_path / name
    (run / "logs").mkdir(parents=True)
    cfg = jobfile.from_dict({"name": "fake", "slurm": {"nodes": nodes, "tasks_per_node": tasks,
                                                      "max_requeues": max_requeues,
                                                      "max_failures": max_failures}})
    fileio.write_text_atomic(run / "config.json", cfg.to_json())
    (run / "fake.json").write_text(json.dumps({"mode": mode}))
    return run


def fake_command(tmp_path: Path) -> str:
    prog = tmp_path / "fake_rank.py"
    prog.write_text(FAKE_RANK)
    return f"{sys.executable} -u {prog}"


def local_state(run: Path) -> dict:
    return fileio.read_json(run / "local.json", {}) or {}
