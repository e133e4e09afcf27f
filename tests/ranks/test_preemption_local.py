"""The preemption protocol with local processes (the SLURM versions come in the cluster tests).

A signal reaches one rank (or all) mid-run -> every rank stops at the same optimizer step,
writes the checkpoint, exits 3; a restart resumes, and the end result is bit-identical to a
run that was never interrupted: final model, optimizer state, every per-step loss.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from ranks import (LAG, Ranks, assert_bit_equal, events, final_state, metrics, run, signal_when_paused,
                   tensorboard_scalars, write_job)
from runlogs import decisions

TRAIN = dict(model="trainer_plugins:signalling_cnn", batch_size=16, accumulation_steps=2, lr=0.05,
             warmup_steps=3, log_every=1, eval_every=0, amp="off", channels_last=False, threads=1,
             seed=1, max_steps=30)
DATA = dict(dataset="synthetic", synthetic_train=512, synthetic_test=128, augment=True)
STEPS_PER_EPOCH = 8  # 512 samples / global batch 64


def _job(tmp_path: Path, name: str = "job.toml", **train: object) -> Path:
    return write_job(tmp_path / name, train={**TRAIN, **train}, data=DATA,
                     checkpoint=dict(every_steps=7, keep_last=2), slurm=dict(max_requeues=3))


def _batch(world: int) -> int:
    return 64 // (2 * world)  # global batch 64 at any world size: 8 steps per epoch


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """Uninterrupted runs, one per world size, shared by the tests of this module."""
    cache: dict[int, Path] = {}

    def get(world: int) -> Path:
        if world not in cache:
            d = tmp_path_factory.mktemp(f"ref{world}")
            job = _job(d, batch_size=_batch(world))
            codes, r = run([str(job), "--run-dir", str(d / "run")], world, d / "logs")
            assert codes == [0] * world, r.output()
            cache[world] = d / "run"
        return cache[world]

    return get


def _assert_same_run(a: Path, b: Path) -> None:
    model_a, opt_a = final_state(a)
    model_b, opt_b = final_state(b)
    assert_bit_equal(model_a, model_b, "model")
    assert_bit_equal(opt_a["state"], opt_b["state"], "optimizer")
    losses_a = {s: r["loss"] for s, r in metrics(a).items()}
    losses_b = {s: r["loss"] for s, r in metrics(b).items()}
    assert len(losses_a) == TRAIN["max_steps"]
    assert losses_a == losses_b  # every step's loss, bit for bit (JSON floats round-trip exactly)
    evals_a = {s: r["eval_acc"] for s, r in metrics(a, "eval").items()}
    assert evals_a == {s: r["eval_acc"] for s, r in metrics(b, "eval").items()}


def _stop_record(run_dir: Path) -> dict:
    return decisions(events(run_dir))[0]


def test_usr2_to_one_rank_stops_all_at_one_step_and_resume_is_bit_exact(tmp_path: Path, reference) -> None:
    """2 ranks, SIGUSR2 from outside to rank 1 only, mid-epoch: rank 1 pauses in the first
    micro-step of step 12 (forward call 23) until the test's signal has reached it."""
    job = _job(tmp_path, batch_size=_batch(2))
    out = tmp_path / "interrupted"
    ranks = Ranks([str(job), "--run-dir", str(out)], 2, tmp_path / "logs",
                  extra_env={"DDPJOB_TEST_SIGNAL": "1:23::pause"})
    signal_when_paused(ranks, 1, signal.SIGUSR2, to=[1])
    assert ranks.wait(120) == [3, 3], ranks.output()
    stop = _stop_record(out)
    assert stop["reason"] == "time_limit" and stop["step"] == 12 + LAG, stop
    sig = [e for e in events(out) if e["event"] == "signal"]
    # Lost work: none. The step in flight when the signal came is finished, and the one the
    # overlapped vote needs to reach every rank, nothing after them.
    assert [(e["rank"], e["signal"], e["at_step"], e["stop_step"]) for e in sig] == [(1, "SIGUSR2", 11, 12 + LAG)]
    ckpt = out / "checkpoints" / f"step-{stop['step']:09d}"
    assert {"rank-0.pt", "rank-1.pt", "model.pt", "optimizer.pt"} <= {p.name for p in ckpt.iterdir()}
    assert "stopped at step" in ranks.output(0)

    codes, r = run([str(out)], 2, tmp_path / "logs", restart=1)
    assert codes == [0, 0], r.output()
    starts = [e for e in events(out) if e["event"] == "start"]
    assert [s["resumed_step"] for s in starts] == [None, stop["step"]]
    assert [s["restart"] for s in starts] == [0, 1]
    _assert_same_run(reference(2), out)


