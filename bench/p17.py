"""P17: steps redone per preemption, Hugging Face Trainer and Lightning, without and with ddpjob's
callback (docs/integrations.md). Only by name (`python -m bench P17`): needs the extras
ddpjob[hf] and ddpjob[lightning], ~5-10 minutes on 2 cores.

Per trainer, both arms run side by side on the local backend (2 ranks each, the test scripts
tests/command_scripts/{hf,lightning}_train.py, 300 steps, a save every 50): each arm's rank 1
pauses after step 130; once both are there, both supervisors get SIGUSR2 (a time-limit stop) at
the same moment; each run requeues and finishes. Steps redone = 130 less the step the second
start trained from (each start prints "training from step N").
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.core import Bench, Row

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = {"hf": "hf_train.py", "lightning": "lightning_train.py"}
NAMES = {"hf": "Hugging Face Trainer", "lightning": "Lightning"}
STEPS, EVERY, AT = 300, 50, 130


def _submit(folder: Path, trainer: str, callback: bool) -> tuple[Path, int]:
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(REPO / "tests" / "command_scripts" / SCRIPTS[trainer]), "--out_dir",
               str(folder / "out"), "--max_steps", str(STEPS), "--save_every", str(EVERY)]
    command += ["--callback"] if callback else []
    (folder / "job.toml").write_text(f'name = "p17"\n[slurm]\nnodes = 1\ntasks_per_node = 2\n[train]\n'
                                     f"command = {json.dumps(command)}\ncommand_grace_s = 30\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDPJOB_"))}
    env.update(OMP_NUM_THREADS="1", DDPJOB_TEST_AT=f"1:{AT}:0:pause")
    subprocess.run([sys.executable, "-m", "ddpjob", "submit", str(folder / "job.toml"), "--backend", "local",
                    "--run-dir", str(folder / "run")], cwd=folder, env=env, check=True, capture_output=True)
    return folder / "run", json.loads((folder / "run" / "job.json").read_text())["pid"]


def _text(run: Path, rank: int) -> str:
    path = run / "logs" / f"rank-{rank}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _state(run: Path) -> str | None:
    path = run / "local.json"
    return json.loads(path.read_text()).get("state") if path.exists() else None


def _wait(what: str, ok, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise RuntimeError(f"P17: timed out waiting for {what}")
        time.sleep(0.5)


def pair(b: Bench, trainer: str) -> dict[bool, dict[str, object]]:
    """Both arms of one trainer, side by side: {callback: {steps redone, state, starts}}."""
    runs = {cb: _submit(b.base / "p17" / f"{trainer}-{'with' if cb else 'without'}-{time.time_ns()}", trainer, cb)
            for cb in (False, True)}
    _wait("both arms to reach step 130", lambda: all(f"paused at step {AT}" in _text(run, 1) for run, _ in runs.values()))
    for _, pid in runs.values():
        os.kill(pid, signal.SIGUSR2)
    _wait("both arms to end", lambda: all(_state(run) in ("COMPLETED", "FAILED") for run, _ in runs.values()))
    out: dict[bool, dict[str, object]] = {}
    for cb, (run, _) in runs.items():
        starts = [int(s) for s in re.findall(r"^training from step ([0-9]+)$", _text(run, 0), re.M)]
        out[cb] = {"state": _state(run), "starts": starts, "redone": AT - starts[1] if len(starts) > 1 else None,
                   "run": str(run)}
        b.log(f"P17 {trainer} {'with' if cb else 'without'} the callback: {out[cb]}")
    return out


def p17(b: Bench) -> list[Row]:
    rows = []
    for trainer in ("hf", "lightning"):
        arms = pair(b, trainer)
        without, with_ = arms[False], arms[True]
        ok = with_["redone"] == 0 and with_["state"] == without["state"] == "COMPLETED"
        rows.append(Row("P17", f"{NAMES[trainer]}: steps redone after a stop at step {AT} of {STEPS} (SIGUSR2 to the "
                        f"local supervisor: a time-limit stop; saves every {EVERY}; 2 ranks), without / with "
                        "DdpjobCallback",
                        "0 with the callback", f"{without['redone']} / {with_['redone']} "
                        f"({without['state']} / {with_['state']})", ok, {"without": without, "with": with_}))
    return rows
