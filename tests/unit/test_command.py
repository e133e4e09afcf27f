"""[train] command's pure parts (ddpjob/rank/command.py, validate.py, node/cluster.py): the job
file's checks, the traceback a crashed program printed, its exit status -> the rank's ending, and
the torchrun environment its child gets. The processes: tests/ranks/test_command_local.py."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from ddpjob import commandpaths, exitcodes, jobfile
from ddpjob.errors import UsageError
from ddpjob.ledger import policy
from ddpjob.node.cluster import ClusterEnv
from ddpjob.rank.commandenv import command_environ
from ddpjob.ledger.programend import DIED, EXITED, KILLED, PEER_GONE
from ddpjob.rank.command_end import Ending, Raised, clip, ending, last_traceback, unvouched_teardown


def _cfg(**train: object):
    return jobfile.from_dict({"train": train}, "job.toml")


def test_a_command_is_a_list_of_one_line_arguments_kept_as_written() -> None:
    assert _cfg(command=["python", "train.py", "--out_dir", "a b; rm -rf x"]).train.command == (
        "python", "train.py", "--out_dir", "a b; rm -rf x")  # no shell: one argument as it is


@pytest.mark.parametrize("train, says", [
    ({"command": "python train.py"}, 'expected a list of arguments'),
    ({"command": ["python", "a\nb"]}, "contains a newline"),
    ({"command": ["python", "a\x00b"]}, "control character"),
    ({"command": [""]}, "first entry is empty"),
    ({"command": ["python", "t.py"], "entry": "x.py"}, "train.command and train.entry"),
    ({"command": ["python", "t.py"], "command_signal": "KILL"}, "train.command_signal 'KILL'"),
    ({"command": ["python", "t.py"], "command_grace_s": -1}, "train.command_grace_s is -1"),
    ({"command": ["python", "t.py"], "command_requeue_exit": 1}, "train.command_requeue_exit is 1"),
    ({"command": ["python", "t.py"], "command_hang_s": 1e9}, "train.command_hang_s"),
])
def test_a_bad_command_setting_gets_one_line(train: dict, says: str) -> None:
    with pytest.raises(UsageError) as err:
        _cfg(**train)
    assert says in err.value.line() and "\n" not in err.value.line()


TRACE = """step 3 loss 0.5
Traceback (most recent call last):
  File "/data/repo/train.py", line 12, in <module>
    main()
  File "/data/repo/train.py", line 9, in main
    model(x)
  File "/usr/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1751, in _call_impl
    return forward_call(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
torch.OutOfMemoryError: CUDA out of memory.
  Tried to allocate 2 GiB
"""


def test_the_last_traceback_names_the_exception_and_the_scripts_own_innermost_line() -> None:
    assert last_traceback(TRACE) == Raised("OutOfMemoryError", "CUDA out of memory.", "train.py:9")
    chained = TRACE + "\nDuring handling of the above exception, another exception occurred:\n\n" + \
        "Traceback (most recent call last):\n  File \"/x/eval.py\", line 3, in <module>\nKeyError: 'acc'\n"
    assert last_traceback(chained) == Raised("KeyError", "'acc'", "eval.py:3")
    marked = "[rank1]: Traceback (most recent call last):\n[rank1]:   File \"t.py\", line 93, in <module>\n" \
             "[rank1]:     raise ValueError(f\"x\")\n[rank1]: ValueError: a bug at step 4\n"
    assert last_traceback(marked) == Raised("ValueError", "a bug at step 4", "t.py:93")
    assert last_traceback("just a log line\nexit\n") is None


def test_a_teardown_abort_is_done_after_the_trainers_end_and_waits_for_a_peer_without_it() -> None:
    """An integration's "end" line, then SIGABRT with libstdc++'s line as the last words: torch's
    threads met the interpreter's end, the run is done. Without the end line it is read as exit 0
    marked `teardown` (rank 0 completes only where a peer exited 0 by itself). With a traceback,
    another last line or another signal, it stays a crash."""
    tail = "done at step 300\nterminate called without an active exception\n"
    done = ending(-signal.SIGABRT, requeue_exit=3, stopped=False, stderr_tail=tail, trainer_ended=300)
    assert done.code == exitcodes.OK and done.crash is None and "step 300" in (done.note or "") and not done.teardown
    assert ending(128 + signal.SIGABRT, requeue_exit=3, stopped=False, stderr_tail=tail, trainer_ended=300).code == 0
    alone = ending(-signal.SIGABRT, requeue_exit=3, stopped=False, stderr_tail="Training finished\n" + tail[17:])
    assert alone.code == exitcodes.OK and alone.crash is None and alone.teardown, alone
    assert "read as exit 0 where a peer's program exited 0" in (alone.note or ""), alone
    assert ending(-signal.SIGABRT, requeue_exit=3, stopped=False, stderr_tail=tail[17:], alone=True) == unvouched_teardown()
    unvouched = unvouched_teardown()
    assert unvouched.signum == signal.SIGABRT and unvouched.crash is not None
    assert unvouched.crash["error_class"] == "infrastructure" and "no rank's program exited 0" in unvouched.crash["error"]
    assert ending(-signal.SIGABRT, requeue_exit=3, stopped=False, stderr_tail="done\n",
                  trainer_ended=300).crash is not None
    assert ending(-signal.SIGSEGV, requeue_exit=3, stopped=False, stderr_tail=tail, trainer_ended=300).crash is not None
    assert ending(-signal.SIGABRT, requeue_exit=3, stopped=False, stderr_tail=TRACE + tail,
                  trainer_ended=300).crash is not None


def test_a_teardown_abort_after_the_stop_signal_is_the_programs_exit_for_a_requeue() -> None:
    """A pytorch/examples-style script saves on SIGTERM and leaves; its interpreter's end then
    meets gloo's threads (this project's CI: rank 0 "Training snapshot saved", then libstdc++'s
    line and SIGABRT). That is the stop it was asked for, not a crash; a traceback, or SIGABRT
    without the line, stays what it was."""
    tail = "Epoch 4 | Training snapshot saved at snapshot.pt\nterminate called without an active exception\n"
    for code in (-signal.SIGABRT, 128 + signal.SIGABRT):
        left = ending(code, requeue_exit=3, stopped=True, stderr_tail=tail)
        assert (left.code, left.stop, left.program, left.crash, left.signum) == (exitcodes.REQUEUE, True, EXITED,
                                                                                 None, None), left
        assert "aborted in torch's teardown" in (left.note or ""), left
    assert ending(-signal.SIGABRT, requeue_exit=3, stopped=True, stderr_tail="saved\n").crash is not None
    assert ending(-signal.SIGABRT, requeue_exit=3, stopped=True, stderr_tail=TRACE + tail).crash is not None
    without = ending(-signal.SIGABRT, requeue_exit=3, stopped=False, stderr_tail=tail)
    assert not without.stop and without.teardown, without  # no stop: exit 0 only where a peer vouches


def test_the_trainers_end_line_of_this_attempt_only() -> None:
    from ddpjob.ledger import metricslines

    lines = [{"kind": "train", "step": 300, "restart": 1}, {"kind": "end", "step": 300, "restart": 0}]
    assert metricslines.trainer_ended(lines, 1) is None
    assert metricslines.trainer_ended(lines, 0) == 300


def test_exit_statuses_map_to_the_ranks_ending() -> None:
    assert ending(0, requeue_exit=3, stopped=False).code == exitcodes.OK
    assert ending(3, requeue_exit=3, stopped=False).stop
    assert ending(-signal.SIGTERM, requeue_exit=3, stopped=True).stop  # died of the stop signal: requeue
    assert ending(-signal.SIGKILL, requeue_exit=3, stopped=True, killed=True).stop  # still saving after the grace
    assert not ending(-signal.SIGKILL, requeue_exit=3, stopped=True).stop  # SLURM's kill of the step
    # after ddpjob's stop signal: a handler that saves and exits 0 (Lightning's) is a stop, never done
    assert ending(0, requeue_exit=3, stopped=True) == Ending(exitcodes.REQUEUE, stop=True, program=EXITED)
    assert ending(-signal.SIGTERM, requeue_exit=3, stopped=True).program == DIED
    assert ending(128 + signal.SIGTERM, requeue_exit=3, stopped=True).program == DIED  # a wrapper shell died of it
    assert ending(-signal.SIGKILL, requeue_exit=3, stopped=True, killed=True).program == KILLED
    # another status after a stop, without a peer's traceback, is the program's own: a crash
    assert not ending(1, requeue_exit=3, stopped=True).stop
    # an exception of its own while it stopped stays a crash
    own = ending(1, requeue_exit=3, stopped=True, stderr_tail=TRACE)
    assert not own.stop and own.crash is not None and own.crash["error_class"] == policy.USER
    killed = ending(-signal.SIGKILL, requeue_exit=3, stopped=False)
    assert killed.signum == signal.SIGKILL and killed.crash == {
        "error": "the command was killed by SIGKILL", "error_class": policy.INFRASTRUCTURE}
    bug = ending(1, requeue_exit=3, stopped=False, stderr_tail=TRACE).crash
    assert bug is not None and bug["error_class"] == policy.USER and bug["where"] == "train.py:9"
    assert bug["exception"] == "OutOfMemoryError"
    silent = ending(7, requeue_exit=3, stopped=False).crash
    assert silent is not None and silent["error_class"] == policy.USER and "status 7" in silent["error"]
    peer = ending(1, requeue_exit=3, stopped=False, stderr_tail="Traceback (most recent call last):\n"
                  '  File "t.py", line 5, in <module>\nRuntimeError: Connection closed by peer [127.0.0.1]:1\n').crash
    assert peer is not None and peer["error_class"] == policy.INFRASTRUCTURE
    # the stop signal reached the ranks a little apart: the survivor's collective failed as its peer
    # left (or srun's SIGTERM after a peer crashed: rank/command._finish reads the peer's crash
    # record and lets that be decided)
    ended = ending(-signal.SIGTERM, requeue_exit=3, stopped=True, stderr_tail="Traceback (most recent call last):\n"
                   '  File "t.py", line 5, in <module>\nRuntimeError: Connection reset by peer\n')
    assert ended == Ending(exitcodes.REQUEUE, stop=True, program=PEER_GONE)
    assert ending(1, requeue_exit=3, stopped=True, stderr_tail="Traceback (most recent call last):\n"
                  '  File "t.py", line 5, in <module>\nRuntimeError: Connection reset by peer\n').program == PEER_GONE
    taken = ("Traceback (most recent call last):\n  File \"t.py\", line 5, in <module>\ntorch.distributed."
             "DistNetworkError: The server socket has failed to listen on any local network address. "
             "port: 15042, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use\n")
    ours = ending(1, requeue_exit=3, stopped=False, stderr_tail=taken, port=15042).crash
    assert ours is not None and ours["error_class"] == policy.INFRASTRUCTURE
    assert "could not listen on MASTER_PORT 15042, which ddpjob chose" in ours["error"]
    theirs = ending(1, requeue_exit=3, stopped=False, stderr_tail=taken, port=15042, port_ours=False).crash
    assert theirs is not None and theirs["error_class"] == policy.USER and "set a free one" in theirs["error"]
    hung = ending(-9, requeue_exit=3, stopped=False, hang_s=30).crash
    assert hung is not None and "no output or heartbeat for 30 s" in hung["error"]
    assert hung["error_class"] == policy.INFRASTRUCTURE


def test_the_child_gets_torchruns_variables_and_ddpjobs() -> None:
    env = ClusterEnv.from_environ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
                                   "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
                                   "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n[1-2]",
                                   "SLURMD_NODENAME": "n2", "SLURM_STEP_ID": "0"}, argv=[])
    out = command_environ(env, {"DDPJOB_ATTEMPT": "2"}, environ={"PATH": "/bin"})
    assert {k: out[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "MASTER_ADDR", "PATH", "DDPJOB_ATTEMPT")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "MASTER_ADDR": "n1", "PATH": "/bin", "DDPJOB_ATTEMPT": "2"}
    assert out["MASTER_PORT"] == out["DDPJOB_MASTER_PORT"] == str(env.master_port)
    # the program, reading its place with ddpjob's API, knows the port is ddpjob's choice, not its
    # own: a port another program holds is then the node's doing (node/group.py)
    assert ClusterEnv.from_environ(out, argv=[]).port_derived
    assert not ClusterEnv.from_environ({**out, "MASTER_PORT": "23456"}, argv=[]).port_derived  # its own
    mine = ClusterEnv.from_environ({"SLURM_JOB_ID": "7", "MASTER_PORT": "23456"}, argv=[])
    assert "DDPJOB_MASTER_PORT" not in command_environ(mine, {}, environ={})
    # the elastic set too: Lightning and Accelerate tell a torchrun launch by it
    assert {k: out[k] for k in ("GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
                                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE")} == {
        "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "3", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": "4",
        "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert "TORCHELASTIC_RUN_ID" in out and "TORCHELASTIC_MAX_RESTARTS" in out


def test_the_child_gets_the_users_python_not_ddpjobs(tmp_path: Path) -> None:
    """`python train.py` must put the script's folder first on sys.path again: no PYTHONSAFEPATH,
    and the run's frozen code (ddpjob's own) off PYTHONPATH; the user's own entries stay."""
    env = ClusterEnv.from_environ({}, argv=[])
    code = tmp_path / "run" / "code" / "python"
    code.mkdir(parents=True)
    out = command_environ(env, {}, environ={"PYTHONSAFEPATH": "1", "PYTHONPATH": f"{code}:/home/me/lib"},
                          own_code=str(code), run_id="run-1", max_restarts=20)
    assert "PYTHONSAFEPATH" not in out and out["PYTHONPATH"] == "/home/me/lib"
    assert out["TORCHELASTIC_RUN_ID"] == "run-1" and out["TORCHELASTIC_MAX_RESTARTS"] == "20"
    alone = command_environ(env, {}, environ={"PYTHONPATH": str(code)}, own_code=str(code))
    assert "PYTHONPATH" not in alone


