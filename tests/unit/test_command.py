"""[train] command's pure parts (ddpjob/rank/command.py, validate.py, node/cluster.py): the job
file's checks, the traceback a crashed program printed, its exit status -> the rank's ending, and
the torchrun environment its child gets. The processes: tests/ranks/test_command_local.py."""

from __future__ import annotations

import signal

import pytest

from ddpjob import exitcodes, jobfile
from ddpjob.errors import UsageError
from ddpjob.ledger import policy
from ddpjob.node.cluster import ClusterEnv, command_environ
from ddpjob.rank.command import Raised, ending, last_traceback


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


def test_exit_statuses_map_to_the_ranks_ending() -> None:
    assert ending(0, requeue_exit=3, stopped=False).code == exitcodes.OK
    assert ending(3, requeue_exit=3, stopped=False).stop
    assert ending(-signal.SIGTERM, requeue_exit=3, stopped=True).stop  # died of the stop signal: requeue
    assert ending(-signal.SIGKILL, requeue_exit=3, stopped=True, killed=True).stop  # still saving after the grace
    assert not ending(-signal.SIGKILL, requeue_exit=3, stopped=True).stop  # SLURM's kill of the step
    # a status after a stop is no stop: a peer's end failed the collective while srun ended the step
    assert not ending(1, requeue_exit=3, stopped=True).stop
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
    # srun's SIGTERM to the step after a peer died, while this one was raising its failed collective
    ended = ending(-signal.SIGTERM, requeue_exit=3, stopped=True, stderr_tail="Traceback (most recent call last):\n"
                   '  File "t.py", line 5, in <module>\nRuntimeError: Connection reset by peer\n')
    assert not ended.stop and ended.crash is not None and ended.crash["error_class"] == policy.INFRASTRUCTURE
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
    assert out["MASTER_PORT"] == str(env.master_port)


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
