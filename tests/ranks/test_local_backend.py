"""The local backend's supervisor (ddpjob/launch/local.py) with real processes.

Fake ranks (a few lines of Python, FAKE_RANK) make the supervisor's own behaviour fast and
deterministic: the torchrun environment, signal forwarding and restart, kill-on-bad-exit,
cancel, max_requeues. The end-to-end test at the bottom runs the real trainer (`ddpjob run`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ddpjob import rundir
from ddpjob.ledger.events import read as read_events

from clirun import wait_for
from fake_local import fake_command, local_state, make_run
from runlogs import decisions


def start_supervisor(tmp_path: Path, *runs: Path) -> subprocess.Popen:
    log = open(tmp_path / "supervisor.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "ddpjob.launch.local", *map(str, runs),
                             "--rank-command", fake_command(tmp_path)],
                            stdout=log, stderr=subprocess.STDOUT)


def fake_records(run: Path, restart: int, world: int) -> list[dict]:
    return [json.loads((run / f"fake-r{r}-s{restart}.json").read_text()) for r in range(world)]


def all_started(run: Path, restart: int, world: int) -> bool:
    return all((run / f"fake-r{r}-s{restart}.json").is_file() for r in range(world))


def pid_gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


def test_ranks_get_the_torchrun_environment_and_the_job_completes(tmp_path):
    run = make_run(tmp_path, "ok", nodes=2, tasks=2)
    sup = start_supervisor(tmp_path, run)
    assert sup.wait(timeout=60) == 0
    recs = fake_records(run, 0, 4)
    assert [r["RANK"] for r in recs] == ["0", "1", "2", "3"]
    assert [r["LOCAL_RANK"] for r in recs] == ["0", "1", "0", "1"]
    assert [r["GROUP_RANK"] for r in recs] == ["0", "0", "1", "1"]
    assert {r["WORLD_SIZE"] for r in recs} == {"4"} and {r["LOCAL_WORLD_SIZE"] for r in recs} == {"2"}
    assert {r["MASTER_ADDR"] for r in recs} == {"127.0.0.1"}
    assert len({r["MASTER_PORT"] for r in recs}) == 1 and 0 < int(recs[0]["MASTER_PORT"]) < 65536
    assert {r["DDPJOB_JOB_ID"] for r in recs} == {f"local-{sup.pid}"}
    assert {r["DDPJOB_RESTART_COUNT"] for r in recs} == {"0"}
    assert {r["OMP_NUM_THREADS"] for r in recs} == {"1"}
    state = local_state(run)
    assert state["state"] == "COMPLETED" and state["restarts"] == 0 and state["pid"] == sup.pid
    assert "fake rank 3 restart 0 mode ok" in (run / "logs" / "rank-3.log").read_text()
    assert [e["event"] for e in read_events(run)] == ["local_start", "local_end"]


def test_sigusr2_is_forwarded_ranks_exit_3_and_are_restarted(tmp_path):
    run = make_run(tmp_path, "wait")
    sup = start_supervisor(tmp_path, run)
    wait_for(lambda: all_started(run, 0, 2), what="2 ranks to start")
    sup.send_signal(signal.SIGUSR2)
    assert sup.wait(timeout=60) == 0
    first, second = fake_records(run, 0, 2), fake_records(run, 1, 2)
    assert {r["DDPJOB_RESTART_COUNT"] for r in second} == {"1"}
    assert {r["DDPJOB_JOB_ID"] for r in second} == {r["DDPJOB_JOB_ID"] for r in first}
    state = local_state(run)
    assert state["state"] == "COMPLETED" and state["restarts"] == 1
    assert [h["exit_codes"] for h in state["history"]] == [[3, 3], [0, 0]]
    log0 = (run / "logs" / "rank-0.log").read_text()  # appended across the restart
    assert "restart 0 mode wait" in log0 and "got signal [12]" in log0 and "restart 1 mode wait" in log0
    events = [e["event"] for e in read_events(run)]
    # the fake ranks record no stop: the supervisor decides it (a time limit) and records it
    assert events == ["local_start", "signal", "stop", "local_start", "local_end"]
    (stop,) = [e for e in read_events(run) if e["event"] == "stop"]
    assert (stop["reason"], stop["requeued"], stop["requeued_by"], stop["action"]) == (
        "time_limit", True, "supervisor", "requeue"), stop


def test_one_rank_failing_kills_the_others_within_seconds(tmp_path):
    run = make_run(tmp_path, "fail1", tasks=3)
    sup = start_supervisor(tmp_path, run)
    wait_for(lambda: all_started(run, 0, 3), what="3 ranks to start")
    t0 = time.monotonic()
    assert sup.wait(timeout=60) == 1
    # the others sleep 60 s unless killed: well under that, whatever the machine's load
    assert time.monotonic() - t0 < 45
    pids = [r["pid"] for r in fake_records(run, 0, 3)]
    assert all(pid_gone(p) for p in pids)
    state = local_state(run)
    assert state["state"] == "FAILED" and state["exit_codes"][1] == 1
    assert state["exit_codes"][0] == state["exit_codes"][2] == -signal.SIGKILL
    assert not (run / "fake-r0-s1.json").exists()  # a failure is not restarted


def test_a_killed_rank_is_restarted_in_place_while_max_failures_lasts(tmp_path):
    """kill -9 of rank 1: the others are killed, the ranks run again (restart 1), the crash is
    recorded as a stop that spent max_failures; a second crash would end it FAILED."""
    run = make_run(tmp_path, "fail1once", tasks=2, max_failures=1)
    sup = start_supervisor(tmp_path, run)
    assert sup.wait(timeout=120) == 0
    state = local_state(run)
    assert state["state"] == "COMPLETED" and state["restarts"] == 1, state
    assert [h["exit_codes"][1] for h in state["history"]] == [-signal.SIGKILL, 0], state["history"]
    (crash,) = decisions(read_events(run))
    assert crash["reason"] == "crash" and crash["requeued"] is True and crash["requeued_by"] == "supervisor"
    assert "failure 1 of max_failures = 1" in crash["note"], crash
    assert (run / "fake-r0-s1.json").exists() and (run / "fake-r1-s1.json").exists()


def test_a_rank_that_segfaults_at_the_same_point_every_time_ends_as_a_crash_loop(tmp_path):
    """A segfault of rank 1 in every attempt, before any checkpoint: with max_failures = 10 left,
    slurm.max_no_progress = 3 attempts in a row that got nowhere end the run FAILED, with one
    line naming the rank, its host and how it died."""
    run = make_run(tmp_path, "segv1", tasks=2, max_failures=10)
    sup = start_supervisor(tmp_path, run)
    assert sup.wait(timeout=180) == 1
    state = local_state(run)
    assert state["state"] == "FAILED" and len(state["history"]) == 3, state
    host = socket.gethostname()
    assert state["reason"] == (
        "crash loop: 3 attempts in a row crashed without getting past the checkpoint at step 0 "
        f"(rank 1 on {host}: killed by SIGSEGV); not retrying (slurm.max_no_progress = 3)"), state["reason"]
    stops = decisions(read_events(run))
    assert [(s["no_progress"], s["requeued"]) for s in stops] == [(1, True), (2, True), (3, None)], stops
    assert all(s["failed_rank"] == 1 and s["host_fault"] and s["verdict"] == "infrastructure" for s in stops)
    log = (tmp_path / "supervisor.log").read_text()
    assert "ddpjob: error: crash loop: 3 attempts" in log, log


def test_a_sigkill_at_the_same_point_again_ends_the_run_as_the_oom_killers(tmp_path):
    """kill -9 of rank 1 at the same point of two attempts in a row (the kernel's OOM killer on
    the job's own memory looks like this): the second ends the run, with a line that says so."""
    run = make_run(tmp_path, "kill1", tasks=2, max_failures=10)
    sup = start_supervisor(tmp_path, run)
    assert sup.wait(timeout=180) == 1
    state = local_state(run)
    assert state["state"] == "FAILED" and len(state["history"]) == 2, state
    assert state["reason"].startswith(f"crash loop: rank 1 on {socket.gethostname()}: killed by SIGKILL again at "
                                      "the same step: likely the kernel's OOM killer"), state["reason"]
    stops = decisions(read_events(run))
    assert [(s["action"], s["requeued"]) for s in stops] == [("restart", True), ("end", None)], stops


def test_sigterm_cancels_without_restart(tmp_path):
    run = make_run(tmp_path, "wait")
    sup = start_supervisor(tmp_path, run)
    wait_for(lambda: all_started(run, 0, 2), what="2 ranks to start")
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=60) == 1
    state = local_state(run)
    assert state["state"] == "CANCELLED" and state["exit_codes"] == [3, 3]
    assert not (run / "fake-r0-s1.json").exists()


