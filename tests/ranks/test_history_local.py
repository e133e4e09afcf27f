"""One history, on the local backend: a run goes through submit -> `ddpjob stop` -> `ddpjob resume`
-> a time-limit signal (the supervisor requeues) -> kill -9 of a rank (restarted in place) ->
`ddpjob stop` -> `ddpjob resume` -> a time-limit signal -> the end. Every view numbers the six
attempts 0..5 the same way (events, metrics, status text and --json, ls, plot's markers), and the
goodput ledger's replayed steps are the steps really trained twice. Every interruption is caused
at a step by the rank itself (tests/example_slurm_hooks.py's actions), never by a timer; the same
sequence on the real cluster is tests/cluster/test_history_slurm.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from clirun import ddpjob, job_env
from ranks import write_job
from runlogs import decisions, events, train_records

TRAIN = dict(model="trainer_plugins:signalling_cnn", batch_size=16, accumulation_steps=1, max_steps=140,
             lr=0.05, warmup_steps=5, log_every=1, eval_every=140, amp="off", channels_last=False, threads=1,
             seed=13)
DATA = dict(dataset="synthetic", synthetic_train=640, synthetic_test=128, augment=False)
# attempt, the step it is handed out at, rank, what it does there (tests/example_slurm_hooks.py)
ACTIONS = ("0 15 0 stop\n"        # attempt 0: `ddpjob stop`; STOPPED
           "1 35 0 signal_job\n"  # attempt 1 (`ddpjob resume`): the time limit's signal; requeued
           "2 65 1 die\n"         # attempt 2: kill -9 of rank 1, after its probe snapshot; in place
           "3 85 0 stop\n"        # attempt 3: `ddpjob stop` again
           "4 105 0 signal_job\n")  # attempt 4 (`ddpjob resume`): the signal; attempt 5 finishes


def cli(*argv: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDPJOB_"))}
    full.update(env)
    return subprocess.run([sys.executable, "-m", "ddpjob", *argv], capture_output=True, text=True, cwd=cwd,
                          env=full, timeout=600)


def assert_one_history(run: Path, cwd: Path, first: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every view agrees on attempts 0..5; returns status --json's record."""
    numbers = list(range(6))
    starts = events(run, "start")
    assert [s["restart"] for s in starts] == numbers, starts
    assert sorted({r["restart"] for r in train_records(run)}) == numbers
    status = ddpjob("status", str(run), cwd=cwd).stdout
    assert "restarts    5 (attempts 0-5)" in status and "restarts    5: resumed at step" in status, status
    record = json.loads(ddpjob("status", str(run), "--json", cwd=cwd).stdout)
    assert (record["restarts"], record["attempts"]) == (5, numbers), record
    assert [a["restart"] for a in record["goodput"]["attempts"]] == numbers, record["goodput"]["attempts"]
    [row] = [r for r in ddpjob("ls", "--json", "--runs-root", str(run.parent), cwd=cwd).stdout.splitlines()
             if json.loads(r)["run_dir"] == str(run)]
    assert json.loads(row)["attempts"] == numbers
    out = ddpjob("plot", str(run), "-o", str(cwd / "curves.png"), cwd=cwd).stdout
    assert [f"restart {n}:" in out for n in numbers[1:]] == [True] * 5, out
    return record


def assert_the_sequence(run: Path, cwd: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The six stops in order, every view's attempts (assert_one_history), and goodput's replayed
    steps against the steps trained twice; returns the decisions and goodput's record."""
    stops = decisions(events(run))
    assert [(s["restart"], s["reason"]) for s in stops] == [
        (0, "user_stop"), (1, "time_limit"), (2, "crash"), (3, "user_stop"), (4, "time_limit"), (5, "finished")]
    assert stops[2]["action"] == "restart" and stops[2]["verdict"] == "infrastructure", stops[2]
    record = assert_one_history(run, cwd)
    # the steps trained twice: those the kill lost, replayed by attempt 3 from its snapshot
    twice = sum(n - 1 for n in Counter(r["step"] for r in train_records(run)).values())
    assert twice == stops[2]["steps_lost"] and twice > 0, (twice, stops[2])
    gp = record["goodput"]
    assert abs(gp["replayed_steps"] - twice) <= 1, (gp["replayed_steps"], twice)
    assert abs(sum(gp["seconds"].values()) - gp["wall_s"]) <= 0.01 * gp["wall_s"], gp
    return stops, gp


@pytest.mark.slow
def test_every_view_tells_one_history_across_stop_resume_requeue_and_a_kill(tmp_path: Path) -> None:
    (tmp_path / "actions").write_text(ACTIONS)
    job = write_job(tmp_path / "job.toml", slurm=dict(nodes=1, tasks_per_node=2), train=TRAIN, data=DATA,
                    checkpoint=dict(every_steps=10, keep_last=3))
    env = job_env(DDPJOB_TEST_ACTIONS=str(tmp_path / "actions"))
    run = tmp_path / "run"
    out = cli("submit", str(job), "--backend", "local", "--run-dir", str(run), "--wait", cwd=tmp_path, env=env)
    assert out.returncode != 0 and "STOPPED" in out.stdout + out.stderr, out.stdout + out.stderr
    for _ in range(2):  # each `ddpjob resume` runs until the next `ddpjob stop`, then to the end
        out = cli("resume", str(run), "--wait", cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert_the_sequence(run, tmp_path)
