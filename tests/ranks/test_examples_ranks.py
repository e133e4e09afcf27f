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

from example_jobs import CHARLM, CHARLM_SMALL, CIFAR, CIFAR_SMALL, hook_job, samples_by_step
from ranks import LAG, PYTHON, assert_bit_equal, base_env, events, metrics, run
from runlogs import decisions, rank_crashes
from test_examples import _cli, _entry_job, _error_lines


def _charlm_job(tmp_path: Path, **user: Any) -> Path:
    return hook_job(tmp_path / "charlm.toml", CHARLM / "train.py", CHARLM / "job.toml",
                     user={**CHARLM_SMALL, **user}, checkpoint={"every_steps": 5})


def _cifar_job(tmp_path: Path) -> Path:
    from ddpjob.train.fixtures import write_cifar10_folder

    write_cifar10_folder(tmp_path / "cifar", n_train=64, n_test=32)
    return hook_job(tmp_path / "cifar.toml", CIFAR / "train.py", CIFAR / "job.toml",
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
    stop = decisions(events(out))[0]
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


@pytest.mark.slow  # 4 ranks with 2 workers each on 2 cores
def test_charlm_elastic_4_to_2_sees_every_sample_once_per_epoch(tmp_path: Path) -> None:
    """Stopped mid-epoch on 4 ranks, resumed on 2: the global batch stays 32 and every window
    is seen exactly once in each full epoch."""
    windows = (38664 - 32 - 1) // 32 + 1  # tiny.txt's length, context 32, stride 32
    steps_per_epoch = windows // 32
    total = steps_per_epoch + 8  # one full epoch and part of the next
    job = _charlm_job(tmp_path, max_steps=total)
    out = _interrupt_and_resume(tmp_path, job, 4, 20, 2)
    samples = samples_by_step(out)
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


def _failed_run(tmp_path: Path, job: Path) -> tuple[Path, str]:
    """`ddpjob submit JOB --backend local --wait` of a failing entry: exit 1, the FAILED summary,
    a stop record with reason crash and no requeue; returns the run dir and rank 0's log."""
    out = tmp_path / "run"
    p = _cli("submit", str(job), "--backend", "local", "--wait", "--run-dir", str(out))
    assert p.returncode == 1, p.stdout + p.stderr
    (failed,) = [x for x in (p.stdout + p.stderr).splitlines() if "FAILED" in x]
    assert failed.startswith(f"ddpjob: {out}: FAILED (not retried: rank 0's ") and "is the code's own" in failed
    stops = [e for e in events(out) if e["event"] == "stop"]
    assert [s["reason"] for s in rank_crashes(stops)] == ["crash"], stops  # the rank's own record
    (decision,) = decisions(stops)  # the supervisor's: not retried
    assert decision["reason"] == "crash" and decision["requeued"] is None, decision
    assert decision["verdict"] == "user" and "not retried" in decision["note"], decision  # by default
    assert [e["restart"] for e in events(out) if e["event"] == "local_start"] == [0]  # no requeue
    assert not (out / "COMPLETED").exists()
    return out, (out / "logs" / "rank-0.log").read_text()


def test_script_missing_at_run_time_fails_in_one_line(tmp_path: Path) -> None:
    script = tmp_path / "gone.py"
    script.write_text("import ddpjob\n")
    job = _entry_job(tmp_path, str(script))
    out = tmp_path / "run"
    p = _cli("submit", str(job), "--backend", "local", "--dry-run", "--run-dir", str(out))
    assert p.returncode == 0, p.stderr
    from ddpjob import jobfile, rundir

    rundir.prepare(out, jobfile.resolve(job, [], {}))  # the run dir as submit leaves it
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
    from ddpjob import jobfile, rundir

    job = _entry_job(tmp_path, entry)
    p = _cli("submit", str(job), "--backend", "local", "--run-dir", str(tmp_path / "refused"))
    assert p.returncode == 1, p.stdout + p.stderr
    (line,) = _error_lines(p.stderr)
    assert "preflight check 'entry' failed: " in line and at_submit in line, line
    assert not (tmp_path / "refused").exists()
    out = tmp_path / "run"
    rundir.prepare(out, jobfile.resolve(job, [], {}))  # the run dir as submit would have left it
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
    stop = rank_crashes(events(out))[0]  # the rank's own record of its error
    assert "ValueError: bad hidden size 0" in stop["error"]


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
