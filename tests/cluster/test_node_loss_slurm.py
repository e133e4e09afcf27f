"""A node lost from the allocation with `[slurm] on_node_loss = "continue"` (sbatch --no-kill):
the job keeps its allocation and its job id, and the ranks run again inside it on the nodes
left. With a spare node (`spare_nodes = 1`, 3 nodes for a 2-node job) the spare takes the lost
node's place, its ranks resume from the survivors' in-memory snapshot (the replicas and the copies
of their RNG files that n1's snapshots keep: store/peers.py), and the run ends bit-equal to the
uninterrupted one; without one the survivor goes
on alone at the smaller world size, every sample once per epoch. Neither requeues. The node is
lost at a chosen step: rank 2 (on n2) waits in its 55th training forward call (step 28; a
checkpoint at step 20, snapshots every 2 steps) until n2 is set DOWN, its processes killed and its
in-memory snapshots removed (the test nodes share one machine's /dev/shm: a lost node's memory
must really be lost). The test cluster grows to 3 nodes for this and is given back after."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ranks import write_job
from runlogs import assert_each_sample_once_per_epoch, decisions, events, sample_log, train_records
from test_preemption_slurm import (CHECKPOINT, DATA, SLURM, STEPS, STEPS_PER_EPOCH, TRAIN, Reference,
                                   assert_same_as_reference, ddpjob, job_env)
from test_requeue_slurm import node_pids

START = Path(__file__).parent / "start.sh"


@pytest.fixture
def three_nodes(slurm_cluster: Any) -> Any:
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    out = subprocess.run(["bash", str(START), "--nodes", "3"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    try:
        yield
    finally:
        slurmtools._run(["scontrol", "update", "nodename=n2", "state=resume"], check=False)
        back = subprocess.run(["bash", str(START), "--nodes", "2"], capture_output=True, text=True, timeout=300)
        assert back.returncode == 0, back.stdout[-2000:] + back.stderr[-2000:]


def lose_n2(jid: str) -> None:
    """n2 fails under the job: DOWN in the controller, its ranks killed, its memory gone."""
    import slurmtools

    ranks = node_pids(jid, "n2")
    assert ranks, "no process of the job on n2"
    slurmtools._run(["scontrol", "update", "nodename=n2", "state=down", "reason=ddpjob-test-node-loss"])
    for pid in ranks:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    for tree in Path("/dev/shm").glob(f"ddpjob-{os.getuid()}/{jid}-*/n2"):
        shutil.rmtree(tree, ignore_errors=True)


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize("spare", [1, 0], ids=["a-spare-takes-its-place", "the-survivor-goes-on-alone"])
def test_a_lost_node_is_left_behind_inside_the_allocation(three_nodes: Any, tmp_path: Path,
                                                          reference: Reference, spare: int) -> None:
    import slurmtools

    reference.start()
    slurm = {**SLURM, "partition": "wide", "on_node_loss": "continue", "spare_nodes": spare, "max_failures": 1}
    job = write_job(tmp_path / "job.toml", slurm=slurm, train=TRAIN, data=DATA,
                    checkpoint={**CHECKPOINT, "snapshot_every": 2})
    run = tmp_path / "run"
    ddpjob("sbatch", str(job), "-o", str(tmp_path / "job.sbatch"), "--run-dir", str(run), cwd=tmp_path)
    script = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --no-kill" in script and f"#SBATCH --nodes={2 + spare}" in script
    jid = slurmtools.submit(tmp_path / "job.sbatch", cwd=tmp_path, env=job_env(DDPJOB_TEST_SIGNAL="2:55:0:pause"))
    slurmtools.read_when(run / "logs" / "rank-2.log", "paused at call 55", timeout=300)
    lose_n2(jid)
    assert slurmtools.wait_done(jid, 900) == "COMPLETED"
    stops = decisions(events(run))
    assert [e["reason"] for e in stops] == ["node_failure", "finished"], stops
    lost = stops[0]
    assert lost["lost_hosts"] == ["n2"] and lost["requeued_by"] == "in_allocation", lost
    starts = events(run, "start")
    assert [s["job_id"] for s in starts] == [jid, jid], starts  # the same job: never requeued
    assert [s["world_size"] for s in starts] == [4, 4 if spare else 2], starts
    # both from n1's newest snapshot, not the checkpoint of step 20: the spare's ranks hold none,
    # and get the replicas and their RNG files (kept in n1's snapshots) from ranks 0 and 1
    assert starts[1]["resumed_step"] == lost["step"] and 20 < lost["step"] <= 28, (starts, lost)
    if spare:
        rank0 = (run / "logs" / "rank-0.log").read_text()
        assert (f"resuming from the in-memory snapshot of step {lost['step']}, newer than any checkpoint"
                in rank0 and "copied from peers to rank(s) 2, 3, whose node lost its own" in rank0), rank0[-3000:]
    assert (lost["failed_host"], lost["failed_how"]) == ("n2", "node failure"), lost
    rows = slurmtools.sacct_rows(jid, "State,NodeList")
    assert [r["State"] for r in rows if r["State"] != "RESIZING"] == ["COMPLETED"], rows  # no REQUEUED start
    batch = (run / "logs" / f"batch-{jid}.out").read_text()
    assert "srun: error: Node failure on n2" in batch, batch[-3000:]
    assert f"ddpjob: attempt 1: ranks on {2 if spare else 1} node(s)" in batch, batch[-3000:]
    status = ddpjob("status", str(run), cwd=tmp_path).stdout
    assert f"node_failure at step {lost['step']} (job {jid}), node n2 failed" in status, status
    assert "restarted inside the allocation" in status and "n2 1 failure" in status, status
    if spare:
        assert_same_as_reference(run, reference.run_dir())
        return
    # the survivor alone: each sample once per epoch over both world sizes; the loss close to
    # the uninterrupted run's (another world size adds the gradients in another order)
    assert_each_sample_once_per_epoch(sample_log(run), STEPS, samples=DATA["synthetic_train"],
                                      global_batch=DATA["synthetic_train"] // STEPS_PER_EPOCH)
    last = max(train_records(run), key=lambda r: r["step"])
    ref_last = max(train_records(reference.run_dir()), key=lambda r: r["step"])
    assert last["step"] == ref_last["step"] == STEPS, (last, ref_last)
    assert abs(last["loss"] - ref_last["loss"]) <= 0.05 * ref_last["loss"] + 1e-3, (last, ref_last)