def test_tensorboard_reads_one_series_across_a_crash_and_a_stop(tmp_path: Path, reference) -> None:
    """train.tensorboard: attempt 0 crashes in step 12 (logged up to 11, checkpoint at 7), attempt
    1 is stopped by USR2 in step 19 (checkpoint written one step later), attempt 2 finishes. TensorBoard's own
    reader sees steps 1..30 once each, in order, with the losses of metrics.jsonl."""
    import numpy as np

    job = _job(tmp_path, batch_size=_batch(2), tensorboard=True)
    out = tmp_path / "run"
    codes, r = run([str(job), "--run-dir", str(out)], 2, tmp_path / "logs",
                   extra_env={"DDPJOB_TEST_SIGNAL": "1:23:0:crash"})
    assert codes[1] == 1 and 11 in metrics(out), r.output()
    ranks = Ranks([str(out)], 2, tmp_path / "logs", restart=1,
                  extra_env={"DDPJOB_TEST_SIGNAL": "1:24:1:pause"})  # resumed at 7: call 24 is step 19
    signal_when_paused(ranks, 1, signal.SIGUSR2, to=[1])
    assert ranks.wait(120) == [3, 3], ranks.output()
    codes, r = run([str(out)], 2, tmp_path / "logs", restart=2)
    assert codes == [0, 0], r.output()
    resumed = [e.get("resumed_step") for e in events(out) if e["event"] == "start"]
    assert resumed == [None, 7, 19 + LAG], resumed
    series = tensorboard_scalars(out, "train/loss")
    assert [step for step, _ in series] == list(range(1, TRAIN["max_steps"] + 1))
    losses = {s: rec["loss"] for s, rec in metrics(out).items()}  # the latest record of each step
    assert [v for _, v in series] == [float(np.float32(losses[s])) for s, _ in series]
    _assert_same_run(reference(2), out)  # logging to TensorBoard changes no number


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks on 2 cores: ~40-80 s
def test_stop_mid_accumulation_resumes_bit_exactly(tmp_path: Path, reference, world: int) -> None:
    """The last rank signals itself during the first micro-step of step 10 (accumulation 2), so
    the stop request lands mid-accumulation and mid-epoch; with 4 ranks this also exercises
    the rank-ordered gradient sum that makes >2-rank resumes bit-exact."""
    job = _job(tmp_path, batch_size=_batch(world))
    out = tmp_path / "interrupted"
    target_rank = world - 1
    codes, r = run([str(job), "--run-dir", str(out)], world, tmp_path / "logs",
                   extra_env={"DDPJOB_TEST_SIGNAL": f"{target_rank}:19"})  # call 19 = step 10, micro 1
    assert codes == [3] * world, r.output()
    stop = _stop_record(out)
    assert stop["step"] == 10 + LAG and (10 + LAG) % STEPS_PER_EPOCH != 0, stop
    sig = [e for e in events(out) if e["event"] == "signal"]
    assert [(e["rank"], e["at_step"], e["stop_step"]) for e in sig] == [(target_rank, 9, 10 + LAG)]

    codes, r = run([str(out)], world, tmp_path / "logs", restart=1)
    assert codes == [0] * world, r.output()
    _assert_same_run(reference(world), out)


def test_sigterm_is_a_preemption_no_self_requeue(tmp_path: Path) -> None:
    """SIGTERM (SLURM preemption / scancel) to every rank: checkpoint, exit 3, reason
    'preemption'. Rank 0 decides as under the local supervisor (the ranks carry its job id):
    requeued by it, within max_requeues; it runs no scontrol."""
    job = _job(tmp_path, max_steps=400, batch_size=_batch(2))
    out = tmp_path / "run"
    ranks = Ranks([str(job), "--run-dir", str(out)], 2, tmp_path / "logs",
                  extra_env={"DDPJOB_TEST_SIGNAL": "0:11::pause"})  # rank 0 waits in step 6
    signal_when_paused(ranks, 0, signal.SIGTERM)
    assert ranks.wait(120) == [3, 3], ranks.output()
    stop = _stop_record(out)
    assert stop["reason"] == "preemption" and stop["step"] == 6 + LAG, stop
    assert (stop["requeued"], stop["requeued_by"], stop["action"]) == (True, "supervisor", "requeue"), stop
    assert (out / "checkpoints" / f"step-{stop['step']:09d}" / "manifest.json").is_file()


