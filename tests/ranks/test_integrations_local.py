"""The trainer callbacks (ddpjob/integrations/, docs/integrations.md) with the real packages, on
the local backend: 2 ranks of tests/command_scripts/hf_train.py (a 2-layer GPT-2, Hugging Face
Trainer) and lightning_train.py (a tiny Linear, Lightning), 300 steps, a checkpoint every 50.

Every interruption comes after step 130 (rank 1's script pauses there until the stop signal
reached it; the test then signals the supervisor or runs `ddpjob stop`), never by a timer:
- preempted (SIGUSR2 to the supervisor): with the callback each trainer resumes at 130, 0 steps
  redone, COMPLETED at 300, `status` at the real step; without it each resumes from its save of
  step 100 (30 redone), and neither ends COMPLETED early;
- `ddpjob stop` + `ddpjob resume` with each callback: STOPPED at 130, resumed at 130;
- kill -9 of rank 1 at 130 with each callback: restarted in place from the save of step 100 (the
  callback cannot save for a killed process: 30 redone, as without it);
- a ValueError on rank 1 at 130 with each callback: FAILED at once, the user's, not retried;
- a Lightning Trainer(devices=1) under 2 ranks: FAILED at once, not retried, in Lightning's line;
- an HF run with the callback whose rank 1 aborts after training as torch's teardown does now and
  then (SIGABRT, libstdc++'s line): COMPLETED in its one attempt, not restarted.
The numbers are docs/integrations.md's table.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from clirun import TESTS, ddpjob, job_env, wait_for, without_job_env
from ranks import write_job
from runlogs import events, stops

pytest.importorskip("transformers")
pytest.importorskip("lightning")

pytestmark = pytest.mark.slow

SCRIPTS = {"hf": TESTS / "command_scripts" / "hf_train.py", "lightning": TESTS / "command_scripts" / "lightning_train.py"}
STEPS, EVERY, AT = 300, 50, 130


def submit(tmp_path: Path, trainer: str, callback: bool, *flags: str, **env: str) -> tuple[Path, int]:
    """`ddpjob submit --backend local` of the trainer's script on 2 ranks; the run dir and the
    supervisor's pid."""
    command = [sys.executable, str(SCRIPTS[trainer]), "--out_dir", str(tmp_path / "out"), "--max_steps", str(STEPS),
               "--save_every", str(EVERY), *(["--callback"] if callback else []), *flags]
    job = write_job(tmp_path / "job.toml", slurm=dict(nodes=1, tasks_per_node=2),
                    train=dict(command=command, command_grace_s=30))
    run_dir = tmp_path / "run"
    ddpjob("submit", str(job), "--backend", "local", "--run-dir", str(run_dir), cwd=tmp_path,
           env=without_job_env(job_env(**env)), check=True)
    return run_dir, json.loads((run_dir / "job.json").read_text())["pid"]


def state(run_dir: Path) -> str | None:
    path = run_dir / "local.json"
    return json.loads(path.read_text()).get("state") if path.exists() else None


def ended(run_dir: Path, states: tuple[str, ...] = ("COMPLETED", "FAILED")) -> str:
    return wait_for(lambda: state(run_dir) in states and state(run_dir), 420, "the run to end")


def log(run_dir: Path, rank: int = 0) -> str:
    path = run_dir / "logs" / f"rank-{rank}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def story(run_dir: Path) -> str:
    """What a failed assertion shows: the supervisor's log, each rank's log (its end) and the
    decisions, enough to tell what ended an attempt without the run dir."""
    sup = run_dir / "logs" / "supervisor.log"
    return "\n".join([sup.read_text(errors="replace") if sup.exists() else "(no supervisor.log)",
                      "--- rank 0 ---", log(run_dir)[-6000:], "--- rank 1 ---", log(run_dir, 1)[-4000:],
                      "--- decisions ---", *map(json.dumps, decisions(run_dir))])


def paused(run_dir: Path) -> None:
    wait_for(lambda: f"paused at step {AT}" in log(run_dir, 1), 300, f"rank 1 to pause after step {AT}")


def starts(run_dir: Path) -> list[int]:
    """The step each start of the script trained from (its own line, one per attempt)."""
    return [int(s) for s in re.findall(r"^training from step ([0-9]+)$", log(run_dir), re.M)]


def redone(run_dir: Path) -> int:
    """Steps trained twice: where the interrupted attempt was, less where the next one began."""
    first, second = starts(run_dir)[:2]
    assert first == 0, starts(run_dir)
    return AT - second


