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

from ranks import LAG, PYTHON, REPO, assert_bit_equal, base_env, events, metrics, run

CHARLM = REPO / "examples" / "charlm"
CIFAR = REPO / "examples" / "cifar10_resnet18"
# charlm small enough for a few seconds of training on 2 CPU ranks: 1200-odd windows of 32
CHARLM_SMALL = {"context": 32, "stride": 32, "hidden": 32, "batch_size": 32, "max_steps": 12,
                "log_sample_ids": True, "print_every": 4, "sample_chars": 10}
CIFAR_SMALL = {"epochs": 2, "batch_size": 16, "num_workers": 2}  # 64 images: 4 steps/epoch


def _cli(*args: str, cwd: Path = REPO, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "ddpjob", *args], cwd=cwd, env=base_env(), text=True,
                          capture_output=True, timeout=timeout)


def _hook_job(path: Path, script: Path, base: Path, **sections: dict[str, Any]) -> Path:
    """The example's own job file with `example_hooks:main` as the entry (the script its first
    argument) and `sections` ({"user": {...}}) replacing the values of those keys."""
    values = {"train": {"entry": "example_hooks:main", "args": [str(script)]}}
    for name, table in sections.items():
        values.setdefault(name, {}).update(table)
    lines, section = [], ""
    for line in base.read_text().splitlines():
        if line.startswith("["):
            section = line.split("]")[0].strip("[")
        key = line.split("=")[0].strip()
        if "=" in line and key in values.get(section, {}):
            line = f"{key} = {json.dumps(values[section][key])}"
        lines.append(line)
    path.write_text("\n".join(lines) + "\n")
    return path


def _charlm_job(tmp_path: Path, **user: Any) -> Path:
    return _hook_job(tmp_path / "charlm.toml", CHARLM / "train.py", CHARLM / "job.toml",
                     user={**CHARLM_SMALL, **user}, checkpoint={"every_steps": 5})


def _cifar_job(tmp_path: Path) -> Path:
    from ddpjob.train.fixtures import write_cifar10_folder

    write_cifar10_folder(tmp_path / "cifar", n_train=64, n_test=32)
    return _hook_job(tmp_path / "cifar.toml", CIFAR / "train.py", CIFAR / "job.toml",
                     user={**CIFAR_SMALL, "data_root": str(tmp_path / "cifar")},
                     checkpoint={"every_steps": 3, "async": False},
                     slurm={"tasks_per_node": 2, "gpus_per_node": 0, "cpus_per_task": 1},
                     train={"entry": "example_hooks:main", "args": [str(CIFAR / "train.py")], "threads": 1})


def _losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in metrics(run_dir).items()}


def _assert_completed(run_dir: Path) -> None:
    assert (run_dir / "final" / "model.pt").is_file()
    assert (run_dir / "COMPLETED").is_file()


def _interrupt_and_resume(tmp_path: Path, job: Path, world: int, at: int, resume_world: int) -> Path:
    out = tmp_path / "interrupted"
    codes, r = run([str(job), "--run-dir", str(out)], world, tmp_path / "logs",
                   extra_env={"DDPJOB_TEST_STOP_AT": str(at)})
    assert codes == [3] * world, r.output()
    stop = [e for e in events(out) if e["event"] == "stop"][0]
    assert stop["reason"] == "time_limit" and stop["step"] == at + 1 + LAG, stop  # the step in flight finishes, and the vote's
    codes, r = run([str(out)], resume_world, tmp_path / "logs", restart=1)
    assert codes == [0] * resume_world, r.output()
    _assert_completed(out)
    return out


# ------------------------------------------------------------------ charlm
@pytest.fixture(scope="module")
def charlm_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("charlm_ref")
    codes, r = run([str(_charlm_job(d)), "--run-dir", str(d / "run")], 2, d / "logs")
    assert codes == [0, 0], r.output()
    return d / "run"


