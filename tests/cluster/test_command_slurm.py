"""A plain torchrun-style script as the entry ([train] command, docs/commands.md) on the real
SLURM test cluster: tests/command_scripts/plain_train.py on 2 nodes x 1 task, its own checkpoint.

- `ddpjob sbatch` + real sbatch: preempted once by a `high` job on both nodes while rank 1
  pauses after step 7 (SIGTERM reaches the script, it saves and exits 3; rank 0 asks SLURM,
  requeues); the next attempt resumes from the script's checkpoint; COMPLETED; `status` and
  `ls --json` show the attempts and the goodput;
- `ddpjob sbatch`: rank 1 SIGKILLed after step 8: restarted in place inside the allocation,
  resumed from the script's checkpoint of step 5, COMPLETED;
- `ddpjob sbatch`, a script without a SIGTERM handler (nanoGPT's): a SIGKILLed peer, a SIGKILLed
  `ddpjob run` of a peer (no crash record) and a peer's bug each get their verdict;
- `ddpjob submit` (submitit): the same preemption, requeued, COMPLETED from the checkpoint;
- `ddpjob submit`: a ValueError raised by the script on every rank: FAILED, the verdict line
  naming plain_train.py's line, not retried.
Every stop is caused at a step (the script's DDPJOB_TEST_AT hook), never by a timer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

import clirun
from clirun import TESTS, job_env, wait_for, without_job_env
from ranks import write_job
import runlogs
from runlogs import events, lines, rank_crashes
from test_preemption_slurm import preempt, release

pytestmark = pytest.mark.cluster

SCRIPT = TESTS / "command_scripts" / "plain_train.py"
STEPS = 14


def job_file(folder: Path, *flags: str) -> Path:
    return write_job(folder / "job.toml", slurm=dict(nodes=2, tasks_per_node=1, time="00:10:00", max_requeues=3),
                     train=dict(command=[sys.executable, str(SCRIPT), "--out_dir", str(folder / "out"),
                                         "--max_steps", str(STEPS), *flags]))


def ddpjob(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> clirun.subprocess.CompletedProcess:
    return clirun.ddpjob(*argv, cwd=cwd, env=without_job_env(env), timeout=180, check=True)


def rank_log(run: Path, rank: int) -> str:
    """The rank's log: rank-R.log (`ddpjob sbatch`), submitit's JOB_R_log.out/err (`ddpjob submit`)."""
    paths = [run / "logs" / f"rank-{rank}.log", *sorted((run / "logs").glob(f"*_{rank}_log.*"))]
    return "".join(p.read_text(errors="replace") for p in paths if p.is_file())


def decisions(run: Path) -> list[dict[str, Any]]:
    return runlogs.stops(events(run))


def preempted_at_step_7(run: Path, jid: str, tmp_path: Path) -> None:
    """Rank 1 waits after step 7 until its stop signal: a `high` job on both nodes preempts the
    job; the stop is a preemption, requeued; the job starts again once the high job is done."""
    import slurmtools

    wait_for(lambda: "paused at step 7" in rank_log(run, 1), 300, "rank 1 to pause",
             alive=lambda: slurmtools.active(jid), whose=f"job {jid}")
    high = preempt(jid, tmp_path, "high")
    stop = wait_for(lambda: decisions(run), 240, "the preemption's stop")[0]
    assert (stop["reason"], stop["requeued"]) == ("preemption", True), stop
    slurmtools.wait_state(jid, {"PENDING"}, timeout=90)
    assert slurmtools.wait_done(high, timeout=180) == "COMPLETED"
    release(jid)


def assert_resumed(run: Path, at: int) -> None:
    assert f"at step {at}" in rank_log(run, 0) and "resumed from" in rank_log(run, 0), rank_log(run, 0)


def test_sbatch_command_is_preempted_requeued_and_completes(
        slurm_cluster: Any, tmp_path: Path) -> None:
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    run = tmp_path / "run"
    ddpjob("sbatch", str(job_file(tmp_path)), "-o", str(tmp_path / "job.sbatch"), "--run-dir", str(run), cwd=tmp_path)
    # attempt 0: rank 1 pauses after step 7 until the preemption's SIGTERM
    jid = slurmtools.submit(tmp_path / "job.sbatch", cwd=tmp_path,
                            env=job_env(DDPJOB_TEST_AT="1:7:0:pause"))
    preempted_at_step_7(run, jid, tmp_path)
    assert slurmtools.wait_done(jid, 600) == "COMPLETED", rank_log(run, 0) + rank_log(run, 1)
    assert (run / "COMPLETED").is_file()
    assert_resumed(run, 7)
    steps = [(r["restart"], r["step"]) for r in lines(run / "metrics.jsonl")]
    assert steps == [(0, s) for s in range(1, 8)] + [(1, s) for s in range(8, STEPS + 1)], steps
    info = json.loads(ddpjob("status", str(run), "--json", cwd=tmp_path).stdout)
    assert info["state"] == "COMPLETED" and info["restarts"] >= 1, info
    assert [a["restart"] for a in info["goodput"]["attempts"]] == [0, 1], info["goodput"]
    row = json.loads(ddpjob("ls", "--runs-root", str(tmp_path), "--json", cwd=tmp_path).stdout.splitlines()[0])
    assert row["goodput"]["seconds"]["productive"] > 0 and row["state"] == "COMPLETED", row


def test_sbatch_command_with_a_killed_rank_restarts_in_place(slurm_cluster: Any, tmp_path: Path) -> None:
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    run = tmp_path / "run"
    ddpjob("sbatch", str(job_file(tmp_path)), "-o", str(tmp_path / "job.sbatch"), "--run-dir", str(run), cwd=tmp_path)
    jid = slurmtools.submit(tmp_path / "job.sbatch", cwd=tmp_path, env=job_env(DDPJOB_TEST_AT="1:8:0:kill"))
    assert slurmtools.wait_done(jid, 600) == "COMPLETED", rank_log(run, 0) + rank_log(run, 1)
    crash = decisions(run)
    assert len(crash) == 1 and (crash[0]["reason"], crash[0]["verdict"], crash[0]["action"]) == (
        "crash", "infrastructure", "restart"), crash
    assert crash[0]["failed_rank"] == 1 and "SIGKILL" in crash[0]["line"] + crash[0].get("failed_how", ""), crash
    assert_resumed(run, 5)  # the script saves every 5 steps
    assert [r["step"] for r in lines(run / "metrics.jsonl") if r["restart"] == 1] == list(range(6, STEPS + 1))
    text = ddpjob("status", str(run), cwd=tmp_path).stdout
    assert "COMPLETED" in text and "goodput" in text, text


def test_a_script_whose_port_another_program_holds_restarts_in_place_on_another(
        slurm_cluster: Any, tmp_path: Path) -> None:
    """The script's `init_process_group("gloo", init_method="env://")` on the MASTER_PORT ddpjob
    derived, held on rank 0's node by another program before the job starts: its EADDRINUSE
    traceback is the node's doing, not the user's; the restart in place gets another port."""
    import slurmtools
    from ddpjob.node.cluster import port_for_job

    slurmtools.cluster_free(timeout=300)
    run = tmp_path / "run"
    ddpjob("sbatch", str(job_file(tmp_path)), "-o", str(tmp_path / "job.sbatch"), "--run-dir", str(run), cwd=tmp_path)
    jid = slurmtools.submit(tmp_path / "job.sbatch", "--hold", cwd=tmp_path, env=job_env())
    assert slurmtools.done_with_port_held(jid, port_for_job(jid), 600) == "COMPLETED", rank_log(run, 0) + rank_log(run, 1)
    (crash,) = decisions(run)
    assert (crash["verdict"], crash["action"], crash["failed_rank"]) == ("infrastructure", "restart", 0), crash
    (own,) = rank_crashes(events(run), 0)
    assert f"could not listen on MASTER_PORT {port_for_job(jid)}, which ddpjob chose" in own["error"], own
    assert [r["step"] for r in lines(run / "metrics.jsonl")] == list(range(1, STEPS + 1))


def test_a_script_without_a_sigterm_handler_restarts_in_place_after_a_peer_is_killed(
        slurm_cluster: Any, tmp_path: Path) -> None:
    """nanoGPT catches no SIGTERM. Rank 0's program waits after step 8 outside any collective (so
    no "connection reset" can reach it first) while rank 1's is SIGKILLed there: srun ends the
    step with SIGTERM (--kill-on-bad-exit), the signal of a preemption, and rank 0's program dies
    of it. That is the end of rank 1's crash, not a stop: the batch shell decides it, in place."""
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    run = tmp_path / "run"
    ddpjob("sbatch", str(job_file(tmp_path, "--no_handler")), "-o", str(tmp_path / "job.sbatch"), "--run-dir", str(run),
           cwd=tmp_path)
    jid = slurmtools.submit(tmp_path / "job.sbatch", cwd=tmp_path, env=job_env(DDPJOB_TEST_AT="0:8:0:pause,1:8:0:kill"))
    assert slurmtools.wait_done(jid, 600) == "COMPLETED", rank_log(run, 0) + rank_log(run, 1)
    decided = decisions(run)
    assert [(d["reason"], d.get("verdict"), d.get("action")) for d in decided] == [
        ("crash", "infrastructure", "restart")], decided
    assert decided[0]["failed_rank"] == 1, decided
    assert "the step ended after rank 1's crash" in rank_log(run, 0), rank_log(run, 0)
    assert_resumed(run, 5)
    assert [r["step"] for r in lines(run / "metrics.jsonl") if r["restart"] == 1] == list(range(6, STEPS + 1))


