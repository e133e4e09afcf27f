"""SLURM hostlist expansion: a table of forms, and the same forms against the real scontrol
(plus the SLURM_TASKS_PER_NODE syntax)."""

from __future__ import annotations

import subprocess

import pytest

from ddpjob.node.hostlist import parse_hostlist
from test_hostlist import FORMS


@pytest.mark.cluster
@pytest.mark.parametrize("form,expected", FORMS)
def test_parse_hostlist_matches_scontrol(slurm_cluster, form: str, expected: list[str]) -> None:
    out = subprocess.run(["scontrol", "show", "hostnames", form], capture_output=True, text=True,
                         timeout=30, check=True).stdout.split()
    assert out == expected  # the table above is what SLURM itself says ...
    assert parse_hostlist(form) == out  # ... and so is our parser