def test_charlm_runs_to_completion_with_submit_local(tmp_path: Path) -> None:
    """The README path: the shipped job file through `ddpjob submit --backend local --wait`."""
    out = tmp_path / "run"
    sets = [f"--set=user.{k}={json.dumps(v)}" for k, v in CHARLM_SMALL.items()]
    p = _cli("submit", str(CHARLM / "job.toml"), "--backend", "local", "--wait",
             "--run-dir", str(out), *sets)
    assert p.returncode == 0, p.stdout + p.stderr
    _assert_completed(out)
    assert len(_losses(out)) == CHARLM_SMALL["max_steps"]
    log = (out / "logs" / "rank-0.log").read_text()
    assert "sample:" in log and "step 12/12" in log


def test_charlm_interrupted_resumes_bit_exactly(tmp_path: Path, charlm_reference: Path) -> None:
    """SIGUSR2 to both ranks during step 6 (dropout, AdamW, OneCycleLR, 2 workers per rank)."""
    import torch

    out = _interrupt_and_resume(tmp_path, _charlm_job(tmp_path), 2, 6, 2)
    assert_bit_equal(torch.load(charlm_reference / "final" / "model.pt"),
                     torch.load(out / "final" / "model.pt"), "model")
    assert _losses(out) == _losses(charlm_reference)
    assert len(_losses(out)) == CHARLM_SMALL["max_steps"]


