"""The preemption protocol end to end on the real SLURM test cluster: one training job, interrupted
by every path SLURM has, finishes bit-identical to the same job run without interruption.

Both jobs run 2 nodes x 2 tasks, batch 16 x accumulation 2 (global batch 128, 20 steps per
epoch, 200 steps) and are compared with one uninterrupted run of the same training as 4 local
ranks with torchrun's variables (srun 2x2 is bit-identical to that: test_runner.py). Compared:
the final model and optimizer tensors (torch.equal) and every per-step loss in metrics.jsonl,
including the lines of steps that were trained twice because a kill lost them.

job S, `ddpjob sbatch` + real `sbatch`:
  1. the time-limit warning: --time 2 min with --signal=USR2@60 (the first incarnation is slowed
     down by the test plugin's sleep, so the warning lands mid-run, not after the last step);
  2. partition-priority preemption: a job in `high` needs both nodes (SIGTERM, GraceTime 20 s),
     submitted by rank 0 when step stop1 + 15 begins;
  3. rank 2 SIGKILLed when a step begins, 3 steps past a periodic checkpoint: srun --kill-on-bad-exit ends the other three, the job ends
     FAILED (a crash is not a preemption: ddpjob does not requeue it, a crash may repeat); the
     test requeues it by hand, and it resumes from the last periodic checkpoint.
job M, `ddpjob submit` (submitit):
  1. `scancel --signal=USR2` mid-accumulation: rank 1's model runs scancel during the first
     micro-step of step 25 and waits there until the signal has arrived (test plugin);
  2. `scontrol requeue`, run by rank 1 at step 45: on this cluster that is SIGTERM to every task,
     then SIGKILL after KillWait (5 s); the ranks stop two steps later and checkpoint well within it;
  3. partition-priority preemption (through submitit's NodeTask), caused by rank 0 at a step.
Every stop but S's time-limit warning is caused at a step by the job itself (at-step actions of
tests/example_slurm_hooks.py, written while the job waits for its next start): none races a clock.
Lost work is read from the per-rank `signal` events (the step when the signal arrived vs the step
the ranks stopped and checkpointed at); the sample-id log (train.log_sample_ids) shows every
sample used once per epoch across the four incarnations of job S. The local-backend version of
this protocol is in test_failure.py, the elastic resume in test_elastic.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

import clirun
from clirun import job_env, wait_for, without_job_env
from ranks import LAG, Ranks, assert_bit_equal, final_state, write_job
from runlogs import assert_each_sample_once_per_epoch, decisions, events, lines, sample_log, train_records

TRAIN = dict(model="trainer_plugins:signalling_cnn", batch_size=16, accumulation_steps=2,
             max_steps=200, lr=0.05, warmup_steps=5, log_every=1, eval_every=50, amp="off",
             channels_last=False, threads=1, seed=11, log_sample_ids=True)
DATA = dict(dataset="synthetic", synthetic_train=2560, synthetic_test=256, augment=True)
# snapshot_every = 0: these tests (and those importing CHECKPOINT) assert resumes from the durable
# checkpoint; with "auto", a job with max_failures would also snapshot at steps it measures. The
# snapshots' own tests set an interval (test_requeue_slurm.py, test_node_loss_slurm.py).
CHECKPOINT = dict(every_steps=10, keep_last=3, snapshot_every=0)
SLURM = dict(nodes=2, tasks_per_node=2, time="00:10:00", signal_lead_s=60, max_requeues=6)
STEPS, STEPS_PER_EPOCH, EVERY = 200, 20, 10


# ------------------------------------------------------------------ helpers
def job_file(folder: Path, **slurm: Any) -> Path:
    return write_job(folder / "job.toml", slurm={**SLURM, **slurm}, train=TRAIN, data=DATA,
                     checkpoint=CHECKPOINT)


def ddpjob(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return clirun.ddpjob(*argv, cwd=cwd, env=without_job_env(env), timeout=180, check=True)


def poll(what: str, timeout: float, check: Any, job_id: str | None = None) -> Any:
    """Wait until check() is truthy; fail early if the job has ended."""
    import slurmtools

    return wait_for(check, timeout, what, 0.2, alive=None if job_id is None else lambda: slurmtools.active(job_id),
                    whose=f"job {job_id}")


def wait_step(run: Path, step: int, restart: int, job_id: str, timeout: float = 240) -> int:
    def reached() -> int:
        steps = [r["step"] for r in train_records(run) if r["restart"] == restart]
        return max(steps) if steps and max(steps) >= step else 0
    return poll(f"step {step} of restart {restart}", timeout, reached, job_id)


def wait_stop(run: Path, n: int, job_id: str, timeout: float = 240) -> dict[str, Any]:
    """The n-th stop event written by rank 0 (stops of failed ranks carry a `rank`)."""
    def stop() -> dict[str, Any] | None:
        stops = decisions(events(run))
        return stops[n - 1] if len(stops) >= n else None
    return poll(f"stop {n}", timeout, stop, job_id)


def release(job_id: str) -> None:
    """Start a requeued job now instead of after the ~11 s BeginTime hold (cred_expire + 1).
    Not within the second its last incarnation ended, though: slurmd revokes the job's
    credential at the end of a run and refuses a new one created in that same second
    ("Killing non-startable batch job: Job credential revoked", the job then ends FAILED)."""
    import slurmtools

    time.sleep(2)
    slurmtools.release_now(job_id)


def requeued_and_released(job_id: str, timeout: float = 90) -> None:
    import slurmtools

    slurmtools.wait_state(job_id, {"PENDING"}, timeout=timeout)
    release(job_id)


def preempt(job_id: str, tmp_path: Path, name: str) -> str:
    """A `high` job that needs both nodes: partition-priority preemption of ours."""
    import slurmtools

    return slurmtools.submit("#!/bin/bash\nsleep 1\n", "--partition=high", "--nodes=2",
                             "--ntasks-per-node=2", "--time=2", f"--job-name={name}",
                             f"--output={tmp_path / (name + '.out')}", cwd=tmp_path)


def wait_high(folder: Path, timeout: float = 300) -> str:
    """The id of the `high` job the hook submitted; waits until it has run."""
    import slurmtools

    f = folder / "high.id"
    high = poll("the hook's high job id", timeout, lambda: f.is_file() and f.read_text().strip())
    slurmtools.submitted.append(high)
    assert slurmtools.wait_done(high, timeout=timeout) == "COMPLETED"
    return high


def preempt_and_finish(run: Path, job_id: str, tmp_path: Path, name: str) -> dict[str, Any]:
    """Preempt the running job with a `high` job on both nodes, check the stop it recorded (a
    preemption, requeued), start it again once the high job is done and wait until it completes.
    Returns the stop record."""
    import slurmtools

    high = preempt(job_id, tmp_path, name)
    stop = wait_stop(run, 1, job_id)
    assert stop["reason"] == "preemption" and stop["requeued"] is True, stop
    slurmtools.wait_state(job_id, {"PENDING"}, timeout=90)
    assert slurmtools.wait_done(high, timeout=180) == "COMPLETED"
    release(job_id)
    assert slurmtools.wait_done(job_id, 600) == "COMPLETED"
    return stop


def task_pids(job_id: str) -> dict[int, int]:
    """Task id -> pid of the job's step processes (`scontrol listpids JOB NODE`)."""
    pids = {}
    for node in ("n1", "n2"):
        out = subprocess.run(["scontrol", "listpids", job_id, node], capture_output=True,
                             text=True, timeout=30).stdout
        for line in out.splitlines()[1:]:
            pid, _, step, _, task = (line.split() + [""] * 5)[:5]
            if step.isdigit() and task.isdigit():
                pids[int(task)] = int(pid)
    return pids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def signal_events(run: Path, restart: int) -> list[tuple[int, str, int, int]]:
    """(rank, signal, step when it arrived, step the ranks stopped at), sorted by rank."""
    return sorted((e["rank"], e["signal"], e["at_step"], e["stop_step"])
                  for e in events(run, "signal") if e["restart"] == restart)