def test_a_killed_ddpjob_run_under_a_script_without_a_handler_restarts_in_place(
        slurm_cluster: Any, tmp_path: Path) -> None:
    """Rank 1's `ddpjob run` itself (the srun task, the program's parent) is SIGKILLed after step
    8 while rank 0's program waits there: rank 1 leaves no crash record. srun ends the step with
    SIGTERM; rank 0's program dies of it, and rank 0, finding the job not being preempted,
    records the policy's end (no requeue). The batch shell, which got no signal, decides srun's "task 1: Killed":
    infrastructure, restarted in place from the script's checkpoint of step 5, COMPLETED (it
    ended FAILED: rank 0's stop stood as the decision)."""
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    run = tmp_path / "run"
    ddpjob("sbatch", str(job_file(tmp_path, "--no_handler")), "-o", str(tmp_path / "job.sbatch"), "--run-dir", str(run),
           cwd=tmp_path)
    jid = slurmtools.submit(tmp_path / "job.sbatch", cwd=tmp_path,
                            env=job_env(DDPJOB_TEST_AT="0:8:0:pause,1:8:0:killwrapper"))
    assert slurmtools.wait_done(jid, 600) == "COMPLETED", rank_log(run, 0) + rank_log(run, 1)
    decided = decisions(run)
    assert [(d["reason"], d.get("verdict"), d.get("action")) for d in decided] == [
        ("signal", None, "end"), ("crash", "infrastructure", "restart")], decided
    assert "not being preempted" in decided[0]["note"], decided
    assert decided[1]["failed_rank"] == 1 and decided[1]["failed_how"] == "Killed", decided
    assert not rank_crashes(events(run), rank=1), "rank 1's ddpjob run was killed: no record"
    assert_resumed(run, 5)
    assert [r["step"] for r in lines(run / "metrics.jsonl") if r["restart"] == 1] == list(range(6, STEPS + 1))
    text = ddpjob("status", str(run), cwd=tmp_path).stdout
    # one stop for the attempt in status: the crash that ended it, not rank 0's signal stop it replaced
    assert "COMPLETED" in text and "crash at step 8" in text and "signal at step" not in text, text


