"""Nothing hangs (node/hang.py): a rank that stops making progress ends the job within
train.dist_timeout_s + 60 s, with one line naming the rank, its host and where it was, and
every thread's stack in each rank's log. Real processes (tests/api_script.py, 2 ranks under
`ddpjob run`); the stall is caused at a chosen step by the script itself, and the only clock
in the assertions is the issue's own bound (timeout + 60 s), measured from the stall."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from ranks import TESTS, Ranks, events, write_job
from runlogs import rank_crashes

TIMEOUT_S = 10


def _stalled_job(tmp_path: Path, where: str) -> tuple[list[int], Ranks, float, float]:
    job = write_job(tmp_path / "job.toml",
                    train={"entry": str(TESTS / "api_script.py"), "threads": 1, "dist_timeout_s": TIMEOUT_S},
                    checkpoint={"every_steps": 5}, user={"steps": 20, "stall_at": where})
    ranks = Ranks([str(job), "--run-dir", str(tmp_path / "run")], 2, tmp_path / "logs", job_id="hang")
    codes = ranks.wait(300)
    ended = time.time()
    (stalled,) = re.findall(r"stalled at ([0-9.]+)", ranks.output(1))
    return codes, ranks, float(stalled), ended


@pytest.mark.parametrize("where, waiting_in", [
    ("1:6", "DDP's gradient all-reduce (in the backward pass) at step 6"),  # rank 0 waits in DDP's backward
    ("1:6:after", "job.log()'s average at step 6"),  # rank 0 waits in a ddpjob collective
])
def test_a_stalled_rank_ends_the_job_with_its_name_host_and_stack(tmp_path: Path, where: str,
                                                                   waiting_in: str) -> None:
    codes, ranks, stalled, ended = _stalled_job(tmp_path, where)
    assert codes == [1, 1], ranks.output()
    assert ended - stalled < TIMEOUT_S + 60, f"the job took {ended - stalled:.0f} s to end after the stall"
    rank0 = ranks.output(0)
    (line,) = [x for x in rank0.splitlines() if x.startswith("ddpjob: error:")]
    assert f"rank 0 on {_host()}: {waiting_in} failed after" in line, line
    assert f"rank 1 ({_host()}) did not arrive: it was running its own code at api_script.py:" in line
    assert "in stall (step 6" in line and "Hint:" in line and "Traceback" not in rank0
    # every thread's stack in rank 1's log, with the line where the user's code is stuck
    rank1 = ranks.output(1)
    assert "every thread's stack follows" in rank1
    assert re.search(r'File ".*api_script\.py", line \d+ in stall', rank1), rank1[-3000:]
    crash = rank_crashes(events(tmp_path / "run"))  # the ranks' own records of their error
    assert crash and "rank 1 (" in crash[0]["error"] and "did not arrive" in crash[0]["error"]


def test_a_rank_that_raises_ends_its_peer_with_its_error_and_where_to_look(tmp_path: Path) -> None:
    """Rank 1 raises in step 3 (a bug in the user's code) while rank 0 goes on into DDP's
    all-reduce. Rank 1 ends at once, so rank 0's collective fails on the closed connection, and
    its one line names rank 1's error and points at rank 1's log for the traceback (not at the
    timeout). dist_timeout_s is an hour: nothing but that ends rank 0 within the test's wait."""
    job = write_job(tmp_path / "job.toml",
                    train={"entry": str(TESTS / "api_script.py"), "threads": 1, "dist_timeout_s": 3600},
                    user={"steps": 20, "raise_at": "1:3"})
    ranks = Ranks([str(job), "--run-dir", str(tmp_path / "run")], 2, tmp_path / "logs", job_id="raise")
    codes = ranks.wait(300)
    assert codes == [1, 1], ranks.output()
    (line,) = [x for x in ranks.output(0).splitlines() if x.startswith("ddpjob: error:")]
    assert f"rank 1 ({_host()}) failed: ValueError: a bug in the user's code at step 3" in line, line
    assert line.endswith("Hint: rank 1's log holds its traceback; every rank's log holds every "
                         "thread's stack at that moment."), line
    rank1 = ranks.output(1)
    assert "Traceback" in rank1 and "ValueError: a bug in the user's code at step 3" in rank1


def _host() -> str:
    import socket

    return socket.gethostname()
