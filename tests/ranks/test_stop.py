"""`ddpjob stop RUN` (launch/stop.py): every rank stops at the same step with a checkpoint, the
job ends without a requeue (STOPPED), and `ddpjob resume` finishes it. On the local backend and
through real sbatch/scancel on the SLURM test cluster. The stop is caused at a step: rank 0 waits
in its 6th training forward call until the stop signal has reached it (trainer_plugins "pause")."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from ddpjob import fileio
from ddpjob.ledger.events import read as read_events
from clirun import REPO as ROOT
from clirun import ddpjob as run_cli
from ranks import LAG
from runlogs import decisions

SMOKE = str(ROOT / "jobs" / "smoke.toml")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDPJOB_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
    return {**env, "OMP_NUM_THREADS": "1"}


def _paused(log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not (log.exists() and "paused at call 6" in log.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"rank 0 never reached its 6th forward call ({log})"
        time.sleep(0.2)


def _stops(run: Path) -> list[dict[str, Any]]:
    return decisions(read_events(run))


@pytest.mark.slow
def test_stop_checkpoints_a_local_run_which_resume_finishes(tmp_path: Path) -> None:
    run, env = tmp_path / "run", _env()
    keys = ["--backend", "local", "--run-dir", str(run), "--set", "train.max_steps=12",
            "--set", "train.eval_every=0", "--set", 'train.model="trainer_plugins:signalling_cnn"']
    first = run_cli("submit", SMOKE, *keys, cwd=tmp_path, env={**env, "DDPJOB_TEST_SIGNAL": "0:6:0:pause"})
    assert first.returncode == 0, first.stderr
    _paused(run / "logs" / "rank-0.log")
    out = run_cli("stop", str(run), cwd=tmp_path, env=env)
    assert out.returncode == 0 and "the ranks write a checkpoint at their next step and end" in out.stdout + out.stderr
    deadline = time.monotonic() + 180
    while fileio.read_record(run / "local.json").get("state") != "STOPPED":
        assert time.monotonic() < deadline, fileio.read_record(run / "local.json")
        time.sleep(0.2)
    (stop,) = _stops(run)
    assert stop["reason"] == "user_stop" and stop["step"] == 6 + LAG, stop
    assert [e for e in read_events(run) if e["event"] == "start"][-1]["restart"] == 0  # not restarted
    status = run_cli("status", str(run), cwd=tmp_path, env=env).stdout
    assert "state       STOPPED" in status and f"checkpoint  step-{6 + LAG:09d}" in status, status
    # rank 0 says why in its own words: `ddpjob stop` is no requeue
    log = (run / "logs" / "rank-0.log").read_text()
    assert f"stopping at step {6 + LAG} (`ddpjob stop`; this rank got SIGUSR2" in log, log
    assert "checkpoint written, not requeued" in log and "(requeue" not in log, log
    again = run_cli("stop", str(run), cwd=tmp_path, env=env)
    assert again.returncode == 1 and "has already finished, nothing to stop" in again.stderr
    done = run_cli("resume", str(run), "--wait", cwd=tmp_path, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    starts = [e for e in read_events(run) if e["event"] == "start"]
    assert starts[-1]["resumed_step"] == 6 + LAG and (run / "COMPLETED").exists()
    # --wait shows the new attempt's lines only, though the rank log holds both attempts
    assert f"resumed from step-{6 + LAG:09d}" in done.stdout and "paused at call 6" not in done.stdout, done.stdout
    assert "paused at call 6" in (run / "logs" / "rank-0.log").read_text()
    # `ddpjob logs` marks where each attempt begins
    jobs = [s["job_id"] for s in starts]
    marks = [line for line in run_cli("logs", str(run), cwd=tmp_path, env=env).stdout.splitlines()
             if line.startswith("==> ")]
    assert marks == [f"==> attempt 0 (job {jobs[0]}, first start) <==",
                     f"==> attempt 1 (job {jobs[1]}, resumed after user_stop at step {6 + LAG}) <=="], marks
