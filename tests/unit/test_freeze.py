"""freeze.py, in-process: what a submission freezes of the user's code (git-tracked files as in
the work tree, a plain folder, plugin packages), the modes and the size limit. The runs that use
the frozen copy are in tests/ranks/test_freeze_ranks.py."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest

from ddpjob import config, jobfile, rundir
from ddpjob.errors import DDPJobError
from ddpjob import freeze

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "jobs" / "smoke.toml"


def _cfg(**train: object) -> config.JobConfig:
    cfg = jobfile.resolve(SMOKE)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))


def _git(folder: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(folder), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                   check=True, capture_output=True)


def test_a_git_checkout_is_frozen_as_its_work_tree_tracked_files_only(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "train.py").write_text("import helper\n")
    (repo / "src" / "helper.py").write_text("X = 1\n")
    (repo / "README").write_text("hi\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "one")
    (repo / "src" / "helper.py").write_text("X = 2\n")  # uncommitted: frozen as it is
    (repo / "scratch.py").write_text("untracked\n")    # untracked: not frozen
    cfg = _cfg(entry=str(repo / "src" / "train.py"))
    found = freeze.collect(cfg)
    names = {rel for rel, _ in found["files"]}
    assert {"repo/src/train.py", "repo/src/helper.py", "repo/README"} <= names
    assert "repo/scratch.py" not in names and "python/ddpjob/api.py" in names
    assert found["entry"] == "repo/src/train.py" and found["git"]["dirty"] is True
    run = tmp_path / "run"
    rundir.make_dir(run)
    rec = freeze.freeze(cfg, run)
    assert (run / "code" / "repo" / "src" / "helper.py").read_text() == "X = 2\n"
    assert freeze.frozen_entry(run, cfg) == str(run / "code" / "repo" / "src" / "train.py")
    assert rec["hash"] == freeze.digest(freeze.collect(cfg)["files"])
    modes = {p.stat().st_mode & 0o777 for p in (run / "code").rglob("*")}
    assert modes == {0o700, 0o600}  # the run dir's modes, not the sources'
    (repo / "scratch.py").write_text("changed\n")
    assert freeze.digest(freeze.collect(cfg)["files"]) == rec["hash"]  # untracked: not the code
    (repo / "src" / "helper.py").write_text("X = 3\n")
    assert freeze.digest(freeze.collect(cfg)["files"]) != rec["hash"]


def test_a_plain_folder_and_a_plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "train.py").write_text("pass\n")
    (tmp_path / "job" / "util.py").write_text("pass\n")
    (tmp_path / "plug").mkdir()
    (tmp_path / "plug" / "my_models.py").write_text("def net(num_classes): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path / "plug"))
    cfg = _cfg(entry=str(tmp_path / "job" / "train.py"), model="my_models:net")
    found = freeze.collect(cfg)
    names = {rel for rel, _ in found["files"]}
    assert {"entry/train.py", "entry/util.py", "python/my_models.py"} <= names
    assert found["not_frozen"] == [] and found["git"] is None
    missing = freeze.collect(_cfg(model="nowhere_to_be_found:net"))
    assert missing["not_frozen"] == ["nowhere_to_be_found"]


def test_too_much_code_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(freeze, "MAX_BYTES", 1000)
    with pytest.raises(DDPJobError, match=r"the code to freeze for this run is .* expected at most 0 MB"):
        freeze.freeze(_cfg(), tmp_path)
    assert not (tmp_path / "code").exists()


def test_an_entry_folder_outside_git_is_frozen_as_it_is_within_a_bound(tmp_path: Path) -> None:
    """Outside git only the .py files used to be frozen: data next to the script was missing on
    the nodes. Now the folder goes as it is (run dirs, runs/, hidden and cache folders never),
    what does not fit FOLDER_BYTES is named, and only the code is hashed."""
    job = tmp_path / "job"
    (job / "sub" / "pkg").mkdir(parents=True)
    (job / "train.py").write_text("pass\n")
    (job / "sub" / "pkg" / "mod.py").write_text("X = 1\n")
    (job / "scale.txt").write_text("2.0\n")
    (job / ".secret").write_text("no\n")
    (job / "runs" / "old").mkdir(parents=True)
    (job / "runs" / "old" / "metrics.jsonl").write_text("{}\n")
    (job / "myrun").mkdir()
    (job / "myrun" / "config.json").write_text("{}\n")  # a run dir
    with open(job / "big.bin", "wb") as f:
        f.truncate(freeze.FOLDER_BYTES + 1)  # sparse: a size to face, nothing to read
    cfg = _cfg(entry=str(job / "train.py"))
    found = freeze.collect(cfg)
    assert {rel for rel, _ in found["files"] if rel.startswith("entry/")} == {"entry/train.py", "entry/sub/pkg/mod.py"}
    assert [rel for rel, _ in found["data"]] == ["entry/scale.txt"]
    assert [(p.name, n) for p, n in found["left_out"]] == [("big.bin", freeze.FOLDER_BYTES + 1)]
    before = freeze.digest(found["files"])
    (job / "scale.txt").write_text("3.0\n")
    (job / "nohup.out").write_text("a log the user's job writes\n")
    assert freeze.digest(freeze.collect(cfg)["files"]) == before  # data is not code
    (job / "sub" / "pkg" / "mod.py").write_text("X = 2\n")
    assert freeze.digest(freeze.collect(cfg)["files"]) != before
