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


def test_apply_sets_torch_and_a_later_compile_without_importing_inductor_at_start() -> None:
    """A rank's start (so every restart after a crash) does not pay for importing torch._inductor
    (dynamo, sympy: seconds) to set inductor's flag: the flag still holds when something
    compiles later, and both ways. A fresh interpreter: this one has imported inductor already."""
    import subprocess
    import sys

    script = ("import sys, torch\nfrom ddpjob.node import determinism\n"
              "for on in (True, False):\n"
              "    determinism.apply(on)\n"
              "    assert torch.are_deterministic_algorithms_enabled() is on\n"
              "    assert 'torch._inductor' not in sys.modules and 'torch._dynamo' not in sys.modules\n"
              "determinism.apply(True)\n"
              "import torch._inductor.config as c\n"
              "assert c.deterministic is True, c.deterministic\n"
              "determinism.apply(False)  # inductor imported now: torch's own call sets it\n"
              "assert c.deterministic is False and not torch.are_deterministic_algorithms_enabled()\n"
              "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_DETERMINISTIC"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