def test_a_bug_on_one_rank_of_a_script_without_a_handler_is_the_users(slurm_cluster: Any, tmp_path: Path) -> None:
    """Rank 1 raises after step 4 while rank 0's program waits there; rank 0's dies of srun's
    SIGTERM. The verdict names rank 1's line: FAILED, not retried (read as rank 0's stop, it was
    "not being preempted", and no verdict)."""
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    line = next(n for n, text in enumerate(SCRIPT.read_text().splitlines(), 1) if 'raise ValueError(f"a bug' in text)
    run = tmp_path / "run"
    ddpjob("sbatch", str(job_file(tmp_path, "--no_handler")), "-o", str(tmp_path / "job.sbatch"), "--run-dir", str(run),
           cwd=tmp_path)
    jid = slurmtools.submit(tmp_path / "job.sbatch", cwd=tmp_path, env=job_env(DDPJOB_TEST_AT="0:4::pause,1:4::raise"))
    assert slurmtools.wait_done(jid, 600) == "FAILED"
    decided = decisions(run)
    assert [(d["reason"], d.get("verdict"), d.get("action")) for d in decided] == [("crash", "user", "end")], decided
    assert f"rank 1's ValueError at plain_train.py:{line}" in decided[0]["line"], decided
    text = ddpjob("status", str(run), cwd=tmp_path).stdout
    assert f"plain_train.py:{line}" in text and "FAILED" in text, text


