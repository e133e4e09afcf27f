"""A plain torchrun-style script as the entry ([train] command, docs/commands.md) under the local
backend: 2 ranks of tests/command_scripts/plain_train.py (its own checkpoint, SIGTERM caught to
save and exit 3), each run by `ddpjob run`'s rank process as one child.

- preempted once (SIGUSR2 to the supervisor while rank 1 pauses after step 7): the script gets
  SIGTERM, saves, exits 3; the supervisor requeues; the next attempt resumes from its checkpoint
  and finishes; `status` and `ls` show both attempts and the goodput;
- one rank SIGKILLed, or its `ddpjob run`: an infrastructure crash, restarted in place, finished
  from its checkpoint;
- a ValueError raised by the script on every rank: the user's bug, not retried, FAILED, the
  verdict line naming the exception and plain_train.py's line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from clirun import TESTS, ddpjob, job_env, wait_for, without_job_env
from ranks import write_job
from runlogs import events, rank_crashes, stops

SCRIPT = TESTS / "command_scripts" / "plain_train.py"
STEPS = 12


def submit(tmp_path: Path, command: list[str] | None = None, train: dict[str, Any] | None = None,
           **env: str) -> tuple[Path, int]:
    """`ddpjob submit --backend local` of the script on 2 ranks; the run dir and the supervisor's pid."""
    job = write_job(tmp_path / "job.toml", slurm=dict(nodes=1, tasks_per_node=2),
                    train=dict(command=command or [sys.executable, str(SCRIPT), "--out_dir", str(tmp_path / "out"),
                                                   "--max_steps", str(STEPS)], **(train or {})))
    run_dir = tmp_path / "run"
    ddpjob("submit", str(job), "--backend", "local", "--run-dir", str(run_dir), cwd=tmp_path,
           env=without_job_env(job_env(**env)), check=True)
    return run_dir, json.loads((run_dir / "job.json").read_text())["pid"]


