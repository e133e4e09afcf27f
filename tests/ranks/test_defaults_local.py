"""Safe by default, on the local backend: a job file with no [slurm] failure keys. What the cluster
breaks (kill -9, a segfault) is restarted in place from the in-memory snapshot and ends bit-equal
to the uninterrupted run; the user's exception is named with its file and line and not retried;
an exception inside ddpjob is an internal error, not retried. Each failure is caused at a chosen
training forward call (tests/trainer_plugins.py), never by a timer; the same four on the real
cluster are in tests/cluster/test_defaults_slurm.py."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from clirun import ddpjob
from ranks import write_job
import runlogs
from runlogs import events
from test_failure import DATA, TRAIN, assert_same_as_reference, reference, submit_wait  # noqa: F401  (fixture)

CHECKPOINT = dict(every_steps=10, keep_last=3)  # no snapshot_every: "auto", on by default now


def submit(tmp_path: Path, **env: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """`ddpjob submit --backend local --wait` of a job without [slurm] failure keys."""
    job = write_job(tmp_path / "job.toml", slurm=dict(nodes=1, tasks_per_node=2), train=TRAIN, data=DATA,
                    checkpoint=CHECKPOINT)
    text = job.read_text()
    assert "max_failures" not in text and "retry_user_errors" not in text, text
    return submit_wait(tmp_path, job, **env)


def decisions(run_dir: Path) -> list[dict[str, Any]]:
    return runlogs.decisions(events(run_dir))


def supervisor_log(run_dir: Path) -> str:
    return (run_dir / "logs" / "supervisor.log").read_text()


def restarted_in_place(tmp_path: Path, reference: Path, how: str, died: str) -> None:  # noqa: F811
    """Rank 1 dies by a signal in step 24 (its 47th forward call), once every rank holds the probe
    snapshot of step 21: the supervisor restarts the ranks (no setting asked for it), they resume
    from the snapshot, 2 steps are lost, and the run ends bit-equal to the uninterrupted one."""
    run_dir, out = submit(tmp_path, DDPJOB_TEST_SIGNAL=f"1:47:0:{how}", DDPJOB_TEST_SNAP_WAIT="21")
    assert out.returncode == 0, out.stdout + out.stderr
    crash, finished = decisions(run_dir)
    assert (crash["reason"], crash["step"], crash["steps_lost"]) == ("crash", 21, 2), crash
    assert (crash["verdict"], crash["action"], crash["requeued_by"]) == ("infrastructure", "restart", "supervisor")
    assert (crash["failed_rank"], crash["failed_how"]) == (1, died), crash
    assert finished["reason"] == "finished"
    assert [s["resumed_step"] for s in events(run_dir, "start")] == [None, 21]
    assert_same_as_reference(run_dir, reference)
    line = (f"ddpjob: crash verdict: infrastructure (rank 1 on {socket.gethostname()}: {died}): restarting in "
            "place from the snapshot of step 21 (2 steps lost); failure 1 of max_failures = 20")
    assert line in supervisor_log(run_dir), supervisor_log(run_dir)
    status = ddpjob("status", str(run_dir), cwd=tmp_path).stdout
    assert "COMPLETED" in status and f"rank 1 on {socket.gethostname()}" in status, status


@pytest.mark.slow
def test_kill_9_restarts_in_place_by_default(tmp_path: Path, reference: Path) -> None:  # noqa: F811
    restarted_in_place(tmp_path, reference, "kill", "killed by SIGKILL")


@pytest.mark.slow
def test_segfault_restarts_in_place_by_default(tmp_path: Path, reference: Path) -> None:  # noqa: F811
    restarted_in_place(tmp_path, reference, "segv", "killed by SIGSEGV")


@pytest.mark.slow
def test_the_users_exception_is_named_and_not_retried(tmp_path: Path) -> None:
    """Rank 0's model raises RuntimeError in step 10 (its 19th forward call): one attempt, FAILED,
    and the verdict names the exception, the user's file and line, and says it was not retried."""
    run_dir, out = submit(tmp_path, DDPJOB_TEST_SIGNAL="0:19:0:crash")
    assert out.returncode == 1, out.stdout + out.stderr
    assert json.loads((run_dir / "local.json").read_text())["state"] == "FAILED"
    assert len(events(run_dir, "local_start")) == 1  # no second attempt
    [crash] = decisions(run_dir)
    assert (crash["verdict"], crash["action"], crash["requeued"]) == ("user", "end", None), crash
    assert crash["where"].startswith("trainer_plugins.py:"), crash
    verdict = (f"rank 0's RuntimeError at {crash['where']} at step 9 is the code's own; fix it, then "
               f"`ddpjob resume {run_dir}`")
    assert verdict in supervisor_log(run_dir) and verdict in crash["note"], crash
    status = ddpjob("status", str(run_dir), cwd=tmp_path).stdout
    assert "FAILED" in status and f"verdict     user (attempt 0): not retried: {verdict}" in status, status


@pytest.mark.slow
def test_an_exception_inside_ddpjob_is_an_internal_error_not_retried(tmp_path: Path) -> None:
    """A hook breaks ddpjob's per-step decision in step 10: the TypeError is raised in ddpjob's
    own frame, the verdict says internal error, and the run ends FAILED after one attempt."""
    run_dir, out = submit(tmp_path, DDPJOB_TEST_SIGNAL="1:19:0:internal")
    assert out.returncode == 1, out.stdout + out.stderr
    assert len(events(run_dir, "local_start")) == 1
    [crash] = decisions(run_dir)
    assert (crash["verdict"], crash["action"]) == ("internal", "end"), crash
    assert "is an internal error of ddpjob; please report it" in crash["note"], crash
    assert "internal error" in (run_dir / "logs" / "rank-1.log").read_text()
