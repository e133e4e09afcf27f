"""SLURM hostlist expansion: a table of forms, and the same forms against the real scontrol
(plus the SLURM_TASKS_PER_NODE syntax)."""

from __future__ import annotations

import pytest

from ddpjob.errors import DDPJobError
from ddpjob.node.hostlist import first_host, parse_hostlist, parse_tasks_per_node

FORMS: list[tuple[str, list[str]]] = [
    ("n1", ["n1"]),
    ("n[1-2]", ["n1", "n2"]),
    ("n[1-1]", ["n1"]),
    ("n[5]", ["n5"]),
    ("host[1,5-9]", ["host1", "host5", "host6", "host7", "host8", "host9"]),
    ("node[001-003]", ["node001", "node002", "node003"]),
    ("node[08-11]", ["node08", "node09", "node10", "node11"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),
    ("node[098-101]", ["node098", "node099", "node100", "node101"]),
    ("c[0-1]", ["c0", "c1"]),
    ("n1,n2", ["n1", "n2"]),
    ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
    ("gpu-a100.cluster[1-2]", ["gpu-a100.cluster1", "gpu-a100.cluster2"]),
    ("gpu-a100-[01-02]", ["gpu-a100-01", "gpu-a100-02"]),
    ("n[1,3-4,7]", ["n1", "n3", "n4", "n7"]),
    ("n[1-2,4],m[7-8]", ["n1", "n2", "n4", "m7", "m8"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("r[1-2]n[3-4]", ["r1n3", "r1n4", "r2n3", "r2n4"]),
    ("n1[0-2]", ["n10", "n11", "n12"]),
    ("gpu[07,10-11]", ["gpu07", "gpu10", "gpu11"]),
    ("login,n[1-2]", ["login", "n1", "n2"]),
    ("n[3,1]", ["n3", "n1"]),
    ("nid[00001-00002,00010]", ["nid00001", "nid00002", "nid00010"]),
    ("a-b-c", ["a-b-c"]),
    ("Node[1-2]", ["Node1", "Node2"]),
    ("n[1-2]-[3-4]", ["n1-3", "n1-4", "n2-3", "n2-4"]),
    ("n[1-2][3-4]", ["n13", "n14", "n23", "n24"]),
    ("gpu-a100-[1-2].x[1-2]", ["gpu-a100-1.x1", "gpu-a100-1.x2", "gpu-a100-2.x1", "gpu-a100-2.x2"]),
    # three groups: scontrol varies the last fastest, then the first, then the second
    ("a[1-2]b[3-4]c[5-6]", ["a1b3c5", "a1b3c6", "a2b3c5", "a2b3c6", "a1b4c5", "a1b4c6", "a2b4c5", "a2b4c6"]),
    ("n[1-010]", [f"n{i}" for i in range(1, 11)]),  # the width is the lower bound's
    ("n1,n1", ["n1", "n1"]),
    (" n[1-2] ,n3", ["n1", "n2", "n3"]),
]

# Text after the last bracket: scontrol 22.05 says "Invalid hostlist" (so SLURM never hands us
# one), ddpjob expands it the obvious way rather than fail.
LENIENT_FORMS: list[tuple[str, list[str]]] = [
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
    ("n[1-2].example.org", ["n1.example.org", "n2.example.org"]),
    ("x[9-10]y", ["x9y", "x10y"]),
]


@pytest.mark.parametrize("form,expected", FORMS + LENIENT_FORMS)
def test_parse_hostlist(form: str, expected: list[str]) -> None:
    assert parse_hostlist(form) == expected
    assert first_host(form) == expected[0]


@pytest.mark.parametrize("text,expected", [("2(x2)", [2, 2]), ("4", [4]), ("2(x3),1", [2, 2, 2, 1]),
                                           ("3,2", [3, 2]), ("1(x1)", [1])])
def test_tasks_per_node(text: str, expected: list[int]) -> None:
    assert parse_tasks_per_node(text) == expected


@pytest.mark.parametrize("bad", ["", "n[1-2", "n1-2]", "n[]", "n[3-1]", "n[a-b]", "n[1-2]]",
                                  "n[[1-2]]", "n1,,n2", "n[1-]", "n[1,]", "n[010-9]", "n[1-2]x[]"])
def test_bad_hostlist_is_one_line_error(bad: str) -> None:
    with pytest.raises(DDPJobError) as exc:
        parse_hostlist(bad)
    line = exc.value.line()
    assert "\n" not in line and "hostlist" in line and "Hint:" in line
