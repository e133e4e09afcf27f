"""One job per run dir (ddpjob/runlock.py), with real processes: the lock is exclusive, its holder
is named, the kernel drops it when the holder is SIGKILLed, the local supervisor's ranks train
under its lock, and a second supervisor, `ddpjob resume` and `ddpjob run` are refused with one
line while a job trains there, even with a damaged events.jsonl (the probe that let 4 ranks into
one run dir)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from ddpjob import fileio, jobfile, runlock
from ddpjob.ledger.events import read as read_events

from clirun import wait_for
from fake_local import fake_command, make_run

DDPJOB = [sys.executable, "-m", "ddpjob"]


def _real_run(tmp_path: Path) -> Path:
    """A run dir as `ddpjob submit --backend local` leaves it, run by fake ranks that wait."""
    run = make_run(tmp_path, "wait")
    cfg = jobfile.from_dict({"name": "fake", "train": {"max_steps": 2, "threads": 1},
                            "data": {"dataset": "synthetic", "synthetic_train": 64, "synthetic_test": 16},
                            "slurm": {"tasks_per_node": 2}})
    fileio.write_text_atomic(run / "config.json", cfg.to_json())
    os.chmod(run, 0o700), os.chmod(run / "logs", 0o700)
    fileio.write_json_atomic(run / "job.json", {"backend": "local", "job_id": "local-1"})
    return run


def test_a_second_job_is_refused_in_a_run_dir_where_one_trains(tmp_path: Path) -> None:
    run = _real_run(tmp_path)
    first = subprocess.Popen([sys.executable, "-m", "ddpjob.launch.local", str(run),
                              "--rank-command", fake_command(tmp_path)],
                             stdout=open(tmp_path / "first.log", "ab"), stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (run / "fake-r1-s0.json").exists(), what="the first supervisor's ranks")
        before = (run / "local.json").read_bytes()
        # the probe: one bad line in events.jsonl used to make the idle check skip the run
        fileio.append_jsonl(run / "events.jsonl", {"event": "stop", "reason": "preemption", "restart": "x"})
        # 1. a second supervisor (the login side's check raced): it leaves no trace
        second = subprocess.run([sys.executable, "-m", "ddpjob.launch.local", str(run),
                                 "--rank-command", fake_command(tmp_path)],
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 1 and "is in use: local supervisor of job local-" in second.stdout
        assert (run / "local.json").read_bytes() == before
        assert not (run / "fake-r0-s0.json.tmp").exists()
        # 2. `ddpjob resume` and 3. `ddpjob run` by hand, where the records do not say that a
        # job runs (no job.json: its state is UNKNOWN), so only the lock can tell: one line each,
        # exit 1, nothing started
        (run / "job.json").unlink()
        for argv in (["resume", str(run)], ["run", str(run)]):
            r = subprocess.run(DDPJOB + argv, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
            lines = [ln for ln in r.stderr.splitlines() if ln.startswith("ddpjob: error:")]
            assert r.returncode == 1 and len(lines) == 1, (argv, r.stdout, r.stderr[-2000:])
            assert "is in use: local supervisor of job local-" in lines[0], lines
            assert "Traceback" not in r.stderr
        assert (run / "local.json").read_bytes() == before
        assert not [e for e in read_events(run) if e["event"] == "start"]
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
    assert runlock.holder(run) is None  # the supervisor ended: the run dir is free again
    state = json.loads((run / "local.json").read_text())
    assert state["state"] == "CANCELLED" and state["pid"] == first.pid, state