def test_requeued_after_finish_exits_0_without_training(tmp_path: Path) -> None:
    job = _job(tmp_path, max_steps=3)
    out = tmp_path / "run"
    codes, r = run([str(job), "--run-dir", str(out)], 1, tmp_path / "logs")
    assert codes == [0], r.output()
    trained = (out / "metrics.jsonl").read_bytes()
    codes, r = run([str(out)], 2, tmp_path / "logs", restart=1)
    assert codes == [0, 0], r.output()
    assert "already completed at step 3" in r.output(0)
    # It notices before anything else (rank/runner.py): no group, no start record, no training.
    # (A 5 s bound on its time stood here: it failed once beside the cluster tier's load.)
    assert [e["event"] for e in events(out) if e.get("restart") == 1] == ["noop"], events(out)
    assert (out / "metrics.jsonl").read_bytes() == trained


def test_restart_beyond_max_requeues_stops_with_one_line(tmp_path: Path) -> None:
    """The job came back a fourth time (SLURM may requeue by itself) with max_requeues = 3 spent:
    the start is refused with one line, counted from the run's ledger (ledger/budget.py)."""
    from ddpjob import jobfile, rundir
    from ddpjob.ledger import events as ledger

    job = _job(tmp_path, max_steps=3)
    out = tmp_path / "run"
    rundir.prepare(out, jobfile.resolve(job, [], {}))
    for n in range(4):  # four requeues of job "test" on record
        ledger.record(out, "stop", reason="preemption", job_id="test", restart=n, requeued=True,
                      requeued_by="scontrol")
    codes, r = run([str(out)], 1, tmp_path / "logs", restart=4)
    assert codes == [1], r.output()
    err = [x for x in r.output(0).splitlines() if x.startswith("ddpjob: error:")]
    assert len(err) == 1 and "restart 4" in err[0] and "max_requeues = 3" in err[0], err


def test_killed_rank_ends_the_others(tmp_path: Path) -> None:
    """kill -9 of one rank mid-run: the survivor's next collective fails and it exits non-zero
    (gloo sees the closed connection) instead of hanging until the 300 s process-group timeout,
    with a line that names the rank that is gone."""
    job = _job(tmp_path, max_steps=2000, batch_size=_batch(2))
    out = tmp_path / "run"
    ranks = Ranks([str(job), "--run-dir", str(out)], 2, tmp_path / "logs",
                  extra_env={"DDPJOB_TEST_SIGNAL": "1:11::pause"})
    signal_when_paused(ranks, 1, signal.SIGKILL, to=[1])
    t0 = time.monotonic()
    code = ranks.procs[0].wait(timeout=60)
    took = time.monotonic() - t0
    ranks.wait(10)
    assert code not in (0, 3), ranks.output(0)
    assert took < 30, f"the surviving rank needed {took:.1f} s to exit"
    print(f"surviving rank exited {took:.2f} s after the kill (code {code})")
    failed = [e for e in events(out) if e.get("reason") == "crash"]
    assert failed and failed[0]["rank"] == 0
    assert "rank 1 (" in failed[0]["error"] and "did not answer" in failed[0]["error"], failed


def test_elastic_resume_on_fewer_ranks_keeps_the_global_batch(tmp_path: Path, reference) -> None:
    """Stopped at step 10 with 2 ranks x 16 x accumulation 2, resumed alone: accumulation 4
    keeps the global batch of 64, so step N still means the same samples; the run finishes
    close to the uninterrupted 2-rank run (same 16-sample micro-batches, other summation order)."""
    job = _job(tmp_path, batch_size=_batch(2))
    out = tmp_path / "run"
    codes, r = run([str(job), "--run-dir", str(out)], 2, tmp_path / "logs",
                   extra_env={"DDPJOB_TEST_SIGNAL": "1:19"})
    assert codes == [3, 3], r.output()
    codes, r = run([str(out)], 1, tmp_path / "logs", restart=1)
    assert codes == [0], r.output()
    assert "elastic resume: world size 2 -> 1, accumulation 2 -> 4, global batch 64 kept" in r.output()
    starts = [e for e in events(out) if e["event"] == "start"]
    assert [(s["world_size"], s["accumulation"]) for s in starts] == [(2, 2), (1, 4)]
    ref, new = metrics(reference(2)), metrics(out)
    assert set(new) == set(ref)
    assert all(new[s]["loss"] == ref[s]["loss"] for s in range(1, 11))  # before the stop: identical
    # Not bit-exact: 4 local micro-steps sum the gradient in another order than 2 ranks x 2.
    # Observed: final loss equal to 5 decimals; 0.01 leaves room for BN + max-pool chaos while
    # a job resumed at the wrong data position or lr would be off by far more.
    tolerance = 0.01
    print(f"elastic 2 -> 1 rank: final loss {new[30]['loss']:.5f} vs uninterrupted {ref[30]['loss']:.5f}")
    assert abs(new[30]["loss"] - ref[30]["loss"]) < tolerance, (new[30]["loss"], ref[30]["loss"])
    # The evaluation differs more than the training loss: BatchNorm's running statistics are not
    # averaged over ranks (DDP broadcasts rank 0's), so 2 ranks feed them rank 0's micro-batches
    # and 1 rank all four. Observed: accuracy 0.656 vs 0.594 (8 of 128 images) with equal losses.
    assert abs(metrics(out, "eval")[30]["eval_acc"] - metrics(reference(2), "eval")[30]["eval_acc"]) < 0.1


