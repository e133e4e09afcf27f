"""ddpjob verify's plan (launch/verify.py): how it makes a job small and restartable here, and
its usage errors through the CLI. The runs themselves: tests/ranks/test_verify_ranks.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from clirun import REPO, ddpjob
from ddpjob import jobfile
from ddpjob.launch import verify


def _plan(job: Path, *sets: str) -> tuple[verify.Plan, list[str]]:
    return verify.plan(job, jobfile.resolve(job, list(sets)), list(sets), 30)


@pytest.fixture(autouse=True)
def two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verify.os, "cpu_count", lambda: 2)


def test_the_builtin_trainer_gets_its_step_count_every_loss_and_its_global_batch() -> None:
    p, notes = _plan(REPO / "jobs" / "smoke.toml")
    assert {"train.max_steps=30", "train.log_every=1", "train.global_batch_size=64",
            "slurm.tasks_per_node=2", "slurm.max_failures=0"} <= set(p.sets)
    assert (p.world, p.other, notes) == (2, 1, [])


def test_a_script_reading_user_max_steps_is_shortened_through_it_after_the_users_sets() -> None:
    p, _ = _plan(REPO / "examples" / "charlm" / "job.toml", "user.lr=0.01")
    assert p.sets[0] == "user.lr=0.01" and "user.max_steps=30" in p.sets


def test_a_loop_verify_cannot_shorten_runs_as_configured_and_a_big_job_on_2_ranks() -> None:
    p, notes = _plan(REPO / "examples" / "cifar10_resnet18" / "job.toml")
    assert not any(s.startswith("user.") for s in p.sets) and p.world == 2
    assert any("it runs as configured" in n for n in notes)
    assert any("2 ranks instead of the job's 4" in n for n in notes)


@pytest.mark.parametrize("args, found", [
    (["--kinds", "signal,bogus"], "--kinds 'signal,bogus' names bogus, expected a comma-separated list"),
    (["--steps", "3"], "--steps 3 is too few, expected at least 6"),
    (["--at", "29"], "--at 29 is outside the run, expected 1..27"),
])
def test_usage_errors_are_one_line_before_anything_runs(args: list[str], found: str) -> None:
    p = ddpjob("verify", "jobs/smoke.toml", *args)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and found in p.stderr, p.stderr


def test_kinds_that_all_resumed_before_a_late_change_of_a_logged_value_get_the_at_hint(tmp_path: Path) -> None:
    lines = [f'{{"step": {s}, "restart": 0, "loss": {3 - s / 100}, "lr": {0.01 if s < 17 else 0.0025}}}'
             for s in range(1, 31)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    hint = verify._late_change(tmp_path, 30, [6, 8])
    assert hint == ("verify: every kind resumed before step 17, where `lr` changes (0.01 vs 0.0025): a value outside "
                    "`state` shows only in a resume after it. Hint: rerun with --at 18")
    assert verify._late_change(tmp_path, 30, [16, 8]) is None
    every_step = [line.replace('"lr": ', '"lr": 0.0001 * ' and '"lr": ') for line in lines]
    (tmp_path / "metrics.jsonl").write_text("\n".join(l.replace("}", f', "t": {i}}}') for i, l in enumerate(every_step)))
    assert "`t`" not in (verify._late_change(tmp_path, 30, [6]) or "")  # a value that changes at every step


def test_a_failed_run_points_at_its_logs_without_asking_for_keep_when_kept(tmp_path: Path) -> None:
    from ddpjob.launch import runs

    (tmp_path / "job.json").write_text("{}")
    kept = verify._ended(tmp_path, "FAILED", keep=True)
    assert kept is not None and "--keep" not in kept and str(tmp_path / "logs") in kept
    assert "rerun with --keep" in (verify._ended(tmp_path, "FAILED") or "")
    assert runs is not None
