"""Safe by default on the real SLURM test cluster (2 nodes x 2 tasks), with a job file that sets no
[slurm] failure key: what the cluster breaks (kill -9, a segfault) restarts inside the allocation
from the in-memory snapshot ("auto"), the same job id, bit-equal to the uninterrupted run; the
user's exception is named with its file and line and not retried; an exception inside ddpjob is
an internal error, not retried. Each failure is caused at a chosen training forward call
(tests/trainer_plugins.py), through `ddpjob sbatch` and `ddpjob submit`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ranks import write_job
import runlogs
from runlogs import rank_crashes
from test_preemption_slurm import DATA, SLURM, TRAIN, Reference, assert_same_as_reference, ddpjob, events, job_env
from test_requeue_slurm import sbatch

CHECKPOINT = dict(every_steps=10, keep_last=3)  # snapshot_every left at "auto": on by default now


def submit(tmp_path: Path, via: str, **env: str) -> tuple[Path, str, str]:
    """(run dir, job id, its batch log) of the job submitted through `via`, without failure keys."""
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    job = write_job(tmp_path / "job.toml", slurm=SLURM, train=TRAIN, data=DATA, checkpoint=CHECKPOINT)
    assert "max_failures" not in job.read_text()
    if via == "sbatch":
        run, jid = sbatch(tmp_path, job, **env)
        return run, jid, f"batch-{jid}.out"
    run = tmp_path / "run"
    ddpjob("submit", str(job), "--backend", "slurm", "--run-dir", str(run), cwd=tmp_path, env=job_env(**env))
    jid = json.loads((run / "job.json").read_text())["job_id"]
    slurmtools.submitted.append(jid)  # conftest cancels what a failed test leaves
    return run, jid, f"{jid}_0_log.err"


def decisions(run: Path) -> list[dict[str, Any]]:
    return runlogs.decisions(events(run))


def restarted_in_place(tmp_path: Path, reference: Reference, via: str, how: str, srun_says: str) -> None:
    """Rank 2 (on n2) dies by a signal in step 24 (its 47th forward call) once every rank holds
    the probe snapshot of step 21: the same job restarts its ranks inside the allocation."""
    import slurmtools

    reference.start()
    run, jid, log = submit(tmp_path, via, DDPJOB_TEST_SIGNAL=f"2:47:0:{how}", DDPJOB_TEST_SNAP_WAIT="21")
    assert slurmtools.wait_done(jid, 900) == "COMPLETED"
    crash, finished = decisions(run)
    assert (crash["reason"], crash["step"], crash["steps_lost"]) == ("crash", 21, 2), crash
    assert (crash["verdict"], crash["action"], crash["requeued_by"]) == ("infrastructure", "restart", "in_allocation")
    assert (crash["failed_rank"], crash["failed_host"]) == (2, "n2"), crash
    assert finished["reason"] == "finished"
    assert len(slurmtools.sacct_times(jid)) == 1  # one start of the job: never requeued
    assert [s["resumed_step"] for s in events(run, "start")] == [None, 21]
    assert_same_as_reference(run, reference.run_dir())
    line = (f"ddpjob: crash verdict: infrastructure (rank 2 on n2: {srun_says}): restarting in place from the "
            "snapshot of step 21 (2 steps lost); failure 1 of max_failures = 20")
    assert line in (run / "logs" / log).read_text()


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize("via", ["sbatch", "submit"])
def test_kill_9_restarts_in_place_by_default(slurm_cluster: Any, tmp_path: Path, reference: Reference,
                                             via: str) -> None:
    restarted_in_place(tmp_path, reference, via, "kill", "Killed")


@pytest.mark.cluster
@pytest.mark.slow
def test_segfault_restarts_in_place_by_default(slurm_cluster: Any, tmp_path: Path, reference: Reference) -> None:
    restarted_in_place(tmp_path, reference, "sbatch", "segv", "Segmentation fault")


@pytest.mark.cluster
@pytest.mark.slow
def test_the_users_exception_is_named_and_not_retried(slurm_cluster: Any, tmp_path: Path) -> None:
    """Rank 1's model raises RuntimeError in step 100 (its 201st forward call): the job ends
    FAILED within 60 s of the raise after one attempt, and `status` names the file and line."""
    import slurmtools

    run, jid, log = submit(tmp_path, "submit", DDPJOB_TEST_SIGNAL="1:201:0:crash")
    assert slurmtools.wait_done(jid, 900) == "FAILED"
    [crash] = decisions(run)
    assert (crash["verdict"], crash["action"], crash["requeued"]) == ("user", "end", None), crash
    assert crash["where"].startswith("trainer_plugins.py:"), crash
    [raised] = rank_crashes(events(run), rank=1)
    (_, _, end), = slurmtools.sacct_times(jid)
    assert end - raised["time"] <= 60, (raised["time"], end)
    assert len(events(run, "start")) == 1 and "attempt 1:" not in (run / "logs" / log).read_text()
    status = ddpjob("status", str(run), cwd=tmp_path).stdout
    assert (f"verdict     user (attempt 0): not retried: rank 1's RuntimeError at {crash['where']} at step 100 "
            f"is the code's own; fix it, then `ddpjob resume {run}`") in status, status


@pytest.mark.cluster
@pytest.mark.slow
def test_an_exception_inside_ddpjob_is_an_internal_error_not_retried(slurm_cluster: Any, tmp_path: Path) -> None:
    import slurmtools

    run, jid, log = submit(tmp_path, "sbatch", DDPJOB_TEST_SIGNAL="3:19:0:internal")
    assert slurmtools.wait_done(jid, 900) == "FAILED"
    [crash] = decisions(run)
    assert (crash["verdict"], crash["action"]) == ("internal", "end"), crash
    assert "internal error of ddpjob" in (run / "logs" / log).read_text()
    assert len(events(run, "start")) == 1
