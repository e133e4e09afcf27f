"""The scripts users already have, unported, under `[train] command` on the local backend, with a
job file that sets nothing but the command and the ranks: tests/command_scripts/userstyle/
multinode.py, written in the style of the PyTorch DDP tutorial's script (it imports its sibling
module, logs nothing to ddpjob, has no SIGTERM handler, rank 0 saves a snapshot every 3 epochs to
a path relative to its working directory, plainly, and resumes with range(epochs_run, ...)).

- preempted (SIGUSR2 to the supervisor while rank 1 pauses after epoch 4): it dies of SIGTERM,
  the stop is requeued, the next attempt resumes from its own snapshot (epoch 3) and COMPLETES;
  status says what the program did and no "None";
- with Lightning's habit (a handler that saves and exits 0) and `ddpjob stop`: STOPPED, never
  COMPLETED; `ddpjob resume` finishes it from what the handler saved;
- killed twice, with a snapshot of its own written in between: two restarts in place, no crash
  loop, COMPLETED;
- its own bug on rank 1 at the last epoch, while rank 0 finishes with exit 0: FAILED with the
  verdict naming the exception and its line, never COMPLETED.
Every interruption is caused at an epoch's end (testhook.py), never by a timer.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from clirun import TESTS, ddpjob, job_env, wait_for, without_job_env
from ranks import write_job
import runlogs
from runlogs import events

from ddpjob.node import preemption

SCRIPTS = TESTS / "command_scripts" / "userstyle"
EPOCHS = 9


def submit(tmp_path: Path, *flags: str, wait: bool = False, **env: str) -> tuple[Path, int, str]:
    """The script copied into a folder of its own (the user's checkout: its snapshot lands there)
    and submitted from it; the run dir, the supervisor's pid and what submit printed (all of the
    run's stream with `wait`)."""
    work = tmp_path / "work"
    shutil.copytree(SCRIPTS, work)
    job = write_job(work / "job.toml", slurm=dict(nodes=1, tasks_per_node=2),
                    train=dict(command=["python", "multinode.py", str(EPOCHS), "3", *flags]))
    run_dir = tmp_path / "run"
    out = ddpjob("submit", str(job), "--backend", "local", "--run-dir", str(run_dir), *(["--wait"] if wait else []),
                 cwd=work, env=user_env(**env), timeout=600)
    assert out.returncode == 0 or wait, out.stdout + out.stderr
    return run_dir, json.loads((run_dir / "job.json").read_text())["pid"], out.stdout + out.stderr


def user_env(**extra: str) -> dict[str, str]:
    """The user's environment, as with their venv activated (`python` is the one with torch):
    nothing of the tests' own PYTHONPATH."""
    env = {k: v for k, v in without_job_env(job_env(**extra)).items() if k != "PYTHONPATH"}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return env


def local(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "local.json"
    return json.loads(path.read_text()) if path.exists() else {}


def ended(run_dir: Path, states: tuple[str, ...] = ("COMPLETED", "FAILED", "STOPPED")) -> str:
    return wait_for(lambda: local(run_dir).get("state") in states and local(run_dir)["state"], 300, "the run to end")


def log(run_dir: Path, rank: int) -> str:
    path = run_dir / "logs" / f"rank-{rank}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def decisions(run_dir: Path) -> list[dict[str, Any]]:
    return runlogs.decisions(events(run_dir))


def said(run_dir: Path, tmp_path: Path) -> str:
    """What status, ls and ls --json print for the run: never "None", never "step 0"."""
    out = "".join(ddpjob(*argv, cwd=tmp_path, check=True).stdout for argv in (
        ("status", str(run_dir)), ("status", str(run_dir), "--json"), ("ls", "--runs-root", str(tmp_path))))
    assert "None" not in out.replace("null", "") and "step 0" not in out, out
    return out


def test_a_preempted_script_without_a_handler_resumes_from_its_own_snapshot(tmp_path: Path) -> None:
    run_dir, sup, _ = submit(tmp_path, USERSTYLE_AT="1:4:0:pause")
    wait_for(lambda: "paused at epoch 4" in log(run_dir, 1), 180, "rank 1 to pause")
    os.kill(sup, signal.SIGUSR2)
    assert ended(run_dir) == "COMPLETED", log(run_dir, 0) + log(run_dir, 1)
    # its sibling module imported, its snapshot in its own folder, resumed by its own code
    assert [h["exit_codes"] for h in local(run_dir)["history"]] == [[3, 3], [0, 0]]
    assert "Resuming training from snapshot at Epoch 3" in log(run_dir, 0), log(run_dir, 0)
    assert "ModuleNotFoundError" not in log(run_dir, 0) + log(run_dir, 1)
    stop, finished = decisions(run_dir)
    assert (stop["reason"], stop["program"], finished["reason"]) == ("time_limit", "died", "finished"), stop
    assert "had no handler: it died of SIGTERM; what it saved last is what resumes" in log(run_dir, 0)
    assert (tmp_path / "work" / "snapshot.pt").is_file() and (run_dir / "COMPLETED").is_file()
    text = said(run_dir, tmp_path)
    assert "no handler" in text and "goodput" in text, text
    row = json.loads(ddpjob("ls", "--runs-root", str(tmp_path), "--json", cwd=tmp_path, check=True).stdout.splitlines()[0])
    # a program that logs no steps: its time is training as far as ddpjob can tell, not start-up
    assert row["goodput"]["seconds"]["productive"] > row["goodput"]["seconds"]["start-up"], row["goodput"]


def test_lightnings_habit_save_and_exit_0_is_a_stop_never_completed(tmp_path: Path) -> None:
    """Rank 1's handler exits 0; rank 0's saves and exits 0 too, and then its interpreter's end
    aborts as torch's teardown now and then does (this project's CI on real SLURM: SIGABRT after
    "Training snapshot saved", then read as a crash). Both are the stop that was asked for. Rank
    0's abort is armed at epoch 3's end: before the collectives of epoch 4 that rank 1 pauses after."""
    run_dir, _, _ = submit(tmp_path, "--on_sigterm", "save_exit0", USERSTYLE_AT="1:4:0:pause,0:3:0:abortatexit")
    wait_for(lambda: "paused at epoch 4" in log(run_dir, 1), 180, "rank 1 to pause")
    out = ddpjob("stop", str(run_dir), cwd=tmp_path, check=True).stdout
    assert "checkpoint at their next step" not in out and "SIGTERM" in out, out
    assert ended(run_dir) == "STOPPED", log(run_dir, 0) + log(run_dir, 1)
    assert not (run_dir / "COMPLETED").exists()
    [stop] = decisions(run_dir)
    assert (stop["reason"], stop["program"]) == ("user_stop", "exited"), stop
    assert "terminate called without an active exception" in log(run_dir, 0), log(run_dir, 0)
    assert "aborted in torch's teardown" in log(run_dir, 0) and "read as its exit" in log(run_dir, 0), log(run_dir, 0)
    assert local(run_dir)["history"][0]["exit_codes"] == [3, 3], local(run_dir)
    assert "exited by itself after the stop signal" in said(run_dir, tmp_path)
    done = ddpjob("resume", str(run_dir), "--wait", cwd=tmp_path / "work",
                  env=user_env(), timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Resuming training from snapshot at Epoch" in log(run_dir, 0) and (run_dir / "COMPLETED").is_file()


def test_two_kills_with_progress_between_restart_in_place(tmp_path: Path) -> None:
    """Killed after epoch 4 (snapshot of epoch 3), then again after epoch 7 of the next attempt,
    with its snapshot of epoch 6 written in between: its output moved on, so no crash loop."""
    run_dir, _, stream = submit(tmp_path, wait=True, USERSTYLE_AT="1:4:0:kill,1:7:1:kill")
    assert ended(run_dir) == "COMPLETED", log(run_dir, 0) + log(run_dir, 1)
    # torch's own teardown abort on every rank at an attempt's end (this project's CI once): a
    # restart of its own, left out of the count of the kills
    teardowns = [d for d in decisions(run_dir) if runlogs.torch_teardown(d)]
    # `--wait` streams rank 0's log and each verdict, not only the survivor's traceback
    assert stream.count("ddpjob: crash verdict (infrastructure, attempt") == 2 + len(teardowns), stream
    crashes = [d for d in decisions(run_dir) if d["reason"] == "crash" and not runlogs.torch_teardown(d)]
    assert [(d["verdict"], d["action"]) for d in crashes] == [("infrastructure", "restart")] * 2, crashes
    assert [d["failed_how"] for d in crashes] == ["the command was killed by SIGKILL"] * 2, crashes
    assert "OOM" not in json.dumps(crashes) and "batch_size" not in json.dumps(crashes)
    assert "Resuming training from snapshot at Epoch 6" in log(run_dir, 0)
    assert f"restarts    {2 + len(teardowns)}" in said(run_dir, tmp_path)


def test_torchs_teardown_abort_on_one_rank_after_the_last_epoch_is_exit_0(tmp_path: Path) -> None:
    """The script's code ends (destroy_process_group, "Training finished"), then rank 1's
    interpreter aborts in torch's teardown, as 4 of 20 runs of it did under torchrun with torch
    2.14.1; rank 0 exits 0 by itself (made to: its interpreter's end skipped). COMPLETED at once:
    no crash, no second attempt that would train again."""
    last = EPOCHS - 1
    run_dir, _, stream = submit(tmp_path, wait=True, USERSTYLE_AT=f"1:{last}:0:abortatexit,0:{last}:0:exitatexit")
    assert ended(run_dir) == "COMPLETED", log(run_dir, 0) + log(run_dir, 1)
    assert [d["reason"] for d in decisions(run_dir)] == ["finished"], decisions(run_dir)
    ends = [e for e in events(run_dir) if e["event"] == "rank_end"]
    assert {e["rank"]: (e["status"], e.get("teardown", False)) for e in ends} == {0: (0, False), 1: (0, True)}, ends
    assert "terminate called without an active exception" in log(run_dir, 1), log(run_dir, 1)
    assert "read as exit 0 where a peer's program exited 0 by itself" in log(run_dir, 1), log(run_dir, 1)
    assert local(run_dir)["history"] == [{**local(run_dir)["history"][0], "exit_codes": [0, 0]}], local(run_dir)
    assert "crash verdict" not in stream and "Training finished" in stream, stream


def test_torchs_teardown_abort_on_every_rank_restarts_in_place_from_the_scripts_snapshot(tmp_path: Path) -> None:
    """Every rank's interpreter aborts in torch's teardown after the last epoch: no rank's program
    exited 0 to say it finished, so a crash of the cluster's class, restarted in place; the
    script resumes from its snapshot of epoch 8, trains nothing, and the run is COMPLETED."""
    last = EPOCHS - 1
    run_dir, _, stream = submit(tmp_path, wait=True, USERSTYLE_AT=f"*:{last}:0:abortatexit")
    assert ended(run_dir) == "COMPLETED", log(run_dir, 0) + log(run_dir, 1)
    first, *more = [d for d in decisions(run_dir) if d["reason"] == "crash"]
    assert (first["verdict"], first["action"], first["restart"]) == ("infrastructure", "restart", 0), first
    assert "in torch's teardown" in first["failed_how"] and "on every rank" in first["failed_how"], first
    assert all(runlogs.torch_teardown(d) for d in more), more  # torch's own, unasked (the test above)
    assert stream.count("ddpjob: crash verdict (infrastructure, attempt") == 1 + len(more), stream
    assert "Resuming training from snapshot at Epoch 9" in log(run_dir, 0), log(run_dir, 0)
    assert f"restarts    {1 + len(more)}" in said(run_dir, tmp_path)


def test_a_bug_on_one_rank_fails_the_run_though_rank_0_exits_0(tmp_path: Path) -> None:
    run_dir, _, _ = submit(tmp_path, USERSTYLE_AT=f"1:{EPOCHS - 1}:0:raise")
    assert ended(run_dir) == "FAILED", log(run_dir, 0) + log(run_dir, 1)
    assert not (run_dir / "COMPLETED").exists()
    crash = [d for d in decisions(run_dir) if d["reason"] == "crash"]
    assert len(crash) == 1 and crash[0]["verdict"] == "user" and crash[0]["action"] == "end", crash
    assert "ValueError at testhook.py:" in crash[0]["line"], crash
    said(run_dir, tmp_path)


def test_a_stop_that_comes_while_the_rank_starts_is_not_lost(tmp_path: Path) -> None:
    """`ddpjob run` of a one-rank job started with SIGUSR2 already pending (its launcher held the
    stop signals back while Python started, as the local supervisor does): the flag takes it as
    the handlers go in, the program gets SIGTERM at once, and the attempt is a stop, never a run
    that trains on without hearing of it."""
    work = tmp_path / "work"
    shutil.copytree(SCRIPTS, work)
    write_job(work / "job.toml", train=dict(command=["python", "multinode.py", str(EPOCHS), "3"]))
    run_dir = tmp_path / "run"

    def signalled_before_exec() -> None:
        preemption.block_stop_signals()
        os.kill(os.getpid(), signal.SIGUSR2)  # pending: the exec'd rank has it before any handler

    proc = subprocess.run([sys.executable, "-m", "ddpjob", "run", "job.toml", "--run-dir", str(run_dir)], cwd=work,
                          env=user_env(), preexec_fn=signalled_before_exec, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "Training finished" not in proc.stdout and "Epoch 1 " not in proc.stdout, proc.stdout
    [stop] = decisions(run_dir)
    assert (stop["reason"], stop["program"]) == ("time_limit", "died"), stop
