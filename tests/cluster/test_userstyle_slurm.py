"""The scripts users already have, unported, under `[train] command` on the real SLURM test
cluster, with a job file that sets nothing but the command (the node count on the command line):
tests/command_scripts/userstyle/multinode.py, in the style of the PyTorch DDP tutorial's script
(it imports its sibling module, logs nothing to ddpjob, has no SIGTERM handler; rank 0 saves a
plain snapshot every 3 epochs relative to its working directory and resumes with
range(epochs_run, ...)), on 2 nodes x 1 task.

- `ddpjob sbatch` + real sbatch: preempted by a `high` job while rank 1 pauses after epoch 4; it
  dies of SIGTERM, rank 0 asks SLURM and requeues; the next start resumes from its own snapshot
  (epoch 3) and COMPLETES; status says what the program did, with no "None";
- `ddpjob submit` (submitit): rank 1 killed after epoch 4, then again after epoch 7 of the
  restart, its snapshot of epoch 6 written in between: restarted in place twice, no crash loop,
  COMPLETED;
- `ddpjob sbatch`, Lightning's habit (a handler that saves and exits 0): `ddpjob stop` ends it
  STOPPED, `ddpjob resume` finishes it;
- `ddpjob sbatch`, torch's teardown abort after the last epoch: on rank 1 alone (rank 0 exits 0)
  COMPLETED in one attempt; on every rank, a restart in place that trains nothing, COMPLETED;
- `ddpjob sbatch`, its own bug on rank 1 at the last epoch while rank 0 exits 0: FAILED, the
  verdict naming the exception and its line, never COMPLETED.
Every interruption is caused at an epoch's end (testhook.py), never by a timer.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

import clirun
from clirun import TESTS, wait_for, without_job_env
from ranks import write_job
import runlogs
from runlogs import events
from test_preemption_slurm import preempt, release

pytestmark = pytest.mark.cluster

SCRIPTS = TESTS / "command_scripts" / "userstyle"
EPOCHS = 9


def user_env(**extra: str) -> dict[str, str]:
    """The user's shell: their venv's python first on PATH, nothing of the tests' PYTHONPATH."""
    env = {k: v for k, v in without_job_env().items() if k != "PYTHONPATH"}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def checkout(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    shutil.copytree(SCRIPTS, work)
    write_job(work / "job.toml", train=dict(command=["python", "multinode.py", str(EPOCHS), "3"]))
    return work


def ddpjob(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> clirun.subprocess.CompletedProcess:
    return clirun.ddpjob(*argv, cwd=cwd, env=env or user_env(), timeout=180, check=True)


def rank_log(run: Path, rank: int) -> str:
    paths = [run / "logs" / f"rank-{rank}.log", *sorted((run / "logs").glob(f"*_{rank}_log.*"))]
    return "".join(p.read_text(errors="replace") for p in paths if p.is_file())


def decisions(run: Path) -> list[dict[str, Any]]:
    return runlogs.stops(events(run))


def status_said(run: Path, cwd: Path) -> str:
    text = ddpjob("status", str(run), cwd=cwd).stdout + ddpjob("status", str(run), "--json", cwd=cwd).stdout
    assert "None" not in text and "step 0" not in text, text
    return text


def test_sbatch_preempted_script_without_a_handler_resumes_from_its_own_snapshot(
        slurm_cluster: Any, tmp_path: Path) -> None:
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    work, run = checkout(tmp_path), tmp_path / "run"
    ddpjob("sbatch", "job.toml", "--nodes", "2", "-o", str(tmp_path / "job.sbatch"), "--run-dir", str(run), cwd=work)
    jid = slurmtools.submit(tmp_path / "job.sbatch", cwd=work, env=user_env(USERSTYLE_AT="1:4:0:pause"))
    wait_for(lambda: "paused at epoch 4" in rank_log(run, 1), 300, "rank 1 to pause",
             alive=lambda: slurmtools.active(jid), whose=f"job {jid}")
    high = preempt(jid, tmp_path, "high")
    stop = wait_for(lambda: decisions(run), 240, "the preemption's stop")[0]
    assert (stop["reason"], stop["requeued"], stop["program"]) == ("preemption", True, "died"), stop
    slurmtools.wait_state(jid, {"PENDING"}, timeout=90)
    assert slurmtools.wait_done(high, timeout=180) == "COMPLETED"
    release(jid)
    assert slurmtools.wait_done(jid, 600) == "COMPLETED", rank_log(run, 0) + rank_log(run, 1)
    assert (run / "COMPLETED").is_file() and (work / "snapshot.pt").is_file()
    log0 = rank_log(run, 0)
    assert "Resuming training from snapshot at Epoch 3" in log0 and "ModuleNotFoundError" not in log0, log0
    assert "had no handler: it died of SIGTERM" in log0, log0
    text = status_said(run, work)
    assert "COMPLETED" in text and "no handler" in text, text
    row = json.loads(ddpjob("ls", "--runs-root", str(tmp_path), "--json", cwd=work).stdout.splitlines()[0])
    assert row["goodput"]["seconds"]["productive"] > row["goodput"]["seconds"]["start-up"], row["goodput"]


def test_submit_two_kills_with_progress_between_restart_in_place(slurm_cluster: Any, tmp_path: Path) -> None:
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    work, run = checkout(tmp_path), tmp_path / "run"
    ddpjob("submit", "job.toml", "--nodes", "2", "--run-dir", str(run), cwd=work,
           env=user_env(USERSTYLE_AT="1:4:0:kill,1:7:1:kill"))
    jid = json.loads((run / "job.json").read_text())["job_id"]
    assert slurmtools.wait_done(jid, 600) == "COMPLETED", rank_log(run, 0) + rank_log(run, 1)
    # torch's own teardown abort on every rank at an attempt's end: a restart of its own, left out
    crashes = [d for d in decisions(run) if not runlogs.torch_teardown(d)]
    assert [(d["reason"], d["verdict"], d["action"]) for d in crashes] == [
        ("crash", "infrastructure", "restart")] * 2, crashes
    assert "OOM" not in json.dumps(crashes), crashes
    assert "Resuming training from snapshot at Epoch 6" in rank_log(run, 0)
    status_said(run, work)


def test_sbatch_stop_and_resume_of_a_script_that_saves_and_exits_0(slurm_cluster: Any, tmp_path: Path) -> None:
    """Lightning's habit (a SIGTERM handler that saves and exits 0): `ddpjob stop` ends the job
    STOPPED, never COMPLETED; `ddpjob resume` finishes it from what the handler saved. Rank 0's
    interpreter aborts at its end as torch's teardown now and then does (this project's CI saw
    it here, read as a crash): armed at epoch 3, before the epoch rank 1 pauses after."""
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    work, run = checkout(tmp_path), tmp_path / "run"
    ddpjob("sbatch", "job.toml", "--nodes", "2", "-o", str(tmp_path / "job.sbatch"), "--run-dir", str(run),
           "--", "python", "multinode.py", str(EPOCHS), "3", "--on_sigterm", "save_exit0", cwd=work)
    jid = slurmtools.submit(tmp_path / "job.sbatch", cwd=work, env=user_env(USERSTYLE_AT="1:4:0:pause,0:3:0:abortatexit"))
    wait_for(lambda: "paused at epoch 4" in rank_log(run, 1), 300, "rank 1 to pause",
             alive=lambda: slurmtools.active(jid), whose=f"job {jid}")
    said = ddpjob("stop", str(run), cwd=work).stdout
    assert "SIGTERM" in said and "checkpoint at their next step" not in said, said
    slurmtools.wait_done(jid, 300)
    assert not (run / "COMPLETED").exists(), rank_log(run, 0) + rank_log(run, 1)
    # rank 1's program leaves first (its handler exits 0 at once, rank 0's saves first): srun
    # ends the step (--kill-on-bad-exit), so what rank 0 records of its own program may be its
    # death by that SIGTERM; the stop is `ddpjob stop`'s all the same, decided by the signal first
    [stop] = decisions(run)
    assert stop["reason"] == "user_stop" and stop["program"] in ("exited", "died"), stop
    assert "STOPPED" in status_said(run, work)
    ddpjob("resume", str(run), cwd=work)
    jid2 = json.loads((run / "job.json").read_text())["job_id"]
    assert slurmtools.wait_done(jid2, 600) == "COMPLETED", rank_log(run, 0) + rank_log(run, 1)
    assert "Resuming training from snapshot at Epoch" in rank_log(run, 0) and (run / "COMPLETED").is_file()


@pytest.mark.parametrize("who", ["rank 1", "every rank"])
def test_sbatch_torchs_teardown_abort_after_the_last_epoch(slurm_cluster: Any, tmp_path: Path, who: str) -> None:
    """The script's code ends, then the interpreter aborts in torch's teardown (SIGABRT after
    libstdc++'s line; 4 of 20 torchrun runs of it with torch 2.14.1). On rank 1 alone, rank 0
    exiting 0 by itself: COMPLETED in the one attempt. On every rank: nothing says it finished,
    a restart in place that resumes from the snapshot of epoch 8, trains nothing, COMPLETED."""
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    work, run = checkout(tmp_path), tmp_path / "run"
    last = EPOCHS - 1
    at = f"1:{last}:0:abortatexit,0:{last}:0:exitatexit" if who == "rank 1" else f"*:{last}:0:abortatexit"
    ddpjob("sbatch", "job.toml", "--nodes", "2", "-o", str(tmp_path / "job.sbatch"), "--run-dir", str(run), cwd=work)
    jid = slurmtools.submit(tmp_path / "job.sbatch", cwd=work, env=user_env(USERSTYLE_AT=at))
    assert slurmtools.wait_done(jid, 600) == "COMPLETED", rank_log(run, 0) + rank_log(run, 1)
    assert "terminate called without an active exception" in rank_log(run, 1), rank_log(run, 1)
    crashes = [d for d in decisions(run) if d["reason"] == "crash"]
    if who == "rank 1":
        assert crashes == [] and "read as exit 0 where a peer's program exited 0" in rank_log(run, 1), crashes
        assert "Resuming training from snapshot" not in rank_log(run, 0), rank_log(run, 0)
    else:
        first, *more = crashes
        assert (first["verdict"], first["action"], first["restart"]) == ("infrastructure", "restart", 0), first
        assert "in torch's teardown" in json.dumps(first) and all(runlogs.torch_teardown(d) for d in more), crashes
        assert "Resuming training from snapshot at Epoch 9" in rank_log(run, 0), rank_log(run, 0)
    status_said(run, work)


def test_sbatch_a_bug_on_one_rank_fails_the_job_though_rank_0_exits_0(slurm_cluster: Any, tmp_path: Path) -> None:
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    work, run = checkout(tmp_path), tmp_path / "run"
    ddpjob("sbatch", "job.toml", "--nodes", "2", "-o", str(tmp_path / "job.sbatch"), "--run-dir", str(run), cwd=work)
    jid = slurmtools.submit(tmp_path / "job.sbatch", cwd=work, env=user_env(USERSTYLE_AT=f"1:{EPOCHS - 1}:0:raise"))
    assert slurmtools.wait_done(jid, 600) == "FAILED", rank_log(run, 0) + rank_log(run, 1)
    assert not (run / "COMPLETED").exists()
    crash = [d for d in decisions(run) if d["reason"] == "crash"]
    assert len(crash) == 1 and (crash[0]["verdict"], crash[0]["action"]) == ("user", "end"), crash
    assert "ValueError at testhook.py:" in crash[0]["line"], crash
    status_said(run, work)
