"""`[train] deterministic` (ddpjob/node/determinism.py): what a rank's torch is set to, both ways,
and the one line a user gets when an operation has no deterministic kernel.

The rank tests run a tiny entry script through `ddpjob run` (tests/ranks.py) and read what it
printed; torch's own refusal (put_ has no deterministic kernel, on CPU too) stands in for the
CUDA operations that refuse on GPUs.
"""

from __future__ import annotations

import os

import pytest
import torch

from ddpjob.errors import DDPJobError
from ddpjob.node import determinism
from ddpjob.node.cluster import ClusterEnv


def test_a_cublas_setting_the_user_exported_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    determinism.set_environ(True, ClusterEnv.from_environ(argv=[]))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    determinism.set_environ(False, ClusterEnv.from_environ(argv=[]))
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    determinism.set_environ(True, ClusterEnv.from_environ(argv=[]))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_explain_maps_only_torch_determinism_refusals() -> None:
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError) as refused:
            torch.zeros(2).put_(torch.tensor([1, 1]), torch.tensor([1.0, 2.0]))
    finally:
        torch.use_deterministic_algorithms(before)
    err = determinism.explain(refused.value)
    assert isinstance(err, DDPJobError) and err.exit_code == 1
    assert err.line().startswith("ddpjob: error: the operation put_ has no deterministic kernel")
    other = RuntimeError("CUDA out of memory")
    assert determinism.explain(other) is other