def test_requeues_stop_at_max_requeues(tmp_path):
    run = make_run(tmp_path, "always3", max_requeues=2)
    sup = start_supervisor(tmp_path, run)
    assert sup.wait(timeout=60) == 1
    state = local_state(run)
    assert state["state"] == "FAILED" and state["restarts"] == 2
    assert state["reason"] == "stopped for a requeue, but max_requeues = 2 reached: not requeueing"
    assert len(state["history"]) == 3


def test_sweep_points_run_one_after_another(tmp_path):
    runs = [make_run(tmp_path, "ok", name=f"p{i}") for i in range(2)]
    sup = start_supervisor(tmp_path, *runs)
    assert sup.wait(timeout=60) == 0
    ids = [fake_records(r, 0, 2)[0]["DDPJOB_JOB_ID"] for r in runs]
    assert ids == [f"local-{sup.pid}_0", f"local-{sup.pid}_1"]
    a, b = (local_state(r)["history"][0]["time"] for r in runs)
    assert a <= b and all(local_state(r)["state"] == "COMPLETED" for r in runs)


def test_submit_local_detaches_a_supervisor(tmp_path):
    """submit --backend local returns at once; the supervisor lives in its own session."""
    from ddpjob.launch.backends import local_procs

    run = make_run(tmp_path, "wait")
    rec = local_procs.submit_local([run], run / "logs", ["ddpjob", "submit"],
                              rank_command=fake_command(tmp_path))[0]
    pid = rec["pid"]
    assert rec["job_id"] == f"local-{pid}" and rec["backend"] == "local"
    wait_for(lambda: all_started(run, 0, 2), what="2 ranks to start")
    assert os.getsid(pid) == pid  # new session: a Ctrl-C in the submitting terminal misses it
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: local_state(run).get("state") == "CANCELLED", what="CANCELLED")
    assert "supervisor: got SIGTERM" in (run / "logs" / "supervisor.log").read_text()
    wait_for(lambda: pid_gone(pid) or os.waitpid(pid, os.WNOHANG)[0] == pid, what="supervisor exit")