def train_steps(run_dir: Path) -> list[tuple[int, int]]:
    return [(r["restart"], r["step"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"]


def decisions(run_dir: Path) -> list[dict[str, Any]]:
    """Each stop's decision (not a rank's own record, nor the run's end)."""
    return stops(events(run_dir))


@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_a_preempted_trainer_with_the_callback_resumes_where_it_stopped(tmp_path: Path, trainer: str) -> None:
    run_dir, sup = submit(tmp_path, trainer, callback=True, DDPJOB_TEST_AT=f"1:{AT}:0:pause")
    paused(run_dir)
    os.kill(sup, signal.SIGUSR2)
    assert ended(run_dir) == "COMPLETED", story(run_dir)
    assert starts(run_dir) == [0, AT] and redone(run_dir) == 0, story(run_dir)
    assert [(d["reason"], d["step"]) for d in decisions(run_dir)] == [("time_limit", AT)], decisions(run_dir)
    assert f"stopped after step {AT}" in log(run_dir) and "exiting 3 (requeue me)" in log(run_dir)
    assert [h["exit_codes"] for h in json.loads((run_dir / "local.json").read_text())["history"]] == [[3, 3], [0, 0]]
    # rank 0's metrics lines: every step once, the stop's save, the final step
    steps = train_steps(run_dir)
    assert steps == [(0, s) for s in range(1, AT + 1)] + [(1, s) for s in range(AT + 1, STEPS + 1)], steps[:3]
    saves = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "checkpoint"]
    assert AT in saves and 100 in saves, saves
    text = ddpjob("status", str(run_dir), check=True).stdout
    assert "COMPLETED" in text and f"last step   {STEPS}" in text and f"resumed at step {AT}" in text, text
    assert "goodput" in text, text


@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_a_preempted_trainer_without_the_callback_redoes_the_steps_since_its_last_save(
        tmp_path: Path, trainer: str) -> None:
    """transformers installs no SIGTERM handler: the ranks die of the signal. Lightning's handler
    broadcasts inside itself (rank 1's waits there for rank 0's, which sits in the step's
    all-reduce) until the grace's SIGKILL, or ends the fit with exit 0: a stop for a requeue
    either way, never COMPLETED early. The next start resumes from the save of step 100.
    Without the callback's `end` line, a teardown abort after the last step (docs/commands.md;
    this project's CI: "done at step 300", then libstdc++'s line and SIGABRT) is exit 0 where a
    peer's program exited 0 by itself: made to here, rank 0's second attempt aborts so ("abortatexit")
    and rank 1's exits 0 ("exitatexit"). COMPLETED in that attempt, no crash, no third start."""
    run_dir, sup = submit(tmp_path, trainer, callback=False,
                          DDPJOB_TEST_AT=f"1:{AT}:0:pause,0:0:1:abortatexit,1:0:1:exitatexit")
    paused(run_dir)
    os.kill(sup, signal.SIGUSR2)
    assert ended(run_dir) == "COMPLETED", story(run_dir)
    assert starts(run_dir) == [0, 100] and redone(run_dir) == AT - 100, story(run_dir)
    assert f"done at step {STEPS}" in log(run_dir)
    assert [d["reason"] for d in decisions(run_dir)] == ["time_limit"], decisions(run_dir)
    assert "terminate called without an active exception" in log(run_dir), story(run_dir)
    assert "read as exit 0 where a peer's program exited 0 by itself" in log(run_dir), story(run_dir)


@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_stop_and_resume_of_a_trainer_with_the_callback_loses_nothing(tmp_path: Path, trainer: str) -> None:
    run_dir, _ = submit(tmp_path, trainer, callback=True, DDPJOB_TEST_AT=f"1:{AT}:0:pause")
    paused(run_dir)
    env = without_job_env(job_env())
    ddpjob("stop", str(run_dir), cwd=tmp_path, env=env, check=True)
    assert ended(run_dir, ("STOPPED", "COMPLETED", "FAILED")) == "STOPPED", story(run_dir)
    assert [(d["reason"], d["step"]) for d in decisions(run_dir)] == [("user_stop", AT)], decisions(run_dir)
    saved = (tmp_path / "out" / f"checkpoint-{AT}" / "ddpjob-manifest.json" if trainer == "hf"
             else tmp_path / "out" / "checkpoints" / "last.ckpt")
    assert saved.is_file(), sorted(p.name for p in (tmp_path / "out").rglob("*"))
    done = ddpjob("resume", str(run_dir), "--wait", cwd=tmp_path, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert starts(run_dir) == [0, AT] and redone(run_dir) == 0, story(run_dir)
    assert (run_dir / "COMPLETED").is_file() and f"done at step {STEPS}" in log(run_dir)


@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_a_killed_rank_of_a_trainer_with_the_callback_restarts_from_its_last_save(tmp_path: Path, trainer: str) -> None:
    run_dir, _ = submit(tmp_path, trainer, callback=True, DDPJOB_TEST_AT=f"1:{AT}:0:kill")
    assert ended(run_dir) == "COMPLETED", story(run_dir)
    (crash,) = decisions(run_dir)
    assert (crash["reason"], crash["verdict"], crash["action"]) == ("crash", "infrastructure", "restart"), crash
    # the process died at once: nothing could be saved; the newest save of the interval resumes
    assert starts(run_dir) == [0, 100] and redone(run_dir) == AT - 100, story(run_dir)


@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_a_bug_in_a_trainer_script_with_the_callback_is_the_users_not_retried(tmp_path: Path, trainer: str) -> None:
    """Rank 1's script raises after step 130: the callback does not take it for a stop. The run
    ends FAILED at once with the rank, the exception and the script's line; nothing is retried and
    nothing is marked COMPLETED."""
    run_dir, _ = submit(tmp_path, trainer, callback=True, DDPJOB_TEST_AT=f"1:{AT}:0:raise")
    assert ended(run_dir) == "FAILED", story(run_dir)
    (decision,) = decisions(run_dir)
    assert (decision["verdict"], decision["action"]) == ("user", "end"), decision
    assert decision["failed_rank"] == 1, decision
    how = decision["failed_how"]
    assert "ValueError" in how and f"a bug at step {AT}" in how and f"{SCRIPTS[trainer].name}:" in how, decision
    # the step it failed after as far as rank 0's lines tell (its line of step 130 waits for the
    # step's loss, and rank 0 was killed first), not the save of step 100 it would resume from
    assert f"ValueError at {SCRIPTS[trainer].name}:" in decision["line"], decision
    assert re.search(rf"at step {AT - 1}\b|at step {AT}\b", decision["line"]), decision
    assert len(json.loads((run_dir / "local.json").read_text())["history"]) == 1
    assert not (run_dir / "COMPLETED").exists() and starts(run_dir) == [0], story(run_dir)
    assert "stopped after step" not in log(run_dir) + log(run_dir, 1), story(run_dir)


def test_a_lightning_trainer_with_fewer_devices_than_the_jobs_ranks_fails_at_once_in_one_line(tmp_path: Path) -> None:
    """Trainer(devices=1) under 2 ranks: Lightning refuses it itself at Trainer(...), naming both
    numbers; the verdict carries that line: the user's, not retried, nothing trained."""
    run_dir, _ = submit(tmp_path, "lightning", True, "--devices", "1")
    assert ended(run_dir) == "FAILED", story(run_dir)
    (decision,) = decisions(run_dir)
    assert (decision["verdict"], decision["action"]) == ("user", "end"), decision
    assert ("You set `devices=1` and `num_nodes=1` in Lightning, but the product (1 * 1) does not match the world "
            "size (2)" in decision["failed_how"]), decision
    assert "training from step" not in log(run_dir) and len(json.loads((run_dir / "local.json").read_text())["history"]) == 1


def test_a_teardown_abort_after_the_trainers_end_is_done_not_a_crash(tmp_path: Path) -> None:
    """The Trainer leaves its process group standing and torch's teardown sometimes aborts after
    the last step ("terminate called without an active exception"; this project's CI saw it on
    real SLURM, then a restart that trained step 301). After the callback's "end" line that is the
    interpreter's end: the run is COMPLETED in one attempt, no crash decided."""
    run_dir, _ = submit(tmp_path, "hf", callback=True, DDPJOB_TEST_AT="1:0:0:abortatexit")
    assert ended(run_dir) == "COMPLETED", story(run_dir)
    assert starts(run_dir) == [0] and decisions(run_dir) == [], story(run_dir)
    assert "interpreter aborted in torch's teardown" in log(run_dir, 1) and "read as done" in log(run_dir, 1), \
        log(run_dir, 1)
    assert [h["exit_codes"] for h in json.loads((run_dir / "local.json").read_text())["history"]] == [[0, 0]]
