"""`ddpjob verify` through the real CLI: real ranks on the local backend, each interruption caused
at its step by rank/probe.py. Exact on the built-in trainer and both examples (the mistakes:
tests/ranks/test_verify_corpus.py).
The temporary run dirs go into the test's own TMPDIR, which must be empty afterwards."""

from __future__ import annotations

from pathlib import Path

from clirun import ddpjob
from example_jobs import CHARLM, CHARLM_SMALL, CIFAR, CIFAR_SMALL, hook_job
from ranks import base_env



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
    exact = "exact (12 losses, every logged value and every tensor of the final state equal)"
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
