"""tests/slurmtools.py's parsing, which every cluster test's verdict goes through.

The helpers that drive real jobs are exercised by tests/cluster/test_cluster_infra.py; these cases pin
the text handling without a cluster.
"""

from __future__ import annotations

import slurmtools

LINE = ("JobId=124 ArrayJobId=123 ArrayTaskId=1 JobName=my job name UserId=root(0) "
        "JobState=RUNNING Reason=None Restarts=1 Command=/tmp/dir with space/job.sh "
        "WorkDir=/tmp/dir with space NodeList=n[1-2] TRES=cpu=4,mem=4000M,node=2 "
        "ReqB:S:C:T=0:0:*:* Socks/Node=*")


def test_scontrol_line_values_keep_their_spaces() -> None:
    info = slurmtools._parse_scontrol_line(LINE)
    assert info["JobName"] == "my job name"
    assert info["Command"] == "/tmp/dir with space/job.sh"
    assert info["WorkDir"] == "/tmp/dir with space"
    assert info["TRES"] == "cpu=4,mem=4000M,node=2"
    assert info["ReqB:S:C:T"] == "0:0:*:*" and info["Socks/Node"] == "*"
    assert info["Restarts"] == "1" and info["NodeList"] == "n[1-2]"


def test_array_ids_match_base_task_and_raw_id() -> None:
    info = slurmtools._parse_scontrol_line(LINE)
    assert all(slurmtools._matches(info, j) for j in ("123", "123_1", "124"))
    assert not any(slurmtools._matches(info, j) for j in ("12", "123_2", "1234"))


def test_combined_state_of_array_tasks() -> None:
    assert slurmtools._combined([]) is None
    assert slurmtools._combined(["COMPLETED", "RUNNING", "PENDING"]) == "RUNNING"
    assert slurmtools._combined(["COMPLETED", "FAILED", "CANCELLED"]) == "FAILED"
    assert slurmtools._combined(["COMPLETED", "COMPLETED"]) == "COMPLETED"
