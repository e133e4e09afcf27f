"""`ddpjob verify` through the real CLI: real ranks on the local backend, each interruption caused
at its step by rank/probe.py. Exact on the built-in trainer and both examples; on
tests/verify_scripts/tinygpt.py's mistakes it names the first diverging step and the cause.
The temporary run dirs go into the test's own TMPDIR, which must be empty afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from clirun import REPO, ddpjob
from example_jobs import CHARLM, CHARLM_SMALL, CIFAR, CIFAR_SMALL, hook_job
from ranks import base_env

TINYGPT = REPO / "tests" / "verify_scripts" / "tinygpt.toml"


def _verify(tmp_path: Path, job: Path | str, *args: str) -> tuple[int, str]:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = ddpjob("verify", str(job), *args, env=base_env({"TMPDIR": str(tmp)}), timeout=600)
    assert list(tmp.glob("ddpjob-verify-*")) == [], "verify left its run dirs behind"
    return p.returncode, p.stdout + p.stderr


def _lines(out: str) -> dict[str, str]:
    kinds = ("signal", "kill", "stop", "world")
    return {line.split()[0]: line for line in out.splitlines() if line.split()[:1] and line.split()[0] in kinds}


def test_smoke_is_exact_under_every_interruption_and_close_at_another_world_size(tmp_path: Path) -> None:
    code, out = _verify(tmp_path, "jobs/smoke.toml", "--steps", "12", "--seed", "0")
    assert code == 0, out
    lines = _lines(out)
    assert sorted(lines) == ["kill", "signal", "stop", "world"], out
    exact = "exact (12 losses, every tensor of the final state equal)"
    assert all(exact in lines[k] for k in ("signal", "kill", "stop"))
    assert ": close: " in lines["world"] and "1 rank(s)" in lines["world"]
    assert "4 of 4 kind(s) passed" in out and " s in all" in out


def test_charlm_is_exact(tmp_path: Path) -> None:
    job = hook_job(tmp_path / "charlm.toml", CHARLM / "train.py", CHARLM / "job.toml",
                   user={**CHARLM_SMALL, "log_sample_ids": False})
    code, out = _verify(tmp_path, job, "--steps", "10", "--seed", "0")
    assert code == 0, out
    assert sum("exact (10 losses" in line for line in _lines(out).values()) == 3 and ": close: " in out, out


def test_cifar_example_is_exact(tmp_path: Path) -> None:
    """Its step budget is epochs x the set's steps per epoch: verify says so and runs it as is."""
    from ddpjob.train.fixtures import write_cifar10_folder

    write_cifar10_folder(tmp_path / "cifar", n_train=64, n_test=32)
    job = hook_job(tmp_path / "cifar.toml", CIFAR / "train.py", CIFAR / "job.toml",
                   user={**CIFAR_SMALL, "data_root": str(tmp_path / "cifar")}, checkpoint={"async": False},
                   train={"entry": "example_hooks:main", "args": [str(CIFAR / "train.py")], "threads": 1})
    code, out = _verify(tmp_path, job, "--kinds", "signal,kill,stop", "--seed", "0")
    assert code == 0, out
    assert "it runs as configured" in out and "2 ranks instead of the job's 4" in out
    assert sum("exact (8 losses" in line for line in _lines(out).values()) == 3, out


@pytest.mark.parametrize("mistake, cause", [
    ("prefetch", "while the RNG files are equal: a batch made before `resume()`, or a prefetch"),
    ("own_generator", "the generator `gen (rank 0)` held outside `state` differs: an own generator"),
    ("generator_in_state", "rank 1's `gen` equals rank 0's after the resume: a per-rank object saved through `state`"),
])
def test_each_mistake_is_named_with_its_first_diverging_step(tmp_path: Path, mistake: str, cause: str) -> None:
    code, out = _verify(tmp_path, TINYGPT, "--kinds", "stop", "--at", "5", "--steps", "10",
                        "--set", f"user.mistake={mistake}")
    assert code == 1, out
    # paused as step 5 was handed out, the overlapped vote stops after step 7: step 8 differs first
    assert "losses differ from step 8 " in _lines(out)["stop"] and cause in out, out


def test_the_right_loop_is_exact(tmp_path: Path) -> None:
    code, out = _verify(tmp_path, TINYGPT, "--kinds", "stop,kill", "--at", "5", "--steps", "10")
    assert code == 0 and out.count("exact (10 losses") == 2, out


def test_the_per_rank_way_is_exact(tmp_path: Path) -> None:
    """The own per-rank generator of `generator_in_state`, put into `state` as ddpjob.PerRank: each
    rank's stream is saved and restored as its own, so the resumes are exact again."""
    code, out = _verify(tmp_path, TINYGPT, "--kinds", "stop,kill", "--at", "5", "--steps", "10",
                        "--set", "user.mistake=per_rank")
    assert code == 0 and out.count("exact (10 losses") == 2, out
