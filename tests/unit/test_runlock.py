"""One job per run dir (ddpjob/runlock.py), with real processes: the lock is exclusive, its holder
is named, the kernel drops it when the holder is SIGKILLed, the local supervisor's ranks train
under its lock, and a second supervisor, `ddpjob resume` and `ddpjob run` are refused with one
line while a job trains there, even with a damaged events.jsonl (the probe that let 4 ranks into
one run dir)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ddpjob import runlock

HOLD = """
import sys, time
from pathlib import Path
from ddpjob import runlock
try:
    lock = runlock.RunLock.take(Path(sys.argv[1]), "test holder")
except runlock.Busy as exc:
    print(exc.line(), flush=True)
    sys.exit(1)
print("held", flush=True)
time.sleep(120)
"""


def hold(run: Path, **env: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **env}, pass_fds=tuple(int(v) for v in env.values()))
    return proc


def test_the_lock_is_exclusive_named_private_and_dropped_when_its_holder_is_killed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    old = os.umask(0)
    try:
        first = hold(run)
        assert first.stdout.readline().strip() == "held"
    finally:
        os.umask(old)
    assert stat.S_IMODE((run / runlock.LOCK).stat().st_mode) == 0o600  # under umask 000 too
    who = runlock.holder(run)
    assert who is not None and who.startswith(f"test holder, pid {first.pid} on "), who
    second = hold(run)
    out = second.communicate(timeout=60)[0].strip()
    assert second.returncode == 1 and out.count("\n") == 0
    assert out.startswith(f"ddpjob: error: run directory '{run}' is in use: test holder, pid {first.pid}"), out
    with pytest.raises(runlock.Busy):
        runlock.refuse_busy(run)
    first.send_signal(signal.SIGKILL)  # no clean-up runs: the kernel drops the flock
    first.wait(timeout=30)
    assert runlock.holder(run) is None
    lock = runlock.RunLock.take(run, "this test")
    assert "this test" in (run / runlock.LOCK).read_text()
    lock.release()


def test_a_child_trains_under_its_parents_lock_and_only_through_that_descriptor(tmp_path: Path) -> None:
    run, other = tmp_path / "run", tmp_path / "other"
    run.mkdir(), other.mkdir()
    lock = runlock.RunLock.take(run, "supervisor")
    try:
        heir = hold(run, **lock.inherit_env())
        assert heir.stdout.readline().strip() == "held"  # the same open file description
        heir.kill(), heir.wait(timeout=30)
        assert runlock.holder(run) is not None  # the parent still holds it
        # a descriptor of another file, named in the environment, takes nothing
        stray = runlock.RunLock.take(other, "someone else")
        intruder = hold(run, **stray.inherit_env())
        out = intruder.communicate(timeout=60)[0]
        assert intruder.returncode == 1 and "is in use: supervisor" in out, out
        stray.release()
    finally:
        lock.release()
    assert runlock.holder(run) is None
