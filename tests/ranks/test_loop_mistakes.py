"""A new user's mistakes in their own loop, which used to finish with no word (rank/checks.py):
an LR scheduler left out of `state`, a shuffling DistributedSampler/RandomSampler instead of a
StepSampler, a DataLoader iterator with workers made before `job.resume()`, and `job.log()` of a
tensor of many values. Real scripts, run alone as a user runs them (one process each)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r'''
import sys
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
import ddpjob

mistake = sys.argv[1]
job = ddpjob.init(overrides=["train.max_steps=3"])
ds = TensorDataset(torch.randn(64, 4), torch.randn(64))
model = job.wrap(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
sampler = ddpjob.StepSampler(len(ds), 16, seed=0)
loader = DataLoader(ds, batch_sampler=sampler, num_workers=1 if mistake == "iterator" else 0)
state = {"model": model, "opt": opt, "sched": sched, "sampler": sampler}
if mistake == "scheduler":
    del state["sched"]
if mistake == "sampler":
    del state["sampler"]
    loader = DataLoader(ds, batch_size=16, sampler=DistributedSampler(ds, num_replicas=1, rank=0))
eval_loader = DataLoader(ds, batch_size=16, sampler=DistributedSampler(ds, 1, 0, shuffle=False))
early = iter(loader) if mistake == "iterator" else None
start = job.resume(state)
batches = iter(loader) if early is None else early
for step in job.steps(state, 3):
    x, y = next(batches)
    loss = ((model(x).squeeze(1) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    job.log(step + 1, loss=(model(x).squeeze(1) - y) ** 2 if mistake == "log" else loss)
job.finish(model)
'''


def run(tmp_path: Path, mistake: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDPJOB_"))}
    return subprocess.run([sys.executable, str(script), mistake], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"})


def warnings(r: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in r.stderr.splitlines() if ln.startswith("ddpjob: warning:")]


@pytest.mark.parametrize("mistake, said", [
    ("none", None),
    ("scheduler", "state['opt'] is an optimizer with an LR scheduler, but the scheduler is not in state"),
    ("sampler", "a DataLoader draws its batches from a DistributedSampler, which has no position to resume from"),
    ("iterator", "a DataLoader iterator with workers was made before job.resume()"),
])
def test_a_gap_in_state_is_said_once_at_resume(tmp_path: Path, mistake: str, said: str | None) -> None:
    r = run(tmp_path, mistake)
    assert r.returncode == 0, r.stderr[-3000:]
    if said is None:  # a correct loop, with an evaluation loader on a sequential DistributedSampler
        assert warnings(r) == [], r.stderr
    else:
        (line,) = warnings(r)
        assert said in line and " Hint: " in line, line


def test_logging_a_tensor_of_many_values_is_one_line(tmp_path: Path) -> None:
    r = run(tmp_path, "log")
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("ddpjob: error:")]
    assert r.returncode == 1 and len(errors) == 1, r.stderr[-3000:]
    assert errors[0].startswith("ddpjob: error: job.log(loss=...) got a Tensor of 16 values, "
                                "expected one number per name. Hint: log a reduction such as loss=loss.mean()"), errors
    assert not list(tmp_path.glob("runs/*/metrics.jsonl")) or all(
        "loss" not in ln for p in tmp_path.glob("runs/*/metrics.jsonl") for ln in p.read_text().splitlines())


def test_set_train_key_that_a_custom_entry_never_reads_is_warned(tmp_path: Path) -> None:
    """`--set train.lr=0.5` with a custom entry was accepted and did nothing."""
    (tmp_path / "e.py").write_text("import ddpjob\njob = ddpjob.init()\nlr = job.config.train.lr\n")
    (tmp_path / "e.toml").write_text('name = "e"\n[train]\nentry = "e.py"\n')
    r = subprocess.run([sys.executable, "-m", "ddpjob", "submit", "e.toml", "--backend", "local", "--dry-run",
                        "--set", "train.lr=0.5", "--set", "train.batch_size=3", "--set", "train.seed=2"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # lr is read by the script, seed by ddpjob itself: only batch_size does nothing
    (line,) = warnings(r)
    assert line.startswith("ddpjob: warning: --set train.batch_size: e.py never reads train.batch_size"), line
    assert "Hint: read it as job.config.train.batch_size, or use a [user] key" in line
    assert not (tmp_path / "runs").exists()


def test_a_rank_out_of_memory_is_one_line_not_an_internal_error(tmp_path: Path) -> None:
    (tmp_path / "oom.py").write_text("import torch\nimport ddpjob\njob = ddpjob.init()\nx = torch.empty(1 << 50)\n")
    (tmp_path / "oom.toml").write_text('name = "oom"\n[train]\nentry = "oom.py"\nthreads = 1\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDPJOB_"))}
    r = subprocess.run([sys.executable, "-m", "ddpjob", "run", "oom.toml", "--run-dir", str(tmp_path / "run")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"})
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("ddpjob: error:")]
    assert r.returncode == 1 and len(errors) == 1, r.stderr[-3000:]
    assert errors[0].startswith("ddpjob: error: rank 0 ran out of host memory at oom.py:4 (RuntimeError: "), errors
    assert "Hint: lower train.batch_size" in errors[0] and "internal error" not in r.stderr