def local(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "local.json"
    return json.loads(path.read_text()) if path.exists() else {}


def ended(run_dir: Path) -> str:
    return wait_for(lambda: local(run_dir).get("state") in ("COMPLETED", "FAILED") and local(run_dir)["state"],
                    240, "the run to end")


def log(run_dir: Path, rank: int) -> str:
    path = run_dir / "logs" / f"rank-{rank}.log"
    return path.read_text() if path.exists() else ""


def train_lines(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_preempted_command_resumes_its_own_checkpoint_and_finishes(tmp_path: Path) -> None:
    run_dir, sup = submit(tmp_path, DDPJOB_TEST_AT="1:7:0:pause")
    wait_for(lambda: "paused at step 7" in log(run_dir, 1), 120, "rank 1 to pause")
    os.kill(sup, signal.SIGUSR2)
    assert ended(run_dir) == "COMPLETED", log(run_dir, 0) + log(run_dir, 1)
    assert [h["exit_codes"] for h in local(run_dir)["history"]] == [[3, 3], [0, 0]]
    assert "stopping at step 7 for a requeue" in log(run_dir, 0)
    assert "resumed from" in log(run_dir, 0) and "at step 7" in log(run_dir, 0)
    stop = stops(events(run_dir))
    assert [(s["reason"], s["step"]) for s in stop] == [("time_limit", 7)], stop
    # every step once per attempt: 1..7 in attempt 0, 8..12 in attempt 1 (its own checkpoint)
    steps = [(r["restart"], r["step"]) for r in train_lines(run_dir)]
    assert steps == [(0, s) for s in range(1, 8)] + [(1, s) for s in range(8, STEPS + 1)], steps
    assert (run_dir / "COMPLETED").is_file()
    status = ddpjob("status", str(run_dir), "--json", check=True)
    info = json.loads(status.stdout)
    assert info["state"] == "COMPLETED", info
    text = ddpjob("status", str(run_dir), check=True).stdout
    assert "restarts    1" in text and "goodput" in text and "last step   12" in text, text
    listing = ddpjob("ls", "--runs-root", str(tmp_path), check=True).stdout
    assert "COMPLETED" in listing and "local-" in listing, listing
    row = json.loads(ddpjob("ls", "--runs-root", str(tmp_path), "--json", check=True).stdout.splitlines()[0])
    assert row["restarts"] == 1 and [a["restart"] for a in row["goodput"]["attempts"]] == [0, 1], row
    # the steps are productive from the first step line on (not from when a poll saw it): at
    # least the time between attempt 0's step 1 and step 7 lines and attempt 1's 8 and 12
    first = {r["restart"]: r["time"] for r in reversed(train_lines(run_dir))}
    last = {r["restart"]: r["time"] for r in train_lines(run_dir)}
    trained = sum(last[a] - first[a] for a in (0, 1))
    assert row["goodput"]["seconds"]["productive"] >= trained - 0.002 > 0 and row["stops"], (trained, row)
    plot = ddpjob("plot", str(run_dir), "-o", str(tmp_path / "plot.png"), check=True).stdout
    assert "1 restart marker(s)" in plot and (tmp_path / "plot.png").stat().st_size > 0, plot


def test_a_killed_rank_of_a_command_restarts_in_place(tmp_path: Path) -> None:
    run_dir, _ = submit(tmp_path, DDPJOB_TEST_AT="1:8:0:kill")
    assert ended(run_dir) == "COMPLETED", log(run_dir, 0) + log(run_dir, 1)
    crash = stops(events(run_dir))
    assert len(crash) == 1 and crash[0]["reason"] == "crash" and crash[0]["verdict"] == "infrastructure", crash
    assert crash[0]["action"] == "restart", crash
    assert "restarting in place from the command's own checkpoint (it had logged step 8)" in crash[0]["line"], crash
    # the attempt's start record: where the script's own checkpoint took it (its first step, less one)
    assert [s.get("resumed_step") for s in events(run_dir, "start")] == [None, 5]
    mine = rank_crashes(events(run_dir), rank=1)
    assert mine and mine[0]["error"] == "the command was killed by SIGKILL", mine
    # saved every 5 steps: the restart resumes from step 5 and replays 6..8
    assert "resumed from" in log(run_dir, 0) and "at step 5" in log(run_dir, 0)
    assert [r["step"] for r in train_lines(run_dir) if r["restart"] == 1] == list(range(6, STEPS + 1))


def test_a_killed_ddpjob_run_of_a_command_restarts_in_place(tmp_path: Path) -> None:
    """Rank 1's `ddpjob run` itself is SIGKILLed after step 8 (its program exits with it) while
    rank 0's waits there: no crash record from rank 1; the supervisor saw its rank die by SIGKILL."""
    run_dir, _ = submit(tmp_path, DDPJOB_TEST_AT="0:8:0:pause,1:8:0:killwrapper")
    assert ended(run_dir) == "COMPLETED", log(run_dir, 0) + log(run_dir, 1)
    decided = stops(events(run_dir))
    assert [(d["reason"], d.get("verdict"), d.get("action")) for d in decided] == [
        ("crash", "infrastructure", "restart")], decided
    assert decided[0]["failed_rank"] == 1 and "SIGKILL" in decided[0]["failed_how"], decided
    assert not rank_crashes(events(run_dir), rank=1), "its ddpjob run was killed: no record"
    assert [r["step"] for r in train_lines(run_dir) if r["restart"] == 1] == list(range(6, STEPS + 1))


def test_a_bug_raised_by_the_command_fails_the_run_naming_its_line(tmp_path: Path) -> None:
    line = next(n for n, text in enumerate(SCRIPT.read_text().splitlines(), 1) if 'raise ValueError(f"a bug' in text)
    run_dir, _ = submit(tmp_path, DDPJOB_TEST_AT="*:4::raise")
    assert ended(run_dir) == "FAILED"
    decision = stops(events(run_dir))
    assert len(decision) == 1 and decision[0]["verdict"] == "user" and decision[0]["action"] == "end", decision
    assert decision[0]["where"] == f"plain_train.py:{line}", decision
    assert f"ValueError at plain_train.py:{line}" in decision[0]["line"], decision
    assert f"ValueError at plain_train.py:{line}" in (run_dir / "logs" / "supervisor.log").read_text()
    assert len(local(run_dir)["history"]) == 1  # not retried


def test_a_command_that_cannot_start_fails_once_with_one_line(tmp_path: Path) -> None:
    run_dir, _ = submit(tmp_path, command=[str(tmp_path / "no-such-program"), "--x"])
    assert ended(run_dir) == "FAILED"
    decision = stops(events(run_dir))
    assert len(decision) == 1 and (decision[0]["verdict"], decision[0]["action"]) == ("user", "end"), decision
    assert "no-such-program' cannot be started" in log(run_dir, 0) + log(run_dir, 1)
    assert len(local(run_dir)["history"]) == 1


def test_a_silent_hung_command_is_ended_and_restarted_in_place(tmp_path: Path) -> None:
    """Rank 1's script stops for good after step 6, silent and deaf to SIGTERM (rank 0's waits in
    its all-reduce, silent too): after command_hang_s without output or heartbeat each rank sends
    SIGTERM, SIGKILL after the grace, and records the hang; restarted in place, it finishes.
    Both ranks fall silent at step 6, so either watch may fire first (the other rank is then torn
    down by the supervisor before its own fires): the run records the hang, from whichever rank."""
    run_dir, _ = submit(tmp_path, train=dict(command_hang_s=30, command_grace_s=2), DDPJOB_TEST_AT="1:6:0:hang")
    assert ended(run_dir) == "COMPLETED", log(run_dir, 0) + log(run_dir, 1)
    hung = [c for c in rank_crashes(events(run_dir)) if "no output or heartbeat for 30 s" in c.get("error", "")]
    assert hung, rank_crashes(events(run_dir))
    crash = stops(events(run_dir))
    assert len(crash) == 1 and (crash[0]["verdict"], crash[0]["action"]) == ("infrastructure", "restart"), crash
    assert "at step 5" in log(run_dir, 0)  # resumed from the script's checkpoint of step 5
