"""The preemption protocol and failures with the local backend (`ddpjob submit --backend local`:
the supervisor in ddpjob/launch/local.py plays SLURM's part), each run compared bit for bit with one
uninterrupted run of the same job (2 local ranks, batch 16 x accumulation 2, 20 steps per epoch).

- interrupted three times by three different routes: SIGUSR2 to the supervisor (forwarded to
  every rank, like SLURM's time-limit warning), a signal raised by rank 1 inside the first
  micro-step of a step (mid-accumulation), SIGTERM to rank 0 only (one task preempted first);
- one rank SIGKILLed mid-step: the supervisor ends the other at once, the run is FAILED; the
  newest checkpoint is then damaged on disk: the resume says so in one line, falls back to the
  checkpoint before it and replays the lost steps with the same losses.
The SLURM versions of these are in test_preemption_slurm.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from clirun import job_env, wait_for
from ranks import LAG, assert_bit_equal, final_state, run, write_job
from runlogs import assert_each_sample_once_per_epoch, decisions, events, sample_log, train_records

TRAIN = dict(model="trainer_plugins:signalling_cnn", batch_size=16, accumulation_steps=2,
             max_steps=80, lr=0.05, warmup_steps=5, log_every=1, eval_every=40, amp="off",
             channels_last=False, threads=1, seed=13, log_sample_ids=True)
DATA = dict(dataset="synthetic", synthetic_train=1280, synthetic_test=256, augment=True)
STEPS, STEPS_PER_EPOCH, EVERY = 80, 20, 10


def job_file(folder: Path, **slurm: Any) -> Path:
    return write_job(folder / "job.toml", slurm=dict(nodes=1, tasks_per_node=2, max_requeues=5, **slurm),
                     train=TRAIN, data=DATA, checkpoint=dict(every_steps=EVERY, keep_last=3))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("reference")
    codes, ranks = run([str(job_file(folder)), "--run-dir", str(folder / "run")], 2,
                       folder / "logs", job_id=None, timeout=300)
    assert codes == [0, 0], ranks.output()
    return folder / "run"


def submit_local(tmp_path: Path, slurm: dict[str, Any] | None = None, **env: str) -> tuple[Path, int]:
    """`ddpjob submit --backend local`; returns the run dir and the supervisor's pid."""
    run_dir = tmp_path / "run"
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDPJOB_"))}
    full.update(job_env(**env))
    out = subprocess.run([sys.executable, "-m", "ddpjob", "submit", str(job_file(tmp_path, **(slurm or {}))),
                          "--backend", "local", "--run-dir", str(run_dir)], capture_output=True,
                         text=True, cwd=tmp_path, env=full, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return run_dir, json.loads((run_dir / "job.json").read_text())["pid"]


def supervisor(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "local.json"
    return json.loads(path.read_text()) if path.exists() else {}


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait(what: str, check: Any, sup: int, timeout: float = 180) -> Any:
    """Until check() is truthy; fails early once the supervisor is gone."""
    return wait_for(check, timeout, what, 0.1, alive=lambda: alive(sup), whose=f"the supervisor {sup}")


def step_of(run_dir: Path, restart: int) -> int:
    steps = [r["step"] for r in train_records(run_dir) if r["restart"] == restart]
    return max(steps, default=0)


def stops(run_dir: Path) -> list[dict[str, Any]]:
    return decisions(events(run_dir))


def assert_same_as_reference(run_dir: Path, ref: Path) -> int:
    """Final model and optimizer torch.equal, every logged loss equal (replays too), every
    sample once per epoch; returns how many steps were trained twice."""
    model, opt = final_state(run_dir)
    ref_model, ref_opt = final_state(ref)
    assert_bit_equal(model, ref_model, "model")
    assert_bit_equal(opt["state"], ref_opt["state"], "optimizer")
    expected = {r["step"]: r["loss"] for r in train_records(ref)}
    records = train_records(run_dir)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert {r["step"] for r in records} == set(expected)
    wrong = [(r["step"], r["restart"]) for r in records if r["loss"] != expected[r["step"]]]
    assert not wrong, f"losses differ at (step, restart): {wrong[:10]}"
    assert_each_sample_once_per_epoch(sample_log(run_dir), STEPS, samples=1280, global_batch=64)
    return len(records) - STEPS


@pytest.mark.slow
def test_local_run_interrupted_three_ways_is_bit_exact(tmp_path: Path, reference: Path) -> None:
    t0 = time.monotonic()
    # Rank 1 of the second incarnation raises SIGUSR2 in its 21st training forward call: the
    # first micro-step of its 11th step.
    run_dir, sup = submit_local(tmp_path, DDPJOB_TEST_SIGNAL="1:21:1")

    # 1. SIGUSR2 to the supervisor, forwarded to both ranks
    wait("step 12", lambda: step_of(run_dir, 0) >= 12, sup)
    os.kill(sup, signal.SIGUSR2)
    first = wait("the first stop", lambda: stops(run_dir)[:1], sup)[0]
    # rank 0 decides, as on SLURM; the supervisor carries it out (restarts the ranks)
    assert (first["reason"], first["requeued"], first["requeued_by"]) == ("time_limit", True, "supervisor"), first

    # 2. mid-accumulation, rank 1 only: both ranks stop at the step it was in (+ the vote's lag)
    second = wait("the second stop", lambda: stops(run_dir)[1:2], sup)[0]
    assert second["step"] == first["step"] + 11 + LAG, (first, second)

    # 3. SIGTERM to rank 0 only
    wait("10 steps of restart 2", lambda: step_of(run_dir, 2) >= second["step"] + 10, sup)
    os.kill(supervisor(run_dir)["rank_pids"][0], signal.SIGTERM)
    third = wait("the third stop", lambda: stops(run_dir)[2:3], sup)[0]
    assert third["reason"] == "preemption", third
    wait("COMPLETED", lambda: supervisor(run_dir).get("state") == "COMPLETED", sup, timeout=300)
    took = time.monotonic() - t0

    state = supervisor(run_dir)
    assert [h["exit_codes"] for h in state["history"]] == [[3, 3]] * 3 + [[0, 0]]
    sig = sorted((e["restart"], e["rank"], e["signal"], e["at_step"], e["stop_step"])
                 for e in events(run_dir, "signal") if "rank" in e)
    s1, s2, s3 = first["step"], second["step"], third["step"]
    assert [x[:3] for x in sig] == [(0, 0, "SIGUSR2"), (0, 1, "SIGUSR2"), (1, 1, "SIGUSR2"),
                                    (2, 0, "SIGTERM")], sig
    assert sig[2][3:] == (s2 - 1 - LAG, s2)  # arrived in step s2 - LAG (its first micro-step)
    # Lost work: none; the ranks stop at most one optimizer step (+ the vote's lag) after the
    # signal, at the checkpoint the next start resumes from.
    assert all(0 <= stop - at <= 1 + LAG for *_, at, stop in sig) and [x[4] for x in sig] == [s1, s1, s2, s3]
    assert [e["resumed_step"] for e in events(run_dir, "start")] == [None, s1, s2, s3]
    assert sum(s % STEPS_PER_EPOCH != 0 for s in (s1, s2, s3)) >= 2
    assert assert_same_as_reference(run_dir, reference) == 0
    print(f"\nlocal backend, 3 interruptions in {took:.0f} s: supervisor USR2 -> stop at {s1}; "
          f"rank 1 mid-accumulation (micro-step 1 of 2 of step {s2}) -> stop at {s2}; SIGTERM to "
          f"rank 0 -> stop at {s3}; bit-exact")


@pytest.mark.slow
def test_killed_rank_fails_the_run_fast_and_a_damaged_newest_checkpoint_is_skipped(
        tmp_path: Path, reference: Path) -> None:
    run_dir, sup = submit_local(tmp_path, dict(max_failures=0))  # never retried: it fails
    wait("step 25", lambda: step_of(run_dir, 0) >= 25, sup)
    pids = supervisor(run_dir)["rank_pids"]
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    wait("both ranks to exit", lambda: not any(alive(p) for p in pids), sup, timeout=60)
    gone_s = time.monotonic() - t0
    wait("FAILED", lambda: supervisor(run_dir).get("state") == "FAILED", sup, timeout=60)
    assert gone_s < 60
    last = step_of(run_dir, 0)
    saved = sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))
    assert saved and saved[-1] <= last and all(s % EVERY == 0 for s in saved), (saved, last)
    assert not (run_dir / "COMPLETED").exists()

    # Damage the newest checkpoint (one bit of the model), then resume as the next start would.
    newest = run_dir / "checkpoints" / f"step-{saved[-1]:09d}"
    model = bytearray((newest / "model.pt").read_bytes())
    model[len(model) // 2] ^= 0x10
    (newest / "model.pt").write_bytes(bytes(model))
    codes, ranks = run([str(run_dir)], 2, tmp_path / "resume-logs", job_id="resume", restart=1,
                       timeout=300)
    assert codes == [0, 0], ranks.output()
    out = ranks.logs[0].read_text()
    skipped = [line for line in out.splitlines() if line.startswith("skipping ")]
    assert len(skipped) == 1 and skipped[0].startswith(f"skipping step-{saved[-1]}: ") \
        and "sha256" in skipped[0], skipped
    assert f"resuming from step-{saved[-2]}" in out
    previous = saved[-2]
    assert [e["resumed_step"] for e in events(run_dir, "start")] == [None, previous]
    replayed = assert_same_as_reference(run_dir, reference)
    assert replayed == last - previous
    print(f"\nlocal backend: rank 1 SIGKILLed after step {last}: both ranks gone {gone_s:.2f} s "
          f"later, run FAILED; newest checkpoint {saved[-1]} damaged and skipped ({skipped[0]!r}); "
          f"resumed from {previous}, {replayed} steps trained twice with identical losses")


def submit_wait(tmp_path: Path, job: Path, **env: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """`ddpjob submit JOB --backend local --wait` into tmp_path/run with the test plugins' `env`
    (a kill at a chosen step); the run dir and how the command ended."""
    run_dir = tmp_path / "run"
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDPJOB_"))}
    full.update(job_env(**env))
    out = subprocess.run([sys.executable, "-m", "ddpjob", "submit", str(job), "--backend", "local",
                          "--run-dir", str(run_dir), "--wait"], capture_output=True, text=True, cwd=tmp_path,
                         env=full, timeout=600)
    return run_dir, out


def restarted_run(tmp_path: Path, checkpoint: dict[str, Any], **env: str) -> Path:
    """The job with max_failures = 1 and `checkpoint` through submit_wait; the finished run's dir."""
    job = write_job(tmp_path / "job.toml", slurm=dict(nodes=1, tasks_per_node=2, max_requeues=5, max_failures=1),
                    train=TRAIN, data=DATA, checkpoint=checkpoint)
    run_dir, out = submit_wait(tmp_path, job, **env)
    assert out.returncode == 0, out.stdout + out.stderr
    return run_dir


@pytest.mark.slow
def test_a_killed_rank_resumes_from_the_in_memory_snapshot(tmp_path: Path, reference: Path) -> None:
    """checkpoint.snapshot_every = 2 next to the durable checkpoint every 10 steps; rank 1 is
    SIGKILLed in step 34 (its 67th forward call), once every rank's snapshot of step 32 is in
    /dev/shm. The supervisor restarts the ranks (max_failures = 1); they agree on the snapshot of
    step 32, not the checkpoint of step 30: 1 step lost instead of 3, and the run ends bit-equal
    to the uninterrupted one. Nothing of the job is left in /dev/shm."""
    run_dir = restarted_run(tmp_path, dict(every_steps=EVERY, keep_last=3, snapshot_every=2),
                            DDPJOB_TEST_SIGNAL="1:67:0:kill", DDPJOB_TEST_SNAP_WAIT="32")
    crash, finished = stops(run_dir)
    assert (crash["reason"], crash["step"], crash["steps_lost"]) == ("crash", 32, 1), crash
    assert crash["failed_rank"] == 1 and crash["failed_how"] == "killed by SIGKILL", crash
    starts = events(run_dir, "start")
    assert [s["resumed_step"] for s in starts] == [None, 32], starts
    # max_failures = 1: both attempts' ranks were forked from the run's warm-start server, which
    # ended with the run
    assert [s.get("warm") for s in starts] == [True, True], starts
    server = f"ddpjob.node.warm serve --name {json.loads((run_dir / 'job.json').read_text())['job_id']} "
    assert server not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert finished["reason"] == "finished"
    assert_same_as_reference(run_dir, reference)
    job_id = json.loads((run_dir / "job.json").read_text())["job_id"]
    assert not list(Path("/dev/shm").glob(f"ddpjob-{os.getuid()}/{job_id}-*")), "snapshots left behind"


@pytest.mark.slow
def test_by_default_a_job_that_may_restart_snapshots_at_a_measured_interval(tmp_path: Path, reference: Path) -> None:
    """checkpoint.snapshot_every left at "auto" with max_failures = 1: the probe snapshot is taken
    at step 21 (20 steps after the start; step 20 writes a checkpoint), rank 1 is SIGKILLed in step
    24 (its 47th forward call) once it is committed, and the restart resumes from it, not from the
    checkpoint of step 20. The restarted ranks measure again: their probe, then one line with the
    interval that keeps a snapshot within 1% of the steps between two. Bit-equal at the end."""
    import re

    run_dir = restarted_run(tmp_path, dict(every_steps=EVERY, keep_last=3),
                            DDPJOB_TEST_SIGNAL="1:47:0:kill", DDPJOB_TEST_SNAP_WAIT="21")
    crash, finished = stops(run_dir)
    assert (crash["reason"], crash["step"], crash["steps_lost"]) == ("crash", 21, 2), crash
    assert [s["resumed_step"] for s in events(run_dir, "start")] == [None, 21]
    assert finished["reason"] == "finished"
    assert_same_as_reference(run_dir, reference)
    log = "\n".join(p.read_text() for p in sorted((run_dir / "logs").glob("rank-0*")))
    lines = re.findall(r"in-memory snapshots every (\d+) steps .*", log)
    assert len(lines) == 1, log[-3000:]  # the restart's (it measures its own); the first died at 24 < 31
    assert int(lines[0]) >= 1, lines


@pytest.mark.slow
def test_a_rank_whose_node_lost_its_snapshots_gets_them_from_its_peer(tmp_path: Path, reference: Path) -> None:
    """Two ranks on two "nodes" (SLURMD_NODENAME ha and hb), snapshots every 2 steps: each
    snapshot of rank 0 also keeps rank 1's RNG file. Rank 1 is SIGKILLed in step 34 (its 67th
    forward call) once both snapshots of step 32 are in /dev/shm, and hb's snapshots are then
    removed, as a lost node's memory is. The restart (the same ranks, as a spare node's would
    be) resumes from step 32, not from the checkpoint of step 30: rank 1 receives the model and
    the optimizer from rank 0 and its RNG file from rank 0's copy, and the run ends bit-equal."""
    import shutil

    hosts = {0: {"SLURMD_NODENAME": "ha"}, 1: {"SLURMD_NODENAME": "hb"}}
    job = job_file(tmp_path)
    text = job.read_text().replace("keep_last = 3", "keep_last = 3\nsnapshot_every = 2")
    job.write_text(text)
    args = [str(job), "--run-dir", str(tmp_path / "run")]
    codes, ranks = run(args, 2, tmp_path / "logs", job_id="peer", per_rank_env=hosts, timeout=300,
                       extra_env={"DDPJOB_TEST_SIGNAL": "1:67:0:kill", "DDPJOB_TEST_SNAP_WAIT": "32"})
    assert codes[1] == -signal.SIGKILL and codes[0] != 0, ranks.output()
    shm = Path("/dev/shm") / f"ddpjob-{os.getuid()}"
    lost = list(shm.glob("peer-*/hb"))
    assert len(lost) == 1 and list(lost[0].glob("rank-1/step-*32")), lost
    shutil.rmtree(lost[0])
    codes, ranks = run([str(tmp_path / "run")], 2, tmp_path / "logs", job_id="peer", restart=1,
                       per_rank_env=hosts, timeout=300)
    assert codes == [0, 0], ranks.output()
    out = ranks.logs[0].read_text()
    import re

    # rank 1 gets every state file (model, optimizer, scheduler, ...) and its RNG file
    copied = re.search(r"resuming from the in-memory snapshot of step 32, newer than any checkpoint "
                       r"\((\d+) file\(s\) copied from peers to rank\(s\) 1, whose node lost its own\)", out)
    assert copied and int(copied.group(1)) >= 3, out[-3000:]
    assert [s["resumed_step"] for s in events(tmp_path / "run", "start")] == [None, 32]
    assert_same_as_reference(tmp_path / "run", reference)
    assert not list(shm.glob("peer-*")), "snapshots left behind"
