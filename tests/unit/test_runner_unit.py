"""`ddpjob run`: the same job under every launcher, the shared run dir, exit codes, the
requeue policy, and (marker `cluster`) 2 nodes x 2 tasks under a real srun.
"""

from __future__ import annotations

import sys
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
    from ddpjob.rank import ownerror

    try:
        validate.parse_time_s(None)  # type: ignore[arg-type]  # raised inside ddpjob
    except Exception as exc:
        assert ownerror.theirs(exc, 0) is exc
    else:
        raise AssertionError("parse_time_s(None) raised nothing")


@pytest.mark.parametrize("where", ["script", "module", "package"])
def test_an_entry_with_nul_bytes_is_named(tmp_path: Path, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python's SyntaxError for NUL bytes names no file and no line, so `ddpjob run` said
    "internal error": the entry's own file that holds them is named instead."""
    from ddpjob.errors import DDPJobError
    from ddpjob.rank import entry

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("sys.argv", list(sys.argv))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text("def main():\n    pass\n")
    bad = {"script": tmp_path / "train.py", "module": tmp_path / "pkg" / "mod.py",
           "package": tmp_path / "pkg" / "__init__.py"}[where]
    bad.write_bytes(b"x = 1\x00\n")
    spec = str(bad) if where == "script" else "pkg.mod:main"
    with pytest.raises(DDPJobError, match=f"train.entry {bad} contains NUL bytes, expected Python source"):
        entry.run(spec, [])
    for name in ("pkg", "pkg.mod"):
        sys.modules.pop(name, None)


def test_a_syntax_error_the_entry_raises_itself_stays_its_own(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpjob.rank import entry

    monkeypatch.setattr("sys.argv", list(sys.argv))
    monkeypatch.setattr("sys.path", list(sys.path))
    script = tmp_path / "train.py"
    script.write_text("exec('x = (')\n")
    with pytest.raises(SyntaxError, match="was never closed"):
        entry.run(str(script), [])