class Reference:
    """The uninterrupted run: 4 local ranks, started early (it runs while job S's slowed first
    incarnation mostly sleeps) and shared by both jobs."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.ranks, self.took = folder, None, 0.0

    def start(self) -> None:
        if self.ranks is None:
            job = job_file(self.folder)
            self.ranks = Ranks([str(job), "--run-dir", str(self.folder / "run")], 4,
                               self.folder / "logs", job_id=None)

    def run_dir(self) -> Path:
        self.start()
        assert self.ranks is not None
        if not self.took:
            codes = self.ranks.wait(900)
            assert codes == [0] * 4, self.ranks.output()
            self.took = time.monotonic() - self.ranks.started
        return self.folder / "run"


def assert_same_as_reference(run: Path, ref: Path) -> dict[str, int]:
    """Bit-exact: final model and optimizer, and the loss of every logged step, replays too."""
    model, opt = final_state(run)
    ref_model, ref_opt = final_state(ref)
    assert_bit_equal(model, ref_model, "model")
    assert_bit_equal(opt["state"], ref_opt["state"], "optimizer")
    expected = {r["step"]: r["loss"] for r in train_records(ref)}
    assert sorted(expected) == list(range(1, STEPS + 1))
    records = train_records(run)
    assert {r["step"] for r in records} == set(expected)
    wrong = [(r["step"], r["restart"], r["loss"], expected[r["step"]]) for r in records
             if r["loss"] != expected[r["step"]]]
    assert not wrong, f"losses differ (step, restart, loss, reference): {wrong[:10]}"
    def evals(d: Path) -> dict[int, float]:
        return {r["step"]: r["eval_acc"] for r in lines(d / "metrics.jsonl") if r.get("kind") == "eval"}
    assert evals(run) == evals(ref) and len(evals(ref)) == STEPS // 50
    return {"records": len(records), "replayed": len(records) - STEPS}


def assert_signalled_stop(run: Path, stop: dict[str, Any], restart: int, signal_name: str) -> int:
    """The ranks that had the signal by the stop (SLURM signals the nodes one after the other: on
    a busy machine the vote of the first node's ranks can stop the job before the other node's
    slurmd delivers it, and a rank stopped by the vote records no signal) stopped at most one
    optimizer step after it arrived (the step in flight) plus the overlapped vote's LAG, all at
    the same step, and the next
    start resumed exactly there: the work lost is nothing but the unfinished part of that step,
    which the stop finished instead."""
    sig = signal_events(run, restart)
    ranks = [r for r, *_ in sig]
    assert sig and all(s == signal_name for _, s, _, _ in sig), sig
    assert len(set(ranks)) == len(ranks) and set(ranks) <= set(range(4)), sig  # once per rank
    assert {stop_step for *_, stop_step in sig} == {stop["step"]}, sig
    assert all(0 <= stop_step - at_step <= 1 + LAG for _, _, at_step, stop_step in sig), sig
    starts = events(run, "start")  # the checkpoint of the stop step is the one resumed from
    assert starts[restart + 1]["resumed_step"] == stop["step"], starts
    return max(stop_step - at_step for _, _, at_step, stop_step in sig)


def where(step: int) -> str:
    epoch, pos = divmod(step, STEPS_PER_EPOCH)
    return f"step {step} (epoch {epoch}, {pos}/{STEPS_PER_EPOCH} into it)"


# ------------------------------------------------------------------ job S: ddpjob sbatch + sbatch
@pytest.mark.cluster
@pytest.mark.slow
def test_sbatch_job_through_time_limit_preemption_and_a_killed_rank_is_bit_exact(
        slurm_cluster: Any, tmp_path: Path, reference: Reference) -> None:
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    t0 = time.monotonic()
    times: dict[str, float] = {}
    run = tmp_path / "run"
    job = job_file(tmp_path, max_failures=0)  # the killed rank ends the job: `ddpjob resume` takes it on
    ddpjob("sbatch", str(job), "--time", "00:02:00", "-o", str(tmp_path / "job.sbatch"),
           "--run-dir", str(run), "--set", "train.tensorboard=true", cwd=tmp_path)
    script = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --signal=USR2@60" in script and "#SBATCH --time=00:02:00" in script
    # First incarnation: 0.25 s of sleep per micro-step, so that it is still training when the
    # warning comes (SLURM sends it 60-90 s before the limit: 30-60 s after the start).
    actions = tmp_path / "actions"  # the next incarnation's at-step action (example_slurm_hooks)
    jid = slurmtools.submit(tmp_path / "job.sbatch", cwd=tmp_path,
                            env=job_env(DDPJOB_TEST_SLOW="0.25:0", DDPJOB_TEST_ACTIONS=str(actions)))

    # 1. the time-limit warning (USR2 to every task), mid-run
    wait_step(run, 1, restart=0, job_id=jid)
    reference.start()
    stop1 = wait_stop(run, 1, jid, timeout=300)
    times["time-limit warning"] = time.monotonic() - t0
    assert stop1["reason"] == "time_limit" and stop1["requeued"] is True, stop1
    # No more warnings after this: the next incarnations get 10 minutes.
    slurmtools.wait_state(jid, {"PENDING"}, timeout=90)
    subprocess.run(["scontrol", "update", f"jobid={jid}", "TimeLimit=10"], check=True, timeout=30)
    # 2. partition-priority preemption, caused at a step: rank 0 submits the `high` job when
    # step stop1 + 15 is handed out and waits in it for the SIGTERM.
    at2 = stop1["step"] + 15
    actions.write_text(f"1 {at2} 0 preempt {tmp_path / 'high.id'}\n")
    release(jid)
    stop2 = wait_stop(run, 2, jid)
    times["preemption"] = time.monotonic() - t0
    assert stop2["reason"] == "preemption" and stop2["requeued"] is True, stop2
    assert stop2["step"] == at2 + 1 + LAG, stop2  # the step in flight, the vote's, then the stop
    slurmtools.wait_state(jid, {"PENDING"}, timeout=90)
    wait_high(tmp_path)

    # 3. rank 2 SIGKILLed right after step `target` (job.steps hands out 0-based indices: index
    # `target` begins step target + 1), 4 steps past the last periodic save
    target = stop2["step"] + 12
    target += (4 - target) % EVERY  # a step ending in 4
    marker = tmp_path / "kill"
    actions.write_text(f"2 {target} 2 kill {marker}\n")
    release(jid)
    poll("rank 2 at the kill step", 300, (marker.parent / "kill.ready").is_file, jid)
    pids = task_pids(jid)
    assert sorted(pids) == [0, 1, 2, 3], pids
    assert "ddpjob" in Path(f"/proc/{pids[2]}/cmdline").read_text()
    (marker.parent / "kill.go").write_text("")
    killed_at = time.monotonic()
    poll("every task of the job to exit", 90, lambda: not any(alive(p) for p in pids.values()))
    all_gone_s = time.monotonic() - killed_at
    assert slurmtools.wait_done(jid, timeout=120) == "FAILED"
    job_gone_s = time.monotonic() - killed_at
    times["rank killed"] = killed_at - t0
    last_logged = max(r["step"] for r in train_records(run) if r["restart"] == 2)
    assert all_gone_s < 60, f"tasks still running {all_gone_s:.1f} s after one was killed"

    # 4. requeued by hand: resumes from the newest periodic checkpoint, replays, finishes
    slurmtools.requeue(jid)
    release(jid)
    assert slurmtools.wait_done(jid, timeout=400) == "COMPLETED"
    times["completed"] = time.monotonic() - t0

    starts = events(run, "start")
    assert [(s["restart"], s["world_size"], s["accumulation"]) for s in starts] == \
        [(r, 4, 2) for r in range(4)]
    resumed = starts[3]["resumed_step"]
    assert last_logged == target, (last_logged, target)
    # the periodic checkpoint 4 steps back, or the one before if its async commit was not done
    assert resumed in (target - 4, target - 4 - EVERY), (resumed, target)
    lost = {"time-limit": assert_signalled_stop(run, stop1, 0, "SIGUSR2"),
            "preemption": assert_signalled_stop(run, stop2, 1, "SIGTERM")}
    assert events(run, "stop")[-1]["reason"] == "finished" and (run / "COMPLETED").is_file()
    assert any(s % STEPS_PER_EPOCH for s in (stop1["step"], stop2["step"], last_logged))

    ref = reference.run_dir()
    counts = assert_same_as_reference(run, ref)
    assert counts["replayed"] >= last_logged - resumed
    assert_goodput_ledger(run, jid, tmp_path, replayed=[0, 0, 0, last_logged - resumed])
    # TensorBoard (train.tensorboard) across the 3 requeues, as its own reader sees RUN_DIR/tb:
    # one series, every step once although the killed incarnation logged steps it replayed
    import numpy as np

    from ranks import tensorboard_scalars

    series = tensorboard_scalars(run, "train/loss")
    assert [step for step, _ in series] == list(range(1, STEPS + 1))
    losses = {r["step"]: r["loss"] for r in train_records(run)}  # the newest record of each step
    assert [v for _, v in series] == [float(np.float32(losses[s])) for s, _ in series]
    assert len(list((run / "tb").iterdir())) == 4  # one event file per incarnation
    # The sample-id log across 4 incarnations: steps trained twice count once (the newest), every
    # sample once per epoch, each step the samples of the uninterrupted run.
    samples = sample_log(run)
    assert_each_sample_once_per_epoch(samples, STEPS, samples=DATA["synthetic_train"],
                                      global_batch=DATA["synthetic_train"] // STEPS_PER_EPOCH)
    replayed = set(range(resumed + 1, last_logged + 1))
    assert {s for s, r in samples.items() if r["restart"] == 3} >= replayed
    assert {s: sorted(r["ids"]) for s, r in samples.items()} == \
        {s: sorted(r["ids"]) for s, r in sample_log(ref).items()}
    print(f"\njob S (sbatch) {jid}: time-limit warning -> stop at {where(stop1['step'])}; "
          f"preemption -> stop at {where(stop2['step'])}; rank 2 SIGKILLed after "
          f"{where(last_logged)} was logged: all 4 tasks gone {all_gone_s:.1f} s later, job "
          f"FAILED {job_gone_s:.1f} s later; resumed from checkpoint {resumed}, "
          f"{counts['replayed']} step(s) trained twice with identical losses; steps run after a "
          f"signal arrived: {lost}; phases at {json.dumps({k: round(v) for k, v in times.items()})} s; "
          f"reference took {reference.took:.0f} s")


def assert_goodput_ledger(run: Path, jid: str, cwd: Path, *, replayed: list[int]) -> dict[str, Any]:
    """`status --json`'s goodput ledger against sacct's own record of the job's starts: one
    attempt per start, its times SLURM's within 1 s, the queue wait sacct's, the categories
    adding up to the wall time, and the replayed steps the ones re-run."""
    import slurmtools

    gp = json.loads(ddpjob("status", str(run), "--json", cwd=cwd).stdout)["goodput"]
    assert abs(sum(gp["seconds"].values()) - gp["wall_s"]) <= 0.01 * gp["wall_s"], gp
    rows = slurmtools.sacct_times(jid)  # (submit, start, end) per start, oldest first
    attempts = gp["attempts"]
    assert [a["job_id"] for a in attempts] == [jid] * len(rows), (attempts, rows)
    for a, (_, start, end) in zip(attempts, rows):
        assert abs(a["begin"] - start) <= 1 and abs(a["end"] - end) <= 1, (a, start, end)
    assert abs(gp["seconds"]["queue"] - sum(start - submit for submit, start, _ in rows)) <= 1 + len(rows), (gp, rows)
    assert [a["replayed_steps"] for a in attempts] == replayed, attempts
    assert gp["replayed_steps"] == sum(replayed) and (gp["seconds"]["replayed"] > 0) == (sum(replayed) > 0)
    for cat in ("start-up", "load", "productive", "checkpoint", "eval", "stop and save"):
        assert gp["seconds"][cat] > 0, (cat, gp)
    assert 0 < gp["goodput"] < 1
    print(f"\ngoodput ledger of job {jid}: " + ", ".join(f"{k} {v:.1f} s" for k, v in gp["seconds"].items()))
    return gp


# ------------------------------------------------------------------ job M: ddpjob submit (submitit)
@pytest.mark.cluster
@pytest.mark.slow
def test_submitit_job_through_scancel_usr2_scontrol_requeue_and_preemption_is_bit_exact(
        slurm_cluster: Any, tmp_path: Path, reference: Reference) -> None:
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    reference.start()
    t0 = time.monotonic()
    times: dict[str, float] = {}
    run = tmp_path / "run"
    job = job_file(tmp_path)
    # Rank 1, first incarnation, training forward call 49 = step 25, micro-step 1 of 2.
    actions = tmp_path / "actions"  # the next incarnation's at-step action (example_slurm_hooks)
    ddpjob("submit", str(job), "--backend", "slurm", "--run-dir", str(run), cwd=tmp_path,
           env=job_env(DDPJOB_TEST_SIGNAL="1:49:0:scancel", DDPJOB_TEST_ACTIONS=str(actions)))
    jid = json.loads((run / "job.json").read_text())["job_id"]
    slurmtools.submitted.append(jid)  # conftest cancels what a failed test leaves

    # 1. scancel --signal=USR2 during the first micro-step of step 25: all ranks stop at 25 + LAG
    stop1 = wait_stop(run, 1, jid, timeout=300)
    times["scancel USR2"] = time.monotonic() - t0
    # USR2 is the job's time-limit warning signal, whoever sends it
    assert stop1["reason"] == "time_limit" and stop1["requeued"] is True and stop1["step"] == 25 + LAG, stop1
    # every rank records the signal it had when the vote said stop, before the save: the ranks
    # that had one had USR2 from step 25 on (SLURM signals node after node: on a busy machine
    # the other node's ranks may stop by the vote before it comes, and record none)
    sig = signal_events(run, 0)
    assert sig and all(s == "SIGUSR2" and 24 <= at <= stop_at == 25 + LAG for _, s, at, stop_at in sig), sig
    # 2. scontrol requeue (SIGTERM now, SIGKILL after KillWait), run by rank 1 when step 45 is
    # handed out; it waits in that step until the SIGTERM is recorded
    actions.write_text("1 45 1 requeue\n")
    requeued_and_released(jid)
    stop2 = wait_stop(run, 2, jid)
    times["scontrol requeue"] = time.monotonic() - t0
    # SIGTERM with no PreemptTime: a plain signal, not a preemption (SLURM requeues it itself)
    assert stop2["reason"] == "signal" and stop2["requeued"] is None, stop2
    assert "already requeued" in stop2["note"]
    assert stop2["step"] == 45 + 1 + LAG, stop2

    # 3. partition-priority preemption caused by rank 0 at step stop2 + 20; NodeTask / the runner
    # requeue within GraceTime
    at3 = stop2["step"] + 20
    actions.write_text(f"2 {at3} 0 preempt {tmp_path / 'high.id'}\n")
    requeued_and_released(jid)
    stop3 = wait_stop(run, 3, jid)
    times["preemption"] = time.monotonic() - t0
    assert stop3["reason"] == "preemption" and stop3["requeued"] is True, stop3
    assert stop3["step"] == at3 + 1 + LAG, stop3
    slurmtools.wait_state(jid, {"PENDING"}, timeout=90)
    wait_high(tmp_path)
    release(jid)
    assert slurmtools.wait_done(jid, timeout=400) == "COMPLETED"
    times["completed"] = time.monotonic() - t0

    starts = events(run, "start")
    assert [s["resumed_step"] for s in starts] == [None, 25 + LAG, stop2["step"], stop3["step"]]
    lost = {"scancel USR2": assert_signalled_stop(run, stop1, 0, "SIGUSR2"),
            "scontrol requeue": assert_signalled_stop(run, stop2, 1, "SIGTERM"),
            "preemption": assert_signalled_stop(run, stop3, 2, "SIGTERM")}
    counts = assert_same_as_reference(run, reference.run_dir())
    assert counts["replayed"] == 0  # signalled stops only: no step is trained twice
    log0 = (run / "logs" / f"{jid}_0_log.out").read_text()
    assert re.search(r"this rank got SIGUSR2 during step 25\b", log0), log0[-2000:]
    print(f"\njob M (submitit) {jid}: scancel --signal=USR2 -> stop at {where(25 + LAG)} (rank 1 "
          f"mid-accumulation: micro-step 1 of 2); scontrol requeue -> stop at "
          f"{where(stop2['step'])}; preemption -> stop at {where(stop3['step'])}; steps run after "
          f"a signal arrived: {lost}; phases at "
          f"{json.dumps({k: round(v) for k, v in times.items()})} s")
