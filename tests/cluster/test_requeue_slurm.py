"""rank/requeue.py on the real SLURM test cluster: a job whose ranks cannot run `scontrol requeue`
comes back through a successor job after a preemption, bit-identical to an uninterrupted run; a
crash, and a node failure nobody saw, are retried within slurm.max_failures and stay FAILED
without it. Every stop is caused at
a chosen step (partition-priority preemption once a step is reached; a crash at a forward call)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from clirun import wait_for
from ranks import LAG, write_job
from runlogs import decisions
from test_preemption_slurm import (CHECKPOINT, DATA, SLURM, TRAIN, Reference, assert_same_as_reference, ddpjob,
                                   events, job_env, job_file, preempt, preempt_and_finish, release, wait_step,
                                   wait_stop)


def fake_scontrol(folder: Path) -> Path:
    """A bin dir whose scontrol refuses `requeue` like a site that disabled it; the rest is real."""
    real = shutil.which("scontrol")
    folder.mkdir()
    (folder / "scontrol").write_text(
        "#!/bin/sh\nif [ \"$1\" = requeue ]; then\n"
        "  echo 'scontrol: error: Requeue of job is disabled' >&2; exit 1\nfi\n"
        f"exec {real} \"$@\"\n")
    (folder / "scontrol").chmod(0o755)
    return folder


def sbatch(tmp_path: Path, job: Path, **env: str) -> tuple[Path, str]:
    import slurmtools

    run = tmp_path / "run"
    ddpjob("sbatch", str(job), "-o", str(tmp_path / "job.sbatch"), "--run-dir", str(run), cwd=tmp_path)
    return run, slurmtools.submit(tmp_path / "job.sbatch", cwd=tmp_path, env=job_env(**env))


@pytest.mark.cluster
@pytest.mark.slow
def test_preempted_job_without_scontrol_requeue_comes_back_as_a_successor(
        slurm_cluster: Any, tmp_path: Path, reference: Reference) -> None:
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    reference.start()
    bin_dir = fake_scontrol(tmp_path / "bin")
    run, jid = sbatch(tmp_path, job_file(tmp_path, setup=[f"export PATH={bin_dir}:$PATH"]),
                      DDPJOB_TEST_SLOW="0.05:0")
    wait_step(run, 30, 0, jid)
    high = preempt(jid, tmp_path, "high-successor")
    stop = wait_stop(run, 1, jid)
    assert stop["reason"] == "preemption" and stop["requeued_by"] == "successor", stop
    assert "Requeue of job is disabled" in stop["note"], stop
    new = str(stop["next_job_id"])
    slurmtools.submitted.append(new)
    slurmtools.wait_done(high, 300)
    assert slurmtools.wait_done(new, 900) == "COMPLETED"
    starts = events(run, "start")
    assert [s["job_id"] for s in starts] == [jid, new] and starts[1]["restart"] == 1, starts
    assert starts[1]["resumed_step"] == stop["step"]
    assert [e["reason"] for e in decisions(events(run))] == ["preemption", "finished"]
    assert_same_as_reference(run, reference.run_dir())
    status = ddpjob("status", str(run), cwd=tmp_path).stdout
    assert f"successor -> job {new}" in status and new in status, status


@pytest.mark.cluster
@pytest.mark.parametrize("max_failures, final", [(1, "COMPLETED"), (0, "FAILED")])
def test_a_crash_is_retried_only_within_max_failures(slurm_cluster: Any, tmp_path: Path,
                                                     max_failures: int, final: str) -> None:
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    job = write_job(tmp_path / "job.toml", train={**TRAIN, "max_steps": 40}, data=DATA,
                    checkpoint=CHECKPOINT,
                    slurm={**SLURM, "nodes": 1, "tasks_per_node": 2, "max_failures": max_failures,
                           "retry_user_errors": True})  # the budget is what this tests, not the verdict
    # rank 1 raises in its 25th training forward call (step 13), first incarnation only
    run, jid = sbatch(tmp_path, job, DDPJOB_TEST_SIGNAL="1:25:0:crash")
    assert slurmtools.wait_done(jid, 600) == final
    stops = decisions(events(run))
    crash = [e for e in stops if e["reason"] == "crash"]
    assert len(crash) == 1 and crash[0]["requeued"] is (True if max_failures else None), stops
    assert (stops[-1]["reason"] == "finished") is bool(max_failures), stops
    if max_failures:  # retried inside the allocation: the same job, never requeued, no queue wait
        assert crash[0]["requeued_by"] == "in_allocation", crash
        assert slurmtools.job_info(jid)["Restarts"] == "0"
        starts = events(run, "start")
        assert [(s["job_id"], s["restart"]) for s in starts] == [(jid, 0), (jid, 1)], starts
        assert starts[1]["resumed_step"] == crash[0]["step"] == 10  # the newest checkpoint


@pytest.mark.cluster
@pytest.mark.slow
def test_kill_9_of_one_rank_restarts_inside_the_allocation_bit_exact(
        slurm_cluster: Any, tmp_path: Path, reference: Reference) -> None:
    """A rank SIGKILLed (no ddpjob code runs on its way down) on 2 nodes x 2 tasks: srun ends the
    others, the batch script's decision runs the ranks again in the same allocation, the same job
    id finishes from the newest checkpoint, bit-equal to the uninterrupted run."""
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    reference.start()
    # rank 2's 67th training forward call: micro-step 1 of step 34, 3 steps past the checkpoint at 30
    run, jid = sbatch(tmp_path, job_file(tmp_path, max_failures=1), DDPJOB_TEST_SIGNAL="2:67:0:kill")
    assert slurmtools.wait_done(jid, 900) == "COMPLETED"
    stops = decisions(events(run))
    assert [e["reason"] for e in stops] == ["crash", "finished"], stops
    crash = stops[0]
    assert crash["requeued_by"] == "in_allocation" and crash["step"] == 30 and crash["steps_lost"] == 3, crash
    assert slurmtools.job_info(jid)["Restarts"] == "0"  # never through the queue
    starts = events(run, "start")
    assert [(s["job_id"], s["restart"], s["resumed_step"]) for s in starts] == [(jid, 0, None), (jid, 1, 30)]
    assert_same_as_reference(run, reference.run_dir())
    status = ddpjob("status", str(run), cwd=tmp_path).stdout
    assert "crash at step 30" in status and "restarted inside the allocation" in status, status


@pytest.mark.cluster
@pytest.mark.slow
def test_kill_9_resumes_from_the_in_memory_snapshot_inside_the_allocation(
        slurm_cluster: Any, tmp_path: Path, reference: Reference) -> None:
    """The same kill -9 of rank 2 in step 34, with checkpoint.snapshot_every = 2: every rank's
    state of step 32 is in /dev/shm (the kill waits until it is committed), so the restart
    inside the allocation resumes from step 32, not the checkpoint of step 30: 1 step lost, the
    final state bit-equal to the uninterrupted run, nothing of the job left in /dev/shm."""
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    reference.start()
    job = write_job(tmp_path / "job.toml", slurm={**SLURM, "max_failures": 1}, train=TRAIN, data=DATA,
                    checkpoint={**CHECKPOINT, "snapshot_every": 2})
    run, jid = sbatch(tmp_path, job, DDPJOB_TEST_SIGNAL="2:67:0:kill", DDPJOB_TEST_SNAP_WAIT="32")
    assert slurmtools.wait_done(jid, 900) == "COMPLETED"
    stops = decisions(events(run))
    assert [e["reason"] for e in stops] == ["crash", "finished"], stops
    crash = stops[0]
    assert (crash["step"], crash["steps_lost"], crash["failed_rank"], crash["failed_host"]) == (32, 1, 2, "n2"), crash
    starts = events(run, "start")
    assert [(s["job_id"], s["resumed_step"]) for s in starts] == [(jid, None), (jid, 32)], starts
    assert_same_as_reference(run, reference.run_dir())
    assert not list(Path("/dev/shm").glob(f"ddpjob-{os.getuid()}/{jid}-*")), "snapshots left behind"
    # The goodput ledger: two attempts in one start of the job, the second from where the first
    # ended (no queue between them), replaying the step the crash lost
    gp = json.loads(ddpjob("status", str(run), "--json", cwd=tmp_path).stdout)["goodput"]
    (submit, start, end), = slurmtools.sacct_times(jid)
    first, second = gp["attempts"]
    assert (first["job_id"], second["job_id"]) == (jid, jid), gp["attempts"]
    assert abs(first["begin"] - start) <= 1 and abs(second["end"] - end) <= 1, (gp["attempts"], start, end)
    assert first["end"] == second["begin"] and first["ended_by"] == "crash", gp["attempts"]
    assert [a["replayed_steps"] for a in gp["attempts"]] == [0, crash["steps_lost"]], gp["attempts"]
    assert abs(gp["seconds"]["queue"] - (start - submit)) <= 1, gp
    assert gp["seconds"]["replayed"] > 0 and gp["seconds"]["checkpoint"] > 0, gp
    assert abs(sum(gp["seconds"].values()) - gp["wall_s"]) <= 0.01 * gp["wall_s"], gp


@pytest.mark.cluster
@pytest.mark.slow
def test_submitit_kill_9_restarts_inside_the_allocation_from_the_in_memory_snapshot(
        slurm_cluster: Any, tmp_path: Path, reference: Reference) -> None:
    """The same kill -9 of rank 2 in step 34 through `ddpjob submit`: submitit's srun line goes
    through the batch shell's restart loop (slurmopts.batch_shell_lines' ddpjob_srun), so the same job id
    runs the ranks again in its allocation, from the snapshot of step 32, with no requeue."""
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    reference.start()
    job = write_job(tmp_path / "job.toml", slurm={**SLURM, "max_failures": 1}, train=TRAIN, data=DATA,
                    checkpoint={**CHECKPOINT, "snapshot_every": 2})
    run = tmp_path / "run"
    ddpjob("submit", str(job), "--backend", "slurm", "--run-dir", str(run), cwd=tmp_path,
           env=job_env(DDPJOB_TEST_SIGNAL="2:67:0:kill", DDPJOB_TEST_SNAP_WAIT="32"))
    jid = json.loads((run / "job.json").read_text())["job_id"]
    slurmtools.submitted.append(jid)  # conftest cancels what a failed test leaves
    assert slurmtools.wait_done(jid, 900) == "COMPLETED"
    stops = decisions(events(run))
    assert [e["reason"] for e in stops] == ["crash", "finished"], stops
    crash = stops[0]
    assert (crash["step"], crash["steps_lost"], crash["failed_rank"]) == (32, 1, 2), crash
    assert crash["requeued_by"] == "in_allocation", crash
    starts = events(run, "start")
    assert [(s["job_id"], s["resumed_step"]) for s in starts] == [(jid, None), (jid, 32)], starts
    assert len(slurmtools.sacct_times(jid)) == 1  # one start of the job: never requeued
    batch = (run / "logs" / f"{jid}_0_log.err").read_text()
    assert "ddpjob: attempt 0: ranks on 2 node(s)" in batch and "ddpjob: attempt 1: ranks on 2 node(s)" in batch
    assert_same_as_reference(run, reference.run_dir())
    assert not list(Path("/dev/shm").glob(f"ddpjob-{os.getuid()}/{jid}-*")), "snapshots left behind"


def node_pids(job_id: str, node: str) -> list[int]:
    """Every process of the job on `node` (`scontrol listpids`: ranks and their children)."""
    out = subprocess.run(["scontrol", "listpids", job_id, node], capture_output=True, text=True,
                         timeout=30).stdout
    return [int(line.split()[0]) for line in out.splitlines()[1:] if line.split()[:1] != [] and line.split()[0].isdigit()]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def node_down(job_id: str, *, freeze: bool) -> list[int]:
    """Node n2 fails. freeze: as a dead node does, everything on it stops dead (SIGSTOP of its
    slurmd, the job's slurmstepd there and the ranks: no handler runs, and SLURM's SIGCONT
    cannot wake them), so no ddpjob code runs on the way down. Otherwise the controller marks
    n2 DOWN while its ranks live (an admin, a health check) and they get SIGTERM. Either way
    SLURM ends the attempt NODE_FAIL and requeues the --requeue job by itself. Returns the
    processes to kill when the node comes back."""
    import slurmtools

    ranks = node_pids(job_id, "n2")
    assert ranks, "no process of the job on n2"
    frozen: list[int] = []
    if freeze:
        cluster = Path(os.environ.get("DDPJOB_CLUSTER_DIR", "/var/lib/ddpjob-test-cluster"))
        slurmd = int((cluster / "run" / "slurmd-n2.pid").read_text().strip())
        stepds = {_parent(p) for p in ranks} - set(ranks)
        stepds = {p for p in stepds if Path(f"/proc/{p}/comm").read_text().strip() == "slurmstepd"}
        frozen = [slurmd, *sorted(stepds), *ranks]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
    slurmtools._run(["scontrol", "update", "nodename=n2", "state=down", "reason=ddpjob-test-node-failure"])
    return frozen


def node_up(frozen: list[int]) -> None:
    """n2 comes back empty: the frozen job processes are killed, its slurmd goes on (SIGCONT)
    and the node is resumed; tests/cluster/start.sh waits until both nodes take jobs again."""
    import slurmtools

    slurmd, rest = (frozen[0], frozen[1:]) if frozen else (None, [])
    for pid in rest:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if slurmd is not None:
        os.kill(slurmd, signal.SIGCONT)
    slurmtools._run(["scontrol", "update", "nodename=n2", "state=resume"], check=False)
    if frozen:
        out = subprocess.run(["bash", str(Path(__file__).parent / "start.sh")],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize("max_failures, freeze, final", [(1, True, "COMPLETED"), (0, False, "FAILED")],
                         ids=["dead-node-retried", "node-down-budget-spent"])
def test_a_failed_node_is_a_node_failure_that_spends_max_failures(
        slurm_cluster: Any, tmp_path: Path, reference: Reference, max_failures: int, freeze: bool,
        final: str) -> None:
    """A dead node: nothing is recorded on the way down; the next start asks sacct (NODE_FAIL)
    and records it, resumes from the checkpoint at step 20 and ends bit-identical. A node set
    DOWN under living ranks: they checkpoint at their stop, which records the node failure;
    with max_failures = 0 the next start is refused with one line and the job ends FAILED."""
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    if max_failures:
        reference.start()
    # rank 2 (on n2) waits in its 55th training forward call (step 27; checkpoint at step 20)
    # until the stop signal reaches it: the node fails exactly there
    run, jid = sbatch(tmp_path, job_file(tmp_path, max_failures=max_failures),
                      DDPJOB_TEST_SIGNAL="2:55:0:pause")
    slurmtools.read_when(run / "logs" / "rank-2.log", "paused at call 55", timeout=300)
    pids = node_down(jid, freeze=freeze)
    try:
        slurmtools.wait_state(jid, {"PENDING"}, timeout=120)
        assert slurmtools.job_info(jid).get("Restarts") == "1"
        if not freeze:
            # n2 answered throughout, and its slurmd may still be ending the killed attempt (it
            # kills every step of the job id until none is left, a new attempt's too): n2 stays
            # DOWN, so the job cannot start there, until none of the job's processes is left
            wait_for(lambda: not node_pids(jid, "n2"), timeout=120, poll=0.5, what=f"job {jid}'s processes on n2 to end")
    finally:
        node_up(pids)
    if freeze:
        release(jid)
    assert slurmtools.wait_done(jid, 900) == final
    stops = decisions(events(run))
    failure = stops[0]
    assert (failure["reason"], failure["job_id"], failure["restart"]) == ("node_failure", jid, 0), stops
    assert failure["requeued_by"] == "slurm" and failure["requeued"] is True, failure
    if freeze:  # recorded at the next start: lost what was trained past the checkpoint
        assert (failure["step"], failure["steps_lost"]) == (20, 7), failure
        assert "sacct says NODE_FAIL" in failure["note"], failure
    else:  # recorded by rank 0 at the stop, with the checkpoint of that step
        assert (failure["step"], failure["steps_lost"]) == (28 + LAG, 0), failure
    status = ddpjob("status", str(run), cwd=tmp_path).stdout
    assert f"node_failure at step {failure['step']} (job {jid})" in status, status
    rec = json.loads(ddpjob("status", str(run), "--json", cwd=tmp_path).stdout)
    assert rec["stops"][0]["reason"] == "node_failure" and rec["state"] == final, rec
    assert rec["restarts"] == 1 and rec["completed"] is bool(max_failures), rec
    if max_failures:
        assert [s["reason"] for s in stops] == ["node_failure", "finished"], stops
        starts = events(run, "start")
        assert [s["resumed_step"] for s in starts] == [None, failure["step"]], starts
        assert_same_as_reference(run, reference.run_dir())
    else:
        assert [s["reason"] for s in stops] == ["node_failure", "budget"], stops
        log = (run / "logs" / "rank-0.log").read_text()
        assert ("ddpjob: error: this is restart 1 of run run: 1 failure(s) retried, more than "
                "slurm.max_failures = 0") in log, log[-3000:]
        assert len(events(run, "start")) == 1  # the refused attempt trained nothing
        assert (f"start refused (job {jid}): 1 failure(s) retried, more than slurm.max_failures = 0"
                in status), status


@pytest.mark.cluster
@pytest.mark.slow
def test_code_edited_after_submission_never_reaches_the_job(
        slurm_cluster: Any, tmp_path: Path, reference: Reference) -> None:
    """The entry script (the built-in trainer called from a user's script) and its model plugin
    are broken on disk right after `sbatch` (a raise at their top): every incarnation imports the
    copies frozen at submission, so the job is preempted, requeued and ends bit-identical to an
    uninterrupted run; status says the code on disk has moved on."""
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    reference.start()
    code = tmp_path / "code"
    code.mkdir()
    shutil.copy(Path(__file__).parents[1] / "trainer_plugins.py", code / "my_plugins.py")
    (code / "train.py").write_text("from ddpjob.train.trainer import main\n\nmain()\n")
    env = job_env(DDPJOB_TEST_SLOW="0.05:0")
    env["PYTHONPATH"] = os.pathsep.join([str(code), env["PYTHONPATH"]])
    job = write_job(tmp_path / "job.toml", slurm=SLURM, data=DATA, checkpoint=CHECKPOINT,
                    train={**TRAIN, "model": "my_plugins:signalling_cnn", "entry": str(code / "train.py")})
    run = tmp_path / "run"
    ddpjob("sbatch", str(job), "-o", str(tmp_path / "job.sbatch"), "--run-dir", str(run), cwd=tmp_path, env=env)
    jid = slurmtools.submit(tmp_path / "job.sbatch", cwd=tmp_path, env=env)
    for name in ("train.py", "my_plugins.py"):
        source = (code / name).read_text()
        (code / name).write_text(f'raise RuntimeError("{name} edited after submission")\n' + source)
    wait_step(run, 30, 0, jid)
    preempt_and_finish(run, jid, tmp_path, "high-frozen")
    assert_same_as_reference(run, reference.run_dir())
    status = ddpjob("status", str(run), cwd=tmp_path, env=env).stdout
    assert "(frozen at submission; the code on disk has changed since)" in status, status
