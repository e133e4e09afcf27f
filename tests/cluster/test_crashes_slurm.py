"""Crashes inside one allocation on the real SLURM test cluster (2 nodes x 2 tasks): a host whose
rank dies twice is excluded and the job finishes on the other node at the smaller world size;
a crash that comes back at the same step on every host ends the job FAILED after
slurm.max_no_progress attempts in a row, with one line. Each failure is caused at a chosen step
(tests/example_slurm_hooks.py's actions, in every incarnation), never by timing."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from clirun import job_env
from ranks import write_job
from runlogs import decisions
from test_preemption_slurm import CHECKPOINT, DATA, SLURM, TRAIN, ddpjob, events, train_records
from test_requeue_slurm import sbatch


def crash_job(tmp_path: Path, actions: str, **slurm: Any) -> tuple[Path, str]:
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    (tmp_path / "actions").write_text(actions)
    job = write_job(tmp_path / "job.toml", train={**TRAIN, "max_steps": 60}, data=DATA, checkpoint=CHECKPOINT,
                    slurm={**SLURM, **slurm})
    return sbatch(tmp_path, job, DDPJOB_TEST_ACTIONS=str(tmp_path / "actions"))


@pytest.mark.cluster
@pytest.mark.slow
def test_a_host_whose_rank_dies_twice_is_excluded_and_the_job_finishes_without_it(
        slurm_cluster: Any, tmp_path: Path) -> None:
    import slurmtools

    # rank 2 (on n2) is SIGKILLed when step 34 is handed out, in every incarnation: once after
    # the checkpoint at 30, and again after resuming from it. n2 then has 2 host failures.
    run, jid = crash_job(tmp_path, "* 34 2 die\n", max_failures=3)
    assert slurmtools.wait_done(jid, 900) == "COMPLETED"
    stops = decisions(events(run))
    assert [e["reason"] for e in stops] == ["crash", "crash", "finished"], stops
    for crash in stops[:2]:
        assert (crash["failed_rank"], crash["failed_host"], crash["host_fault"]) == (2, "n2", True), crash
        assert crash["requeued_by"] == "in_allocation" and crash["step"] == 30, crash
    assert slurmtools.job_info(jid)["Restarts"] == "0"  # the same job, never through the queue
    starts = events(run, "start")
    assert [(s["job_id"], s["world_size"], s["resumed_step"]) for s in starts] == [
        (jid, 4, None), (jid, 4, 30), (jid, 2, 30)], starts
    # the last attempt ran on n1 alone, every step once from 30 on, to the end
    last = [r["step"] for r in train_records(run) if r["step"] > 30]
    assert last[-1] == 60 and sorted(set(last)) == list(range(31, 61)), last
    batch = (run / "logs" / f"batch-{jid}.out").read_text()
    assert "ddpjob: attempt 2: ranks on 1 node(s), excluding n2" in batch, batch
    status = ddpjob("status", str(run), cwd=tmp_path).stdout
    # the job has ended: its quarantine of n2 held for its restarts only, none is "excluded" now
    assert "n2 2 failures" in status and "excluded" not in status and "rank 2 on n2: Killed" in status, status


@pytest.mark.cluster
@pytest.mark.slow
def test_a_crash_at_the_same_step_on_every_host_ends_the_job_after_max_no_progress(
        slurm_cluster: Any, tmp_path: Path) -> None:
    import slurmtools

    # ranks 0 (n1) and 2 (n2) raise when step 15 is handed out, in every incarnation. The first
    # attempt got from 0 to the checkpoint at 10; each later one dies before its next checkpoint.
    # The user's exception is retried only because retry_user_errors says so (not by default).
    run, jid = crash_job(tmp_path, "* 15 0 crash\n* 15 2 crash\n", max_failures=10, max_no_progress=3,
                         retry_user_errors=True)
    assert slurmtools.wait_done(jid, 900) == "FAILED"
    stops = decisions(events(run))
    assert [(e["reason"], e["step"], e["no_progress"]) for e in stops] == [
        ("crash", 10, 0), ("crash", 10, 1), ("crash", 10, 2), ("crash", 10, 3)], stops
    assert [e["requeued"] for e in stops] == [True, True, True, None]  # 7 of max_failures left unused
    assert all(e["host_fault"] is False for e in stops)  # the code's own exception: no host to blame
    assert slurmtools.job_info(jid)["Restarts"] == "0"
    assert len({s["job_id"] for s in events(run, "start")}) == 1
    batch = (run / "logs" / f"batch-{jid}.out").read_text()
    lines = [line for line in batch.splitlines() if line.startswith("ddpjob: error: crash loop")]
    assert len(lines) == 1, batch
    assert re.fullmatch(r"ddpjob: error: crash loop: 3 attempts in a row crashed without getting past the "
                        r"checkpoint at step 10, the last after step 1[45] \(rank [02]'s RuntimeError at "
                        r"example_slurm_hooks.py:[0-9]+ at step 1[45]\); "
                        r"not retrying \(slurm.max_no_progress = 3\)\. Hint: the rank logs in \S+/logs say why; "
                        r"fix it and `ddpjob resume \S+`", lines[0]), lines[0]
    status = ddpjob("status", str(run), cwd=tmp_path).stdout
    assert "crash loop: 3 attempts in a row" in status and "excluded" not in status, status


@pytest.mark.cluster
@pytest.mark.slow
def test_a_port_another_program_holds_on_rank_0_s_node_is_the_node_s_fault_and_retried_on_another(
        slurm_cluster: Any, tmp_path: Path) -> None:
    """MASTER_PORT derived from the job id, taken on rank 0's node by another program (job 2001
    once got 17001, a slurmd's): an infrastructure crash, not the user's, and the restart in
    place derives another port and finishes."""
    import slurmtools

    from ddpjob.node.cluster import port_for_job

    slurmtools.cluster_free(timeout=300)
    job = write_job(tmp_path / "job.toml", train={**TRAIN, "max_steps": 20}, data=DATA, checkpoint=CHECKPOINT,
                    slurm={**SLURM, "max_failures": 2})
    run = tmp_path / "run"
    ddpjob("sbatch", str(job), "-o", str(tmp_path / "job.sbatch"), "--run-dir", str(run), cwd=tmp_path)
    jid = slurmtools.submit(tmp_path / "job.sbatch", "--hold", cwd=tmp_path, env=job_env())
    assert slurmtools.done_with_port_held(jid, port_for_job(jid), 600) == "COMPLETED"
    crash, done = decisions(events(run))
    assert (crash["reason"], crash["verdict"], crash["requeued_by"]) == ("crash", "infrastructure", "in_allocation"), crash
    assert done["reason"] == "finished", done
    assert [(s["job_id"], s["restart"]) for s in events(run, "start")] == [(jid, 1)]
    assert train_records(run)[-1]["step"] == 20
    rank0 = (run / "logs" / "rank-0.log").read_text()  # the restart's rank 0 listened on the next port
    assert f"via slurm, master n1:{port_for_job(jid, 1)}," in rank0, rank0
    assert f"could not listen on port {port_for_job(jid)}, which ddpjob chose" in crash["failed_how"], crash
    status = ddpjob("status", str(run), cwd=tmp_path).stdout
    assert "verdict     infrastructure (attempt 0): restarting in place" in status, status
