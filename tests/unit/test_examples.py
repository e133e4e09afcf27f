"""The public API's two examples (examples/charlm, examples/cifar10_resnet18) as a user runs them,
bad `train.entry` values through the real CLI, and the StepSampler's promises.

Interruptions are caused at a given step by tests/example_hooks.py (a wrapper entry: the
examples carry no test code), never by a timer.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from clirun import ddpjob
from example_jobs import CHARLM, CIFAR
from ranks import REPO, base_env


def _cli(*args: str, cwd: Path = REPO, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return ddpjob(*args, cwd=cwd, env=base_env(), timeout=timeout)


def test_cifar_example_changes_at_most_20_lines() -> None:
    diff = subprocess.run(["diff", "-U0", str(CIFAR / "train_plain.py"), str(CIFAR / "train.py")],
                          capture_output=True, text=True).stdout
    changed = [x for x in diff.splitlines() if x[:1] in "-+" and x[1:2] not in ("-", "+")]
    assert 0 < len(changed) <= 20, "\n".join(changed)


# ------------------------------------------------------------------ bad train.entry values
def _entry_job(tmp_path: Path, entry: str, args: list[str] | None = None) -> Path:
    job = tmp_path / "job.toml"
    job.write_text(f'name = "t"\n[train]\nentry = {json.dumps(entry)}\nargs = {json.dumps(args or [])}\n'
                   "threads = 1\n[slurm]\ntasks_per_node = 1\n")
    return job


def _error_lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.startswith("ddpjob: error:")]


def test_missing_script_is_refused_at_submit(tmp_path: Path) -> None:
    p = _cli("submit", str(_entry_job(tmp_path, "no_such_script.py")), "--backend", "local", "--dry-run")
    assert p.returncode == 2, p.stdout + p.stderr
    (line,) = _error_lines(p.stderr)
    assert "train.entry script 'no_such_script.py' not found" in line and "Hint: " in line


# ------------------------------------------------------------------ [user] and --set
def test_user_table_and_set_keep_types_and_refuse_a_wrong_type(tmp_path: Path) -> None:
    from ddpjob import config, jobfile

    job = CHARLM / "job.toml"
    cfg = jobfile.resolve(job, ["user.lr=0.01", "user.schedule=cosine", "user.layers=3",
                               "user.log_sample_ids=true"], {})
    assert cfg.user["lr"] == 0.01 and cfg.user["schedule"] == "cosine"
    assert cfg.user["layers"] == 3 and cfg.user["log_sample_ids"] is True
    assert cfg.user["hidden"] == 128  # untouched keys keep the job file's value
    p = _cli("submit", str(job), "--backend", "local", "--dry-run", "--set", "user.layers=two")
    assert p.returncode == 2, p.stdout + p.stderr
    (line,) = _error_lines(p.stderr)
    assert "user.layers a str" in line and "expected the same type" in line
    # a typo is not a new key, an integer stays one, a float takes an integer
    with pytest.raises(config.UsageError, match=r"names user.lrr, which the job file's \[user\] table does not have.*"
                                                r"did you mean 'lr'\?"):
        jobfile.resolve(job, ["user.lrr=0.01"], {})
    with pytest.raises(config.UsageError, match="gives user.max_steps a float"):
        jobfile.resolve(job, ["user.max_steps=300.5"], {})
    lr = jobfile.resolve(job, ["user.lr=1"], {}).user["lr"]
    assert lr == 1.0 and type(lr) is float
    # without a [user] table in the job file (ddpjob.init() alone) there is nothing to check against
    bare = tmp_path / "bare.toml"
    bare.write_text('name = "t"\n')
    assert jobfile.resolve(bare, ["user.anything=2"], {}).user == {"anything": 2}


def test_dry_run_shows_entry_and_args(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    p = _cli("submit", str(_entry_job(tmp_path, str(script), ["--lr", "0.1"])), "--backend", "local",
             "--dry-run")
    assert p.returncode == 0, p.stderr
    assert f"# train.entry: {script}; train.args: --lr 0.1" in p.stdout
    p = _cli("submit", str(CHARLM / "job.toml"), "--backend", "local", "--dry-run")
    assert f"# train.entry: {CHARLM / 'train.py'}; train.args: (none)" in p.stdout


# ------------------------------------------------------------------ StepSampler
def _sampler(n: int = 103, batch: int = 12, seed: int = 5, **kw: Any) -> Any:
    from ddpjob import StepSampler

    return StepSampler(n, batch, seed, **kw)


def test_sampler_order_is_a_function_of_seed_epoch_step() -> None:
    a, b = _sampler(rank=0, world_size=1), _sampler(rank=0, world_size=1)
    for step in (17, 3, 0, 8, 9, 25):  # any order of asking, fresh or reused permutations
        assert a.global_indices(step).tolist() == b.global_indices(step).tolist()
    assert a.steps_per_epoch == 8 and a.epoch_of(7) == 0 and a.epoch_of(8) == 1
    assert a.global_indices(0).tolist() != a.global_indices(8).tolist()  # epochs reshuffle
    assert a.global_indices(0).tolist() != _sampler(seed=6, rank=0, world_size=1).global_indices(0).tolist()
    plain = _sampler(shuffle=False, rank=0, world_size=1)
    assert plain.global_indices(9).tolist() == list(range(12, 24))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 12])
def test_sampler_ranks_split_the_global_batch_and_see_each_sample_once(world: int) -> None:
    samplers = [_sampler(rank=r, world_size=world) for r in range(world)]
    g = samplers[0]
    for step in range(2 * g.steps_per_epoch):
        shares = [s.indices(step).tolist() for s in samplers]
        assert all(len(x) == 12 // world for x in shares)
        assert sum(shares, []) == g.global_indices(step).tolist()  # rank order, contiguous
    epoch = sum((g.global_indices(s).tolist() for s in range(g.steps_per_epoch)), [])
    assert len(set(epoch)) == len(epoch) == 96  # 103 // 12 * 12: the last 7 are dropped


def test_sampler_resumed_at_another_world_size_mid_epoch_sees_each_sample_once() -> None:
    before = [_sampler(rank=r, world_size=4) for r in range(4)]
    seen: list[int] = []
    its = [iter(s) for s in before]
    for _ in range(3):  # steps 0..2 on 4 ranks
        for it in its:
            seen += next(it)
    state = before[0].state_dict()
    state["step"] = 3  # what job.steps() saved
    after = [_sampler(rank=r, world_size=2) for r in range(2)]
    for s in after:
        s.load_state_dict(state)
    its = [iter(s) for s in after]
    for _ in range(3, after[0].steps_per_epoch):
        for it in its:
            seen += next(it)
    assert len(seen) == len(set(seen)) == 96


@pytest.mark.parametrize("key, value", [("dataset_len", 104), ("global_batch", 24), ("seed", 6),
                                        ("shuffle", False)])
def test_sampler_refuses_a_checkpoint_of_another_data_order(key: str, value: Any) -> None:
    from ddpjob.errors import DDPJobError

    state = {**_sampler(rank=0, world_size=1).state_dict(), key: value, "step": 4}
    with pytest.raises(DDPJobError) as err:
        _sampler(rank=0, world_size=1).load_state_dict(state)
    assert f"the checkpoint's data order has {key} = {value!r}" in err.value.line()


def test_sampler_rejects_a_batch_the_ranks_cannot_split() -> None:
    from ddpjob.errors import DDPJobError

    with pytest.raises(DDPJobError, match="cannot be split over 5 rank"):
        _sampler(rank=0, world_size=5)
    with pytest.raises(DDPJobError, match="larger than the dataset"):
        _sampler(n=10, rank=0, world_size=1)


class _Noisy:
    """A dataset whose samples carry a random draw, like a random crop would."""

    def __len__(self) -> int:
        return 103

    def __getitem__(self, i: int) -> tuple[int, float]:
        import torch

        return i, float(torch.rand(()))


def test_sampler_as_batch_sampler_with_two_workers_is_reproducible_after_a_resume() -> None:
    """A DataLoader with num_workers=2 yields the sampler's batches in order, and the random
    draws in the workers depend only on (seed, epoch, sample): a loader started at step 5 (a
    resume) reads exactly what the uninterrupted loader read from step 5 on."""
    from torch.utils.data import DataLoader

    whole = _sampler(rank=1, world_size=2)
    loader = iter(DataLoader(_Noisy(), batch_sampler=whole, num_workers=2))
    reference = [next(loader) for _ in range(12)]
    for step, (ids, _) in enumerate(reference):
        assert ids.tolist() == whole.indices(step).tolist()
    resumed = _sampler(rank=1, world_size=2)
    resumed.set_step(5)
    loader = iter(DataLoader(_Noisy(), batch_sampler=resumed, num_workers=2))
    for step in range(5, 12):
        ids, draws = next(loader)
        assert ids.tolist() == reference[step][0].tolist()
        assert draws.tolist() == reference[step][1].tolist()