def _samples_by_step(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """step -> that step's records from the newest restart that ran it (replays win)."""
    by_step: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for path in sorted((run_dir / "samples").glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            by_step.setdefault(rec["step"], {}).setdefault(rec["restart"], []).append(rec)
    return {step: runs[max(runs)] for step, runs in by_step.items()}


@pytest.mark.slow  # 4 ranks with 2 workers each on 2 cores
def test_charlm_elastic_4_to_2_sees_every_sample_once_per_epoch(tmp_path: Path) -> None:
    """Stopped mid-epoch on 4 ranks, resumed on 2: the global batch stays 32 and every window
    is seen exactly once in each full epoch."""
    windows = (38664 - 32 - 1) // 32 + 1  # tiny.txt's length, context 32, stride 32
    steps_per_epoch = windows // 32
    total = steps_per_epoch + 8  # one full epoch and part of the next
    job = _charlm_job(tmp_path, max_steps=total)
    out = _interrupt_and_resume(tmp_path, job, 4, 20, 2)
    samples = _samples_by_step(out)
    assert sorted(samples) == list(range(1, total + 1))
    for step, recs in samples.items():
        assert sum(len(r["ids"]) for r in recs) == 32, step  # the global batch at any world size
        assert {r["world_size"] for r in recs} == ({4} if step <= 21 + LAG else {2}), step
    epoch0 = [i for s in range(1, steps_per_epoch + 1) for r in samples[s] for i in r["ids"]]
    assert len(epoch0) == len(set(epoch0)) == steps_per_epoch * 32
    epoch1 = [i for s in range(steps_per_epoch + 1, total + 1) for r in samples[s] for i in r["ids"]]
    assert len(epoch1) == len(set(epoch1))


# ------------------------------------------------------------------ cifar10_resnet18
@pytest.mark.slow  # ResNet-18 on CPU: three 2-rank runs
def test_cifar_converted_script_resumes_bit_exactly(tmp_path: Path) -> None:
    """PIL RandomCrop/flip in 2 DataLoader workers per rank, SGD + cosine: a run stopped during
    step 4 (epoch 1 starts at 4) and resumed equals an uninterrupted one, bit for bit."""
    import torch

    job = _cifar_job(tmp_path)
    ref = tmp_path / "reference"
    codes, r = run([str(job), "--run-dir", str(ref)], 2, tmp_path / "logs")
    assert codes == [0, 0], r.output()
    _assert_completed(ref)
    assert "epoch 1: test accuracy" in r.output(0)
    out = _interrupt_and_resume(tmp_path, job, 2, 4, 2)
    assert_bit_equal(torch.load(ref / "final" / "model.pt"), torch.load(out / "final" / "model.pt"), "model")
    assert _losses(out) == _losses(ref) and len(_losses(ref)) == 8


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


def _failed_run(tmp_path: Path, job: Path) -> tuple[Path, str]:
    """`ddpjob submit JOB --backend local --wait` of a failing entry: exit 1, the FAILED summary,
    a stop record with reason crash and no requeue; returns the run dir and rank 0's log."""
    out = tmp_path / "run"
    p = _cli("submit", str(job), "--backend", "local", "--wait", "--run-dir", str(out))
    assert p.returncode == 1, p.stdout + p.stderr
    assert [x for x in (p.stdout + p.stderr).splitlines() if "FAILED" in x] == \
        [f"ddpjob: {out}: FAILED (exit codes [1])"]
    stops = [e for e in events(out) if e["event"] == "stop"]
    assert [s["reason"] for s in stops if "rank" in s] == ["crash"], stops  # the rank's own record
    (decision,) = [s for s in stops if "rank" not in s]  # the supervisor's: not retried
    assert decision["reason"] == "crash" and decision["requeued"] is None, decision
    assert "max_failures = 0 reached: not retrying" in decision["note"], decision
    assert [e["restart"] for e in events(out) if e["event"] == "local_start"] == [0]  # no requeue
    assert not (out / "COMPLETED").exists()
    return out, (out / "logs" / "rank-0.log").read_text()


def test_missing_script_is_refused_at_submit(tmp_path: Path) -> None:
    p = _cli("submit", str(_entry_job(tmp_path, "no_such_script.py")), "--backend", "local", "--dry-run")
    assert p.returncode == 2, p.stdout + p.stderr
    (line,) = _error_lines(p.stderr)
    assert "train.entry script 'no_such_script.py' not found" in line and "Hint: " in line


def test_script_missing_at_run_time_fails_in_one_line(tmp_path: Path) -> None:
    script = tmp_path / "gone.py"
    script.write_text("import ddpjob\n")
    job = _entry_job(tmp_path, str(script))
    out = tmp_path / "run"
    p = _cli("submit", str(job), "--backend", "local", "--dry-run", "--run-dir", str(out))
    assert p.returncode == 0, p.stderr
    from ddpjob import config, rundir

    rundir.prepare(out, config.resolve(job, [], {}))  # the run dir as submit leaves it
    script.unlink()  # e.g. deleted, or not on the nodes' filesystem
    codes, r = run([str(out)], 1, tmp_path / "logs")
    assert codes == [1], r.output()
    (line,) = _error_lines(r.output(0))
    assert f"train.entry script '{script}' does not exist" in line
    assert "Traceback" not in r.output(0)


@pytest.mark.parametrize("entry, at_submit, at_run", [
    ("no_such_package.train:main", "module 'no_such_package.train' is not importable here",
     "cannot be imported (no module named 'no_such_package')"),
    ("example_hooks:no_such_function", "defines no 'no_such_function'", "has no function 'no_such_function'"),
    ("example_hooks:mian", "did you mean 'main'?", "has no function 'mian', expected a callable taking no "
     "arguments. Hint: did you mean 'main'? define `def mian():` in "),
])
def test_bad_function_entry_is_refused_at_submit_and_fails_in_one_line_on_the_nodes(
        tmp_path: Path, entry: str, at_submit: str, at_run: str) -> None:
    """Found out on the login node, not after the queue wait; and where the nodes see it anyway
    (a package only some machines have), the rank says so in one line."""
    from ddpjob import config, rundir

    job = _entry_job(tmp_path, entry)
    p = _cli("submit", str(job), "--backend", "local", "--run-dir", str(tmp_path / "refused"))
    assert p.returncode == 1, p.stdout + p.stderr
    (line,) = _error_lines(p.stderr)
    assert "preflight check 'entry' failed: " in line and at_submit in line, line
    assert not (tmp_path / "refused").exists()
    out = tmp_path / "run"
    rundir.prepare(out, config.resolve(job, [], {}))  # the run dir as submit would have left it
    codes, r = run([str(out)], 1, tmp_path / "logs")
    assert codes == [1], r.output()
    (line,) = _error_lines(r.output(0))
    assert at_run in line and "Hint: " in line
    assert "Traceback" not in r.output(0)


def test_script_returning_without_finish_fails(tmp_path: Path) -> None:
    script = tmp_path / "nofinish.py"
    script.write_text("import ddpjob\njob = ddpjob.init()\nprint('trained, forgot finish')\n")
    _, log = _failed_run(tmp_path, _entry_job(tmp_path, str(script)))
    (line,) = _error_lines(log)
    assert "returned without job.finish()" in line and "Hint: call job.finish(model)" in line


def test_script_raising_keeps_traceback_fails_and_is_not_requeued(tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    script.write_text("import ddpjob\njob = ddpjob.init()\n\n\ndef build():\n"
                      "    raise ValueError('bad hidden size 0')\n\n\nbuild()\n")
    out, log = _failed_run(tmp_path, _entry_job(tmp_path, str(script)))
    # the copy frozen at submission is what ran (ddpjob/freeze.py)
    assert "Traceback" in log and f'File "{out}/code/entry/boom.py", line 6, in build' in log
    (line,) = _error_lines(log)
    assert "ValueError: bad hidden size 0" in line
    stop = [e for e in events(out) if e["event"] == "stop"][0]
    assert "ValueError: bad hidden size 0" in stop["error"]


# ------------------------------------------------------------------ [user] and --set
def test_user_table_and_set_keep_types_and_refuse_a_wrong_type(tmp_path: Path) -> None:
    from ddpjob import config

    job = CHARLM / "job.toml"
    cfg = config.resolve(job, ["user.lr=0.01", "user.schedule=cosine", "user.layers=3",
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
        config.resolve(job, ["user.lrr=0.01"], {})
    with pytest.raises(config.UsageError, match="gives user.max_steps a float"):
        config.resolve(job, ["user.max_steps=300.5"], {})
    lr = config.resolve(job, ["user.lr=1"], {}).user["lr"]
    assert lr == 1.0 and type(lr) is float
    # without a [user] table in the job file (ddpjob.init() alone) there is nothing to check against
    bare = tmp_path / "bare.toml"
    bare.write_text('name = "t"\n')
    assert config.resolve(bare, ["user.anything=2"], {}).user == {"anything": 2}


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


def test_script_alone_reads_its_job_file_from_any_working_directory(tmp_path: Path) -> None:
    """`python path/to/train.py` (or torchrun) started elsewhere than the repository root: the
    job file's relative train.entry does not resolve from there, and need not (this script is
    what runs); the run dir records the script's absolute path."""
    script = tmp_path / "proj" / "sub" / "s.py"
    script.parent.mkdir(parents=True)
    (tmp_path / "proj" / "job.toml").write_text('name = "t"\n[train]\nentry = "proj/sub/s.py"\nthreads = 1\n'
                                                '[user]\nsteps = 2\n')
    script.write_text("import os, torch, ddpjob\n"
                      "job = ddpjob.init(os.path.join(os.path.dirname(__file__), '..', 'job.toml'))\n"
                      "model = job.wrap(torch.nn.Linear(2, 1))\n"
                      "state = {'model': model}\njob.resume(state)\n"
                      "for step in job.steps(state, job.user['steps']):\n    job.log(step + 1, x=step)\n"
                      "job.finish(model)\nprint('run dir', job.run_dir)\n")
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    p = subprocess.run([PYTHON, str(script)], cwd=cwd, env=base_env(), text=True, capture_output=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    (run_dir,) = (cwd / "runs").iterdir()
    _assert_completed(run_dir)
    assert json.loads((run_dir / "config.json").read_text())["train"]["entry"] == str(script)