def test_placeholders_fill_the_arguments_and_nothing_else(tmp_path: Path) -> None:
    assert commandpaths.expand("{run_dir}/snapshot.pt", tmp_path, 2) == f"{tmp_path}/snapshot.pt"
    assert commandpaths.expand("out-{attempt}", tmp_path, 2) == "out-2"
    assert commandpaths.expand('{"lr": 1}', tmp_path, 2) == '{"lr": 1}'  # the program's own braces


def test_an_error_line_is_cut_at_a_word() -> None:
    assert clip("remote worker at 10.0.0.1 went away", 16) == "remote worker…"
    assert clip("short", 16) == "short"


def test_words_after_dashes_become_the_command_of_submit_and_sbatch_only() -> None:
    from ddpjob.cli import _command_after_dashes

    assert _command_after_dashes(["submit", "j.toml", "--nodes", "2", "--", "python", "a b.py", "--x"]) == (
        ["submit", "j.toml", "--nodes", "2"], ["python", "a b.py", "--x"])
    assert _command_after_dashes(["--debug", "sbatch", "j.toml", "-o", "x", "--", "t"])[1] == ["t"]
    assert _command_after_dashes(["status", "run"]) == (["status", "run"], [])
    for bad, says in ((["run", "j.toml", "--", "x"], "not `ddpjob run`"), (["submit", "j.toml", "--"], "nothing follows")):
        with pytest.raises(UsageError) as err:
            _command_after_dashes(bad)
        assert says in err.value.line()


