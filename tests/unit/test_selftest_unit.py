"""`ddpjob selftest` as a user runs it: alone, under torchrun, under the legacy launcher, under srun."""

from __future__ import annotations

from ddpjob.node.selftest import check_layout


def test_layout_check_names_the_problem() -> None:
    good = [(0, 0, 0, "n1", "cpu", "gloo"), (1, 1, 0, "n1", "cpu", "gloo"), (2, 0, 1, "n2", "cpu", "gloo")]
    assert check_layout(good) is None
    assert "ranks [0, 2]" in check_layout([good[0], good[2]])
    assert "several hosts" in check_layout([good[0], (1, 1, 0, "n9", "cpu", "gloo")])
    assert "local ranks on node 0 are [0, 0]" in check_layout([good[0], (1, 0, 0, "n1", "cpu", "gloo")])
