"""Bad input through the real CLI (`.venv/bin/ddpjob sbatch ...` as a subprocess): exactly one
`ddpjob: error: ... Hint: ...` line on stderr, exit 2 (usage) or 1 (runtime), no traceback
(unless --debug), and nothing half-written: no run dir, the -o file unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DDPJOB = [str(Path(sys.executable).parent / "ddpjob")]
if not Path(DDPJOB[0]).exists():  # not run from the venv: the module works the same
    DDPJOB = [sys.executable, "-m", "ddpjob"]
SMOKE = (REPO / "jobs" / "smoke.toml").read_text()
OLD = "#!/bin/bash\n# the previous script, which must survive a failed run\n"


def _unwritable(tmp_path: Path) -> Path:
    """A folder this process cannot create files in (root ignores permission bits: use /sys)."""
    if os.geteuid() == 0:
        if not Path("/sys/fs").is_dir():
            pytest.skip("running as root without /sys: no unwritable folder to test with")
        return Path("/sys/fs")
    d = tmp_path / "readonly"
    d.mkdir(mode=0o500)
    return d


def _job(tmp_path: Path, text: str) -> str:
    p = tmp_path / "job.toml"
    p.write_text(text)
    return str(p)


def _edit(section: str, line: str) -> str:
    """smoke.toml with `line` at the top of [section], replacing that key if it is there
    (TOML refuses a key written twice)."""
    key = line.split("=")[0].strip()
    lines = SMOKE.splitlines()
    start = lines.index(f"[{section}]")
    out = [x for i, x in enumerate(lines) if not (i > start and x.split("=")[0].strip() == key
                                                  and _section_of(lines, i) == section)]
    out.insert(out.index(f"[{section}]") + 1, line)
    return "\n".join(out) + "\n"


def _section_of(lines: list[str], i: int) -> str:
    return next(x.strip("[]") for x in reversed(lines[:i]) if x.startswith("["))


def _existing_run(tmp_path: Path, kind: str) -> str:
    d = tmp_path / "existing"
    d.mkdir()
    if kind == "other-config":
        (d / "config.json").write_text(json.dumps({"name": "someone-else"}))
    else:
        (d / "notes.txt").write_text("my thesis")
    return str(d)


def _template(tmp_path: Path, text: str | None) -> str:
    p = tmp_path / "my.tmpl"
    if text is not None:
        p.write_text(text)
    return str(p)


# (id, exit code, args builder(tmp_path) -> argv after `ddpjob sbatch`, text the line must hold)
CASES = [
    ("missing job file", 2, lambda t: ["nope.toml"], "not found"),
    ("bad toml", 2, lambda t: [_job(t, "[slurm\nnodes = 1\n")], "not valid TOML"),
    ("unknown section", 2, lambda t: [_job(t, SMOKE + "[slurmm]\nnodes = 2\n")], "'slurmm'"),
    ("unknown key", 2, lambda t: [_job(t, _edit("slurm", "nodez = 2"))],
     "expected one of: account, constraint, cpus_per_task"),
    ("wrong type", 2, lambda t: [_job(t, _edit("slurm", 'nodes = "two"'))], "expected an integer"),
    ("nodes zero", 2, lambda t: ["jobs/smoke.toml", "--nodes", "0"], "slurm.nodes is 0"),
    ("nodes negative", 2, lambda t: ["jobs/smoke.toml", "--nodes=-2"], "slurm.nodes is -2"),
    ("nodes not a number", 2, lambda t: ["jobs/smoke.toml", "--nodes", "two"], "invalid int"),
    ("bad time", 2, lambda t: ["jobs/smoke.toml", "--time", "4h"], "not a SLURM time limit"),
    ("bad signal", 2, lambda t: [_job(t, _edit("slurm", 'signal = "FOO"'))], "slurm.signal"),
    ("B: signal", 2, lambda t: ["jobs/smoke.toml", "--set", "slurm.signal=B:USR2"], "'B:USR2'"),
    ("set without =", 2, lambda t: ["jobs/smoke.toml", "--set", "train.lr"], "has no '='"),
    ("set unknown key", 2, lambda t: ["jobs/smoke.toml", "--set", "train.lrr=0.1"],
     "unknown key 'train.lrr'"),
    ("set wrong type", 2, lambda t: ["jobs/smoke.toml", "--set", "train.max_steps=many"],
     "expected an integer"),
    ("global batch", 2, lambda t: ["jobs/smoke.toml", "--set", "train.global_batch_size=100"],
     "not a multiple"),
    ("unknown amp", 2, lambda t: ["jobs/smoke.toml", "--set", "train.amp=fp8"], "train.amp"),
    ("unknown optimizer", 2, lambda t: ["jobs/smoke.toml", "--set", "train.optimizer=lion"],
     "train.optimizer"),
    ("unknown dataset", 2, lambda t: ["jobs/smoke.toml", "--set", "data.dataset=imagenet"],
     "data.dataset"),
    ("name with space", 2, lambda t: ["jobs/smoke.toml", "--name", "my job"], "name 'my job'"),
    ("name with newline", 2, lambda t: ["jobs/smoke.toml", "--name", "a\nb"], "name 'a\\nb'"),
    ("name with $()", 2, lambda t: ["jobs/smoke.toml", "--name", "$(touch PWNED)"], "name"),
    ("name with ;", 2, lambda t: ["jobs/smoke.toml", "--name", "a;touch PWNED"], "name"),
    ("name with %j", 2, lambda t: ["jobs/smoke.toml", "--name", "run%j"], "name"),
    ("name with ../", 2, lambda t: ["jobs/smoke.toml", "--name", "../escape"], "name"),
    ("name with leading -", 2, lambda t: ["jobs/smoke.toml", "--set", "name=-rf"], "name"),
    ("partition with quote", 2, lambda t: ["jobs/smoke.toml", "--partition", "lo'w"],
     "not a valid SLURM name"),
    ("account with space", 2, lambda t: ["jobs/smoke.toml", "--account", "a b"],
     "not a valid SLURM name"),
    ("sbatch_extra --wrap", 2, lambda t: [_job(t, _edit("slurm", 'sbatch_extra = ["--wrap=true;rm -rf ~"]'))],
     "sets --wrap"),
    ("sbatch_extra newline", 2, lambda t: [_job(t, _edit("slurm", 'sbatch_extra = ["--comment=a\\n#SBATCH --partition=high"]'))],
     "one '--option=value' argument"),
    ("sbatch_extra short option", 2, lambda t: [_job(t, _edit("slurm", 'sbatch_extra = ["-p high"]'))],
     "one '--option=value' argument"),
    ("setup newline", 2, lambda t: [_job(t, _edit("slurm", 'setup = ["echo a\\ntouch PWNED"]'))],
     "contains a newline"),
    ("mem with space", 2, lambda t: ["jobs/smoke.toml", "--set", "slurm.mem=32 GB"], "slurm.mem"),
    ("lead beyond limit", 2, lambda t: ["jobs/smoke.toml", "--time", "1"], "below the time limit"),
    ("missing template", 2, lambda t: ["jobs/smoke.toml", "--template", _template(t, None)],
     "not found"),
    ("template is a folder", 2, lambda t: ["jobs/smoke.toml", "--template", str(t)], "directory"),
    ("unknown placeholder", 2, lambda t: ["jobs/smoke.toml", "--template",
                                          _template(t, "srun ${python} ${rundir}\n")],
     "unknown placeholder ${rundir}"),
    ("run dir with newline", 2, lambda t: ["jobs/smoke.toml", "--run-dir", str(t / "a\nb")],
     "newline"),
    ("run dir with backslash", 2, lambda t: ["jobs/smoke.toml", "--run-dir", str(t / "a\\b")],
     "backslash"),
    ("-o missing folder", 1, lambda t: ["jobs/smoke.toml", "-o", str(t / "no" / "x.sbatch")],
     "does not exist"),
    ("-o is a folder", 1, lambda t: ["jobs/smoke.toml", "-o", str(t)], "is a directory"),
    ("-o unwritable", 1, lambda t: ["jobs/smoke.toml", "-o", str(_unwritable(t) / "x.sbatch")],
     "cannot write"),
    ("unwritable run dir", 1, lambda t: ["jobs/smoke.toml", "--run-dir",
                                         str(_unwritable(t) / "ddpjob-run")], "cannot create run dir"),
    ("run dir with another config", 1, lambda t: ["jobs/smoke.toml", "--run-dir",
                                                  _existing_run(t, "other-config")],
     "already holds a different config.json"),
    ("run dir not a run dir", 1, lambda t: ["jobs/smoke.toml", "--run-dir",
                                            _existing_run(t, "foreign")], "is not empty"),
    ("no -o", 2, lambda t: ["jobs/smoke.toml"], "-o/--output"),
]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>")
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_line(case, tmp_path: Path) -> None:
    _, code, build, expected = case
    work = tmp_path / "work"
    work.mkdir()
    (work / "jobs").mkdir()
    (work / "jobs" / "smoke.toml").write_text(SMOKE)
    argv = build(tmp_path)
    out = work / "x.sbatch"
    out.write_text(OLD)
    if "-o" not in argv and "no -o" not in case[0]:
        argv += ["-o", str(out)]
    before = _snapshot(tmp_path)
    r = subprocess.run(DDPJOB + ["sbatch", *argv], cwd=work, capture_output=True, text=True,
                       timeout=120)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("ddpjob: error: ") and "Hint: " in lines[0], lines[0]
    assert expected in lines[0], lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert r.returncode == code, lines[0]
    assert _snapshot(tmp_path) == before, "something was written or left half-written"
    assert not (work / "runs").exists() and out.read_text() == OLD
    assert not list(tmp_path.rglob("PWNED"))


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in
                                  ("unknown key", "unwritable run dir", "missing template")],
                         ids=lambda c: c[0])
def test_debug_shows_the_traceback(case, tmp_path: Path) -> None:
    _, code, build, _ = case
    r = subprocess.run(DDPJOB + ["--debug", "sbatch", *build(tmp_path), "-o",
                                 str(tmp_path / "x.sbatch")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "Traceback (most recent call last)" in r.stderr
    assert "Error" in r.stderr.splitlines()[-1]


def test_at_least_twenty_kinds() -> None:
    assert len(CASES) >= 20