def test_doctor_warns_when_the_grace_outlasts_slurms_window() -> None:
    from ddpjob.launch.doctor import command_grace

    cfg = _cfg(command=["python", "t.py"], command_grace_s=60)
    short = command_grace(cfg, "low", "20", 5)
    assert short.status == "warn" and "GraceTime 20 s of 'low' (preemption)" in short.detail, short
    ok = command_grace(_cfg(command=["python", "t.py"], command_grace_s=15), "low", "20", 5)
    assert ok.status == "pass", ok


def test_a_commands_crash_verdict_resumes_from_its_own_checkpoint() -> None:
    facts = policy.Facts("crash", policy.INFRASTRUCTURE, "rank 1 on n2: killed by SIGKILL", here=True,
                         resume_at=8, steps_lost=0, own_checkpoint=True)
    line = policy.decide(facts, policy.Limits()).line
    assert line.startswith("restarting in place from the command's own checkpoint (it had logged step 8);"), line


def test_the_childs_two_streams_reach_the_log_whole_lines_at_a_time(tmp_path: Path) -> None:
    """stdout and stderr land in one rank log: a line of one is never cut by the other's
    ("Steps: 256/...dataloader.py:759: UserWarning"); a progress bar's \\r ends a line too."""
    import io
    import threading

    from ddpjob.rank.command import _Output

    class Sink(io.BytesIO):
        lock = threading.Lock()

    log = Sink()
    out = _Output()
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    out.follow(os.fdopen(r1, "rb"), log, keep=False)
    out.follow(os.fdopen(r2, "rb"), log, keep=True)
    for part in (b"Steps: 2", b"56/512\n", b"Epoch 3 | loss 0.1\r", b"tail without end"):
        os.write(w1, part)
        os.write(w2, b"dataloader.py:759: UserWarning\n")
    os.close(w1)
    os.close(w2)
    out.join()
    lines = log.getvalue().replace(b"\r", b"\n").split(b"\n")
    assert b"Steps: 256/512" in lines and b"Epoch 3 | loss 0.1" in lines, lines
    assert b"tail without end" in lines and lines.count(b"dataloader.py:759: UserWarning") == 4, lines
    assert out.last_line == "tail without end" and "UserWarning" in out.tail


