"""`ddpjob run`: the same job under every launcher, the shared run dir, exit codes, the
requeue policy, and (marker `cluster`) 2 nodes x 2 tasks under a real srun.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpjob import cli, config, rundir, validate


def test_run_dir_target_refuses_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / rundir.CONFIG).write_text(config.JobConfig().to_json())
    assert cli.main(["run", str(tmp_path / "run"), "--set", "train.lr=0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.json is fixed" in err[0]
    assert cli.main(["run", str(tmp_path / "nope.toml")]) == 2


def test_an_error_inside_ddpjob_stays_an_internal_error() -> None:
    from ddpjob.rank import runner

    try:
        validate.parse_time_s(None)  # type: ignore[arg-type]  # raised inside ddpjob
    except Exception as exc:
        assert runner._theirs(exc, 0) is exc
    else:
        raise AssertionError("parse_time_s(None) raised nothing")
