"""`[train] deterministic` (ddpjob/node/determinism.py): what a rank's torch is set to, both ways,
and the one line a user gets when an operation has no deterministic kernel.

The rank tests run a tiny entry script through `ddpjob run` (tests/ranks.py) and read what it
printed; torch's own refusal (put_ has no deterministic kernel, on CPU too) stands in for the
CUDA operations that refuse on GPUs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ranks import events, run, write_job

SCRIPT = """
import json, os
import torch
import ddpjob

job = ddpjob.init()
print("flags " + json.dumps({
    "use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    "cudnn.deterministic": torch.backends.cudnn.deterministic,
    "cudnn.benchmark": torch.backends.cudnn.benchmark,
    "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
}), flush=True)
torch.zeros(3).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))  # no deterministic kernel
job.finish()
"""


def _flags(log: str) -> dict[str, object]:
    [line] = [x for x in log.splitlines() if x.startswith("flags ")]
    return json.loads(line.removeprefix("flags "))


@pytest.fixture
def script_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # The ranks inherit this process's environment (ranks.base_env): no value of our own.
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    (tmp_path / "entry.py").write_text(SCRIPT)
    return write_job(tmp_path / "job.toml", train={"entry": str(tmp_path / "entry.py"), "threads": 1})


def test_on_by_default_sets_the_kernels_and_refuses_an_op_in_one_line(tmp_path: Path,
                                                                       script_job: Path) -> None:
    out = tmp_path / "run"
    codes, ranks = run([str(script_job), "--run-dir", str(out)], 1, tmp_path / "logs")
    log = ranks.output(0)
    assert codes == [1], log
    assert _flags(log) == {"use_deterministic_algorithms": True, "cudnn.deterministic": True,
                           "cudnn.benchmark": False, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    [line] = [x for x in log.splitlines() if x.startswith("ddpjob: error:")]
    assert "the operation put_ has no deterministic kernel" in line, line
    assert "Hint: set train.deterministic = false" in line, line
    assert "Traceback" not in log  # the line says it all (the op, the switch)
    [crash] = [e for e in events(out) if e.get("reason") == "crash"]
    assert crash["error"] == line


def test_off_gives_cudnn_benchmark_and_lets_the_op_run(tmp_path: Path, script_job: Path) -> None:
    codes, ranks = run([str(script_job), "--run-dir", str(tmp_path / "run"), "--set",
                        "train.deterministic=false"], 1, tmp_path / "logs")
    log = ranks.output(0)
    assert codes == [0], log
    assert _flags(log) == {"use_deterministic_algorithms": False, "cudnn.deterministic": False,
                           "cudnn.benchmark": True, "CUBLAS_WORKSPACE_CONFIG": None}