def test_threes_with_zeros_are_a_stop_for_the_local_supervisor() -> None:
    from ddpjob.launch.local import stopped

    assert stopped([3, 3]) and stopped([3, 0]) and stopped([0, 3])
    assert not stopped([0, 0]) and not stopped([3, 1]) and not stopped([3, -9])


def test_a_peer_rank_waits_for_rank_0_when_the_open_attempt_is_an_earlier_starts(tmp_path: Path) -> None:
    """A command's rank other than 0 reads its attempt number from the ledger. An attempt left
    open by an earlier start of the job (SIGKILLed after GraceTime: only its launch on record)
    is not this start's: the rank waits until rank 0 recorded that end, and takes the number rank
    0 takes. A launch newer than this rank's own start is rank 0's of this start: taken at once."""
    import threading
    import time

    from ddpjob.ledger import events
    from ddpjob.rank import command

    env = ClusterEnv(rank=1, world_size=2, job_id="77", restart_count=1, source="slurm")
    events.record(tmp_path, "launch", job_id="77", restart=0, world_size=2, host="n1", source="slurm",
                  time=time.time() - 3600)

    def rank_0() -> None:
        time.sleep(0.5)
        events.record(tmp_path, "stop", reason="preemption", job_id="77", restart=0, requeued=True,
                      requeued_by="slurm", unseen=True)

    t = threading.Thread(target=rank_0)
    began = time.monotonic()
    t.start()
    assert command._peer_attempt(env, tmp_path) == 1
    assert time.monotonic() - began >= 0.5  # it waited for rank 0's record (written after its sleep)
    t.join()
    events.record(tmp_path, "launch", job_id="77", restart=1, world_size=2, host="n1", source="slurm")
    assert command._peer_attempt(env, tmp_path) == 1  # rank 0's launch of this start: no wait (no end comes)