def test_elastic_resume_refuses_a_world_size_that_cannot_keep_the_global_batch(tmp_path: Path) -> None:
    job = _job(tmp_path, batch_size=_batch(2))
    out = tmp_path / "run"
    codes, r = run([str(job), "--run-dir", str(out)], 2, tmp_path / "logs",
                   extra_env={"DDPJOB_TEST_SIGNAL": "0:5"})
    assert codes == [3, 3], r.output()
    codes, r = run([str(out)], 3, tmp_path / "logs", restart=1)  # 64 / (3 x 16): no
    assert codes == [1, 1, 1], r.output()
    err = [x for x in r.output(0).splitlines() if x.startswith("ddpjob: error:")]
    assert len(err) == 1 and "global batch of 64" in err[0] and "3 ranks x batch_size 16" in err[0]


def test_deadline_watch_stops_before_the_time_limit_without_any_signal(tmp_path: Path) -> None:
    """SLURM_JOB_END_TIME 20 s away: less than the 30 s margin alone of (step + checkpoint
    estimate) x 1.5 + 30 s, so the watch has expired at the first vote however long the start
    took: the ranks checkpoint and stop after their first step (and the one the overlapped vote
    adds), reason 'time_limit'."""
    job = _job(tmp_path, batch_size=_batch(2), max_steps=500)
    out = tmp_path / "run"
    end = time.time() + 20
    codes, r = run([str(job), "--run-dir", str(out)], 2, tmp_path / "logs",
                   extra_env={"SLURM_JOB_END_TIME": str(int(end))})
    assert codes == [3, 3], r.output()
    stop = _stop_record(out)
    # Not `stop["time"] < end`: on a loaded machine starting two ranks alone can take 20 s.
    assert stop["reason"] == "time_limit" and stop["step"] == 1 + LAG, stop
    assert (out / "checkpoints" / f"step-{stop['step']:09d}" / "manifest.json").is_file()


def test_init_from_starts_a_new_run_from_another_runs_checkpoint(tmp_path: Path, reference) -> None:
    """[checkpoint] init_from, from a run dir (its newest valid checkpoint) and from a weights
    file: the new run starts at step 0 with the source's weights, so its first loss is the
    trained model's, not a fresh one's; a key the checkpoint lacks is one line on every rank."""
    source = reference(2)
    train = {**TRAIN, "batch_size": _batch(2), "max_steps": 3}

    def job(name: str, **ckpt: object) -> Path:
        return write_job(tmp_path / f"{name}.toml", train=train, data=DATA, checkpoint=ckpt)

    fresh = metrics(source)[1]["loss"]
    trained = metrics(source)[TRAIN["max_steps"]]["loss"]
    assert trained < 0.9 * fresh  # the source did learn something (observed: 2.33 -> 1.98)
    for name, init in (("from-run", str(source)),
                       ("from-file", str(source / "checkpoints" / "step-000000030" / "model.pt"))):
        out = tmp_path / name
        codes, r = run([str(job(name, init_from=init)), "--run-dir", str(out)], 2, tmp_path / f"logs-{name}")
        assert codes == [0, 0], r.output()
        assert "initialised model from" in r.output(0) and "training starts at step 0" in r.output(0)
        assert [e.get("resumed_step") for e in events(out) if e["event"] == "start"] == [None]
        first = metrics(out)[1]["loss"]
        assert abs(first - trained) < abs(first - fresh), (first, trained, fresh)
    bad = job("bad", init_from=str(source), init_keys=["model", "ema"])
    codes, r = run([str(bad), "--run-dir", str(tmp_path / "bad")], 2, tmp_path / "logs-bad")
    assert codes == [1, 1], r.output()
    for rank in (0, 1):
        lines = [ln for ln in r.output(rank).splitlines() if ln.startswith("ddpjob: error:")]
        assert len(lines) == 1 and "has no ema" in lines[0], r.output(rank)
