"""`[train] strategy = "fsdp"` on the real SLURM test cluster, through `ddpjob submit --backend slurm`.

examples/charlm sharded over 2 nodes x 2 tasks is preempted at a chosen step (rank 0 submits a
`high` job needing both nodes from inside that step and waits there for the SIGTERM:
tests/example_slurm_hooks.py, no clock race), and while it waits for its second start the
pending job is shrunk to 1 node x 2 tasks (`scontrol update`). The second start reshards the
model and the AdamW state from 4 DCP shards to 2. Compared with an uninterrupted run at the
original world size (4 local ranks): every logged loss up to the stop bit for bit (the same
world size), the final loss within 1e-5 (after the stop only the summation order changes; dropout
is 0, since another rank count draws other dropout masks), and every sample once per epoch.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from example_jobs import CHARLM, CHARLM_SMALL, hook_job, samples_by_step
from ranks import LAG
from test_examples_slurm import CHARLM_STEPS_PER_EPOCH, ENTRY, _reference, _submit, shrink_to_one_node_and_finish
from test_preemption_slurm import events, train_records, wait_stop


def _job(folder: Path, **user: Any) -> Path:
    return hook_job(folder / "charlm-fsdp.toml", CHARLM / "train.py", CHARLM / "job.toml",
                     user={**CHARLM_SMALL, "dropout": 0.0, "num_workers": 0, **user},
                     checkpoint={"every_steps": 5},
                     train={"entry": ENTRY, "args": [str(CHARLM / "train.py")], "strategy": "fsdp"})


@pytest.mark.cluster
def test_fsdp_slurm_2x2_preempted_resumed_1x2_reshards_and_sees_every_sample_once(
        slurm_cluster: Any, tmp_path: Path) -> None:
    import slurmtools

    slurmtools.cluster_free(timeout=600)
    t0 = time.monotonic()
    steps_per_epoch = CHARLM_STEPS_PER_EPOCH
    total, at = steps_per_epoch + 8, 20  # one full epoch and part of the next
    stop_step = at + 1 + LAG  # the step in flight finishes, the vote's, then the stop
    job = _job(tmp_path, max_steps=total)
    run_dir = tmp_path / "run"
    jid = _submit(job, run_dir, "slurm.tasks_per_node=2", "slurm.time=\"00:10:00\"",
                  env={"DDPJOB_TEST_PREEMPT_AT": f"0:{at}:{tmp_path / 'high.id'}"})
    stop = wait_stop(run_dir, 1, jid, timeout=400)
    assert stop["reason"] == "preemption" and stop["requeued"] is True and stop["step"] == stop_step, stop
    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]  # what the second start loads
    assert newest.name == f"step-{stop_step:09d}"
    assert sorted(p.name for p in newest.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    shrink_to_one_node_and_finish(jid, tmp_path)
    took = time.monotonic() - t0
    starts = events(run_dir, "start")
    assert [(s["world_size"], s["resumed_step"]) for s in starts] == [(4, None), (2, stop_step)], starts
    log = (run_dir / "logs" / f"{jid}_0_log.out").read_text()
    assert f"resumed at another world size: 4 -> 2 ranks (step {stop_step})" in log
    samples = samples_by_step(run_dir)
    assert sorted(samples) == list(range(1, total + 1))
    for step, recs in samples.items():
        assert sum(len(r["ids"]) for r in recs) == CHARLM_SMALL["batch_size"], step  # GLOBAL batch
        assert {r["world_size"] for r in recs} == ({4} if step <= stop_step else {2}), step
        assert sorted(r["rank"] for r in recs) == list(range(recs[0]["world_size"])), step
    epoch0 = [i for s in range(1, steps_per_epoch + 1) for r in samples[s] for i in r["ids"]]
    assert len(epoch0) == len(set(epoch0)) == steps_per_epoch * 32
    epoch1 = [i for s in range(steps_per_epoch + 1, total + 1) for r in samples[s] for i in r["ids"]]
    assert len(epoch1) == len(set(epoch1)) == 8 * 32
    assert (run_dir / "COMPLETED").is_file() and (run_dir / "final" / "model.pt").is_file()

    ref = _reference(tmp_path, job, world=4)  # uninterrupted, at the original world size
    expected = {r["step"]: r["loss"] for r in train_records(ref)}
    got = {r["step"]: r["loss"] for r in train_records(run_dir)}  # replays: the newest wins
    assert sorted(got) == sorted(expected) == list(range(1, total + 1))
    assert {s: got[s] for s in range(1, stop_step + 1)} == {s: expected[s] for s in range(1, stop_step + 1)}
    diff = abs(got[total] - expected[total])
    assert diff <= 1e-5, (got[total], expected[total])
    print(f"\nfsdp job {jid}: 4 ranks -> stop at {stop['step']} -> 2 ranks, final loss "
          f"{got[total]!r} vs uninterrupted {expected[total]!r} (|diff| {diff:.1e}), job {took:.0f} s")