def test_an_end_line_is_no_curve_point_and_no_training_time(tmp_path) -> None:
    """The integrations' `end` line at step 300 leaves step 300's train line (its loss) in place."""
    from ddpjob import rundir
    from ddpjob.launch.history import load_history

    (tmp_path / rundir.METRICS).write_text(
        '{"kind": "train", "step": 300, "restart": 0, "time": 1.0, "loss": 0.5}\n'
        '{"kind": "end", "step": 300, "restart": 0, "time": 2.0}\n')
    assert [r.get("loss") for r in load_history(tmp_path).train] == [0.5]


def test_a_stop_says_what_a_peers_program_did_where_rank_0s_only_saw_the_peer_leave(tmp_path: Path) -> None:
    # rank 0's program waited in a collective while rank 1's died of SIGTERM first: its own end
    # (PEER_GONE) says nothing about the program's habit; rank 1's (no handler: DIED) does
    from ddpjob.ledger import events
    from ddpjob.node import preemption
    from ddpjob.rank.command import _program_of_the_stop
    env = ClusterEnv(rank=0, world_size=3, job_id="local-9", restart_count=0, source="local")
    stop = preemption.StopFlag()
    stop.code = preemption.REQUEUE
    for rank, program in ((0, PEER_GONE), (2, PEER_GONE), (1, DIED)):
        events.record(tmp_path, "rank_end", rank=rank, job_id="local-9", restart=0, status=3, stop=True, program=program)
    events.record(tmp_path, "rank_end", rank=1, job_id="local-8", restart=0, status=3, stop=True, program=EXITED)
    assert _program_of_the_stop(tmp_path, env, 0, stop, wait_s=5) == DIED
    other = tmp_path / "other"
    other.mkdir()
    for rank in range(3):  # every rank only saw another leave: that is what is said
        events.record(other, "rank_end", rank=rank, job_id="local-9", restart=0, status=3, stop=True, program=PEER_GONE)
    assert _program_of_the_stop(other, env, 0, stop, wait_s=5) == PEER_GONE