def test_submit_command_is_preempted_requeued_and_completes(slurm_cluster: Any, tmp_path: Path) -> None:
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    run = tmp_path / "run"
    ddpjob("submit", str(job_file(tmp_path)), "--backend", "slurm", "--run-dir", str(run), cwd=tmp_path,
           env=job_env(DDPJOB_TEST_AT="1:7:0:pause"))
    jid = json.loads((run / "job.json").read_text())["job_id"]
    slurmtools.submitted.append(jid)
    preempted_at_step_7(run, jid, tmp_path)
    assert slurmtools.wait_done(jid, 600) == "COMPLETED", rank_log(run, 0) + rank_log(run, 1)
    assert (run / "COMPLETED").is_file()
    assert_resumed(run, 7)
    assert [r["step"] for r in lines(run / "metrics.jsonl") if r["restart"] == 1] == list(range(8, STEPS + 1))


def test_submit_command_that_raises_fails_with_the_verdict_naming_its_line(slurm_cluster: Any, tmp_path: Path) -> None:
    import slurmtools

    slurmtools.cluster_free(timeout=300)
    line = next(n for n, text in enumerate(SCRIPT.read_text().splitlines(), 1) if 'raise ValueError(f"a bug' in text)
    run = tmp_path / "run"
    ddpjob("submit", str(job_file(tmp_path)), "--backend", "slurm", "--run-dir", str(run), cwd=tmp_path,
           env=job_env(DDPJOB_TEST_AT="*:4::raise"))
    jid = json.loads((run / "job.json").read_text())["job_id"]
    slurmtools.submitted.append(jid)
    assert slurmtools.wait_done(jid, 600) in ("FAILED", "COMPLETED")  # submitit's task ends the job
    decision = wait_for(lambda: decisions(run), 60, "the crash's decision")
    assert len(decision) == 1 and (decision[0]["verdict"], decision[0]["action"]) == ("user", "end"), decision
    assert f"ValueError at plain_train.py:{line}" in decision[0]["line"], decision
    assert not (run / "COMPLETED").exists()
    text = ddpjob("status", str(run), cwd=tmp_path).stdout
    assert f"plain_train.py:{line}" in text, text