def test_a_supervisor_read_while_it_execs_is_alive():
    """Popen returns before the child's exec has laid out its command line: read then, the
    /proc line is empty. verify's first poll took that for a dead supervisor and a run that had
    not started for FAILED (CI, 2026-11-28); pid_alive waits the exec out."""
    from ddpjob.launch.backends.local_procs import pid_alive

    seen = []
    for _ in range(40):
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "ddpjob-marker"])
        try:
            seen.append(pid_alive(p.pid, "ddpjob-marker"))
            assert not pid_alive(p.pid, "another-marker")  # still someone else's process
        finally:
            p.kill()
            p.wait()
    assert all(seen), f"{seen.count(False)} of {len(seen)} live processes read as gone"
    assert not pid_alive(p.pid, "ddpjob-marker")  # reaped: gone


def test_submit_local_wait_trains_to_completion_with_two_ranks(tmp_path):
    """The README's main command, shortened: real `ddpjob run` ranks on gloo."""
    run = tmp_path / "smoke"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "ddpjob", "submit", "jobs/smoke.toml", "--backend", "local",
                          "--wait", "--run-dir", str(run), "--set", "train.max_steps=6",
                          "--set", "train.eval_every=0", "--set", "checkpoint.every_steps=3"],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"{run}: COMPLETED" in out.stdout
    assert local_state(run)["state"] == "COMPLETED"
    assert rundir.completed(run) is not None
    assert "finished: step 6" in (run / "logs" / "rank-0.log").read_text()
    assert [e["event"] for e in read_events(run)][0] == "local_start"
    # 2 ranks on this host: forked from the run's warm-start server, which imported torch once
    assert [e.get("warm") for e in read_events(run) if e["event"] == "start"] == [True]
    assert (run / "logs" / "warm-local.log").is_file()
    print(f"local 2-rank smoke (6 steps) took {time.monotonic() - t0:.1f}s")


def test_the_run_dir_is_free_once_local_json_says_the_job_ended(tmp_path, monkeypatch):
    """A `ddpjob resume` that reads STOPPED / COMPLETED in local.json must find the run dir's lock
    free: the supervisor lets go of it before it writes the end (seen as a refused resume)."""
    from ddpjob import runlock
    from ddpjob.launch import local

    run = make_run(tmp_path, "ok", tasks=1)
    sup = local.Supervisor(run, "local-7", command=[*fake_command(tmp_path).split(), str(run)])
    sup.lock = runlock.RunLock.take(run, "local supervisor of job local-7")
    seen = []
    write = local.Supervisor.write

    def spy(self, state, **extra):
        seen.append((state, runlock.holder(run)))
        write(self, state, **extra)

    monkeypatch.setattr(local.Supervisor, "write", spy)
    assert sup.run() == "COMPLETED"
    assert seen[-1] == ("COMPLETED", None), seen
    assert all(holder is not None for state, holder in seen[:-1]), seen  # held while it ran
