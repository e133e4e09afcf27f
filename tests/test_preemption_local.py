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
import torch

from ranks import (Ranks, assert_bit_equal, events, final_state, metrics, run, send_at_step,
                   write_job)

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
    stops = [e for e in events(run_dir) if e["event"] == "stop"]
    return stops[0]


def test_usr2_to_one_rank_stops_all_at_one_step_and_resume_is_bit_exact(tmp_path: Path, reference) -> None:
    """2 ranks, SIGUSR2 from outside to rank 1 only, mid-epoch (sent once step 11 is logged)."""
    job = _job(tmp_path, batch_size=_batch(2))
    out = tmp_path / "interrupted"
    ranks = Ranks([str(job), "--run-dir", str(out)], 2, tmp_path / "logs")
    send_at_step(ranks, out, 11, signal.SIGUSR2, to=[1])
    assert ranks.wait(90) == [3, 3], ranks.output()
    stop = _stop_record(out)
    assert stop["reason"] == "requeue" and 11 <= stop["step"] < TRAIN["max_steps"], stop
    sig = [e for e in events(out) if e["event"] == "signal"]
    assert [(e["rank"], e["signal"]) for e in sig] == [(1, "SIGUSR2")]
    # Lost work: the step in flight when the signal came is finished, nothing after it.
    assert sig[0]["stop_step"] - sig[0]["at_step"] <= 1
    assert sig[0]["stop_step"] == stop["step"]
    ckpt = out / "checkpoints" / f"step-{stop['step']:09d}"
    assert {"rank-0.pt", "rank-1.pt", "model.pt", "optimizer.pt"} <= {p.name for p in ckpt.iterdir()}
    assert "stopped at step" in ranks.output(0)

    codes, r = run([str(out)], 2, tmp_path / "logs", restart=1)
    assert codes == [0, 0], r.output()
    starts = [e for e in events(out) if e["event"] == "start"]
    assert [s["resumed_step"] for s in starts] == [None, stop["step"]]
    assert [s["restart"] for s in starts] == [0, 1]
    _assert_same_run(reference(2), out)


@pytest.mark.parametrize("world", [2, 4])
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
    assert stop["step"] == 10 and 10 % STEPS_PER_EPOCH != 0, stop
    sig = [e for e in events(out) if e["event"] == "signal"]
    assert [(e["rank"], e["at_step"], e["stop_step"]) for e in sig] == [(target_rank, 9, 10)]

    codes, r = run([str(out)], world, tmp_path / "logs", restart=1)
    assert codes == [0] * world, r.output()
    _assert_same_run(reference(world), out)


def test_sigterm_is_a_preemption_no_self_requeue(tmp_path: Path) -> None:
    """SIGTERM (SLURM preemption / scancel) to every rank: checkpoint, exit 3, reason
    'preempted', and no requeue attempt (SLURM requeues by itself)."""
    job = _job(tmp_path, max_steps=400, batch_size=_batch(2))
    out = tmp_path / "run"
    ranks = Ranks([str(job), "--run-dir", str(out)], 2, tmp_path / "logs")
    send_at_step(ranks, out, 5, signal.SIGTERM)
    assert ranks.wait(90) == [3, 3], ranks.output()
    stop = _stop_record(out)
    assert stop["reason"] == "preempted" and stop["requeued"] is None
    assert (out / "checkpoints" / f"step-{stop['step']:09d}" / "manifest.json").is_file()


def test_requeued_after_finish_exits_0_fast(tmp_path: Path) -> None:
    job = _job(tmp_path, max_steps=3)
    out = tmp_path / "run"
    codes, r = run([str(job), "--run-dir", str(out)], 1, tmp_path / "logs")
    assert codes == [0], r.output()
    t0 = time.monotonic()
    codes, r = run([str(out)], 2, tmp_path / "logs", restart=1)
    took = time.monotonic() - t0
    assert codes == [0, 0], r.output()
    assert took < 5, f"a finished run took {took:.1f} s to notice"  # no torch import, no peers
    assert "already completed at step 3" in r.output(0)


def test_restart_beyond_max_requeues_stops_with_one_line(tmp_path: Path) -> None:
    job = _job(tmp_path, max_steps=3)
    out = tmp_path / "run"
    codes, r = run([str(job), "--run-dir", str(out)], 1, tmp_path / "logs", restart=4)
    assert codes == [1], r.output()
    err = [x for x in r.output(0).splitlines() if x.startswith("ddpjob: error:")]
    assert len(err) == 1 and "restart 4" in err[0] and "max_requeues = 3" in err[0]


def test_killed_rank_ends_the_others(tmp_path: Path) -> None:
    """kill -9 of one rank mid-run: the survivor's next collective fails and it exits non-zero
    (gloo sees the closed connection) instead of hanging until the 300 s process-group timeout."""
    job = _job(tmp_path, max_steps=2000, batch_size=_batch(2))
    out = tmp_path / "run"
    ranks = Ranks([str(job), "--run-dir", str(out)], 2, tmp_path / "logs")
    send_at_step(ranks, out, 5, signal.SIGKILL, to=[1])
    t0 = time.monotonic()
    code = ranks.procs[0].wait(timeout=60)
    took = time.monotonic() - t0
    ranks.wait(10)
    assert code not in (0, 3), ranks.output(0)
    assert took < 30, f"the surviving rank needed {took:.1f} s to exit"
    print(f"surviving rank exited {took:.2f} s after the kill (code {code})")
    failed = [e for e in events(out) if e.get("reason") == "failed"]
    assert failed and failed[0]["rank"] == 0
