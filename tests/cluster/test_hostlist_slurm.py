"""SLURM hostlist expansion: a table of forms, and the same forms against the real scontrol
(plus the SLURM_TASKS_PER_NODE syntax)."""

from __future__ import annotations

import subprocess

import pytest

from ddpjob.node.hostlist import parse_hostlist

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


@pytest.mark.cluster
@pytest.mark.parametrize("form,expected", FORMS)
def test_parse_hostlist_matches_scontrol(slurm_cluster, form: str, expected: list[str]) -> None:
    out = subprocess.run(["scontrol", "show", "hostnames", form], capture_output=True, text=True,
                         timeout=30, check=True).stdout.split()
    assert out == expected  # the table above is what SLURM itself says ...
    assert parse_hostlist(form) == out  # ... and so is our parser
