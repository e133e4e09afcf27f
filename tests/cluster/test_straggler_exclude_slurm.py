"""`[slurm] on_straggler = "exclude"` on the SLURM test cluster: a 1-node job of 2 ranks holding a
spare node (spare_nodes = 1, on_node_loss = "continue": the allocation is n1 and n2). Rank 1 is
made slow in its compute from its 31st training forward call (trainer_plugins'
DDPJOB_TEST_STRAGGLE: a sleep in its backward pass, a slow device's wait, at a step, never by a
timer; not a busy-wait, which on a loaded host waits for a core as long as it spins and gets the
host named instead of the rank). Rank 0's
watch names it; every rank stops at one step with a checkpoint, rank 0 records the decision with
the verdict line, and the batch shell's restart loop runs the ranks again inside the same
allocation without the slow rank's host: on the spare, at the same world size. The restarted
rank is slow again there (the hook keys on the rank): named, but not acted on within
straggler_exclude_every steps. The run ends bit-equal to an uninterrupted run of the same job,
spends no failure and no requeue, and `status` says which host was left out and why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ranks import Ranks, write_job
from runlogs import decisions, events
from test_preemption_slurm import CHECKPOINT, DATA, TRAIN, assert_same_as_reference, ddpjob, job_env

from ddpjob import fileio
from ddpjob.ledger import budget
from ddpjob.ledger.events import read as read_events

SLOW = {**TRAIN, "model": "trainer_plugins:straggling_cnn", "straggler_window": 20}
SLURM = dict(nodes=1, tasks_per_node=2, time="00:10:00", spare_nodes=1, on_node_loss="continue",
             on_straggler="exclude")


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize("path", ["sbatch", "submit"])
def test_a_straggler_s_host_is_left_out_and_the_run_goes_on_bit_exact_on_the_spare(
        slurm_cluster: Any, tmp_path: Path, path: str) -> None:
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    job = write_job(tmp_path / "job.toml", slurm=SLURM, train=SLOW, data=DATA, checkpoint=CHECKPOINT)
    run = tmp_path / "run"
    slow = job_env(DDPJOB_TEST_STRAGGLE="1:31:device:0.1")
    if path == "sbatch":
        ddpjob("sbatch", str(job), "-o", str(tmp_path / "job.sbatch"), "--run-dir", str(run), cwd=tmp_path)
        assert "#SBATCH --nodes=2" in (tmp_path / "job.sbatch").read_text()
        jid = slurmtools.submit(tmp_path / "job.sbatch", cwd=tmp_path, env=slow)
    else:  # submitit: the same batch shell's restart loop, NodeTask passing the ranks' RESTART on
        ddpjob("submit", str(job), "--backend", "slurm", "--run-dir", str(run), cwd=tmp_path, env=slow)
        jid = str(fileio.read_json(run / "job.json")["job_id"])
        slurmtools.submitted.append(jid)  # conftest cancels what a failed test leaves
    assert slurmtools.wait_done(jid, 900) == "COMPLETED"
    # the uninterrupted run of the same job (no rank slowed), after the job: the watch's findings
    # above are its own, not those of two more ranks on the test cluster's 2 cores
    ref = write_job(tmp_path / "ref.toml", slurm={"nodes": 1, "tasks_per_node": 2}, train=SLOW, data=DATA,
                    checkpoint=CHECKPOINT)
    reference = Ranks([str(ref), "--run-dir", str(tmp_path / "ref")], 2, tmp_path / "ref-logs", job_id=None)
    named = [e for e in events(run, "straggler") if e["cause"] != "host"]
    assert named and (named[0]["rank"], named[0]["cause"]) == (1, "compute"), named
    host = named[0]["host"]
    stops = decisions(events(run))
    assert [e["reason"] for e in stops] == ["straggler", "finished"], stops
    left = stops[0]
    assert (left["excluded_host"], left["requeued_by"], left["action"]) == (host, "in_allocation", "restart"), left
    line = (f"rank 1 on {host} is a straggler (compute, ")
    assert left["note"].startswith(line) and left["note"].endswith(
        f": restarting in place without {host} from the checkpoint of step {left['step']}"), left["note"]
    starts = events(run, "start")
    assert [(s["job_id"], s["world_size"]) for s in starts] == [(jid, 2), (jid, 2)], starts  # same job, same size
    assert starts[1]["resumed_step"] == left["step"] and starts[1]["host"] != host, starts
    # the restarted rank 1 is slow again on the spare: named, not acted on (straggler_exclude_every)
    later = [e for e in named if e["restart"] == starts[1]["restart"]]
    rank0 = ddpjob("logs", str(run), "--rank", "0", cwd=tmp_path).stdout
    assert all(e["host"] != host for e in later), named
    if later:
        assert "fewer than slurm.straggler_exclude_every = 1000 steps ago" in rank0, rank0[-3000:]
    # the batch shell's lines: the template's batch log, submitit's batch stderr
    batch = (run / "logs" / (f"batch-{jid}.out" if path == "sbatch" else f"{jid}_0_log.err")).read_text()
    assert f"ddpjob: attempt 1: ranks on 1 node(s), excluding {host}" in batch, batch[-3000:]
    assert budget.used(read_events(run), jid) == (0, 0)  # no failure, no requeue spent
    rows = slurmtools.sacct_rows(jid, "State")
    assert [r["State"] for r in rows if r["State"] != "RESIZING"] == ["COMPLETED"], rows  # never requeued
    status = ddpjob("status", str(run), cwd=tmp_path).stdout
    assert f"straggler   {host} left out at step {left['step']} (job {jid}): {line}" in status, status
    assert f"straggler at step {left['step']} (job {jid})" in status and "restarted inside the allocation" in status
    assert reference.wait(900) == [0, 0], reference.output()
    assert_same_as_reference(run, tmp_path / "ref")


@pytest.mark.cluster
@pytest.mark.slow
def test_on_straggler_requeue_brings_the_job_back_without_the_host(slurm_cluster: Any, tmp_path: Path) -> None:
    """`on_straggler = "requeue"`, no spare: the same stop at one step with a checkpoint, then
    `scontrol requeue` and ExcNodeList: SLURM starts the job again on the other node, same world
    size, bit-exact; a requeue is spent, no failure."""
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    slurm = dict(nodes=1, tasks_per_node=2, time="00:10:00", on_straggler="requeue")
    job = write_job(tmp_path / "job.toml", slurm=slurm, train=SLOW, data=DATA, checkpoint=CHECKPOINT)
    run = tmp_path / "run"
    ddpjob("sbatch", str(job), "-o", str(tmp_path / "job.sbatch"), "--run-dir", str(run), cwd=tmp_path)
    jid = slurmtools.submit(tmp_path / "job.sbatch", cwd=tmp_path,
                            env=job_env(DDPJOB_TEST_STRAGGLE="1:31:device:0.1"))
    assert slurmtools.wait_done(jid, 900) == "COMPLETED"
    ref = write_job(tmp_path / "ref.toml", slurm={"nodes": 1, "tasks_per_node": 2}, train=SLOW, data=DATA,
                    checkpoint=CHECKPOINT)
    reference = Ranks([str(ref), "--run-dir", str(tmp_path / "ref")], 2, tmp_path / "ref-logs", job_id=None)
    stops = decisions(events(run))
    assert [e["reason"] for e in stops] == ["straggler", "finished"], stops
    left = stops[0]
    host = left["excluded_host"]
    assert left["requeued_by"] == "scontrol" and left["note"].endswith(f"; job {jid} excludes {host}"), left
    starts = events(run, "start")
    assert [(s["job_id"], s["world_size"]) for s in starts] == [(jid, 2), (jid, 2)], starts
    assert starts[1]["resumed_step"] == left["step"] and starts[1]["host"] != host, starts
    assert budget.used(read_events(run), jid) == (1, 0)
    status = ddpjob("status", str(run), cwd=tmp_path).stdout
    assert f"straggler   {host} left out at step {left['step']} (job {jid}): rank 1 on {host}" in status, status
    assert reference.wait(900) == [0, 0], reference.output()
    assert_same_as_reference(run, tmp_path / "ref")
