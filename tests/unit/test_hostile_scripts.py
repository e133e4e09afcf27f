"""Generated hostile input: every string a job file or flag can carry, filled with control
characters, newlines at either end, quotes, backslashes, $(...), backticks and #SBATCH lines.

Each input is either refused with one `ddpjob: error: ... Hint: ...` line, or BOTH scripts
(the template via render.render_sbatch, submitit's via submitit_slurm.sbatch_text: the text functions
behind `ddpjob sbatch` and `submit --backend slurm --dry-run`) pass `bash -n`, and a reader of
#SBATCH lines that behaves like sbatch's (tests/sbatch_directives.py) finds exactly the options
ddpjob meant, with the values it meant. A sample also goes through the real CLI.
"""

from __future__ import annotations

import copy
import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import sbatch_directives as sd
from ddpjob import config, jobfile
from ddpjob.errors import UsageError
from ddpjob.launch import render
from ddpjob.launch.backends import submitit_slurm

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
DDPJOB = [sys.executable, "-m", "ddpjob"]
RAW = tomllib.loads((REPO / "jobs" / "smoke.toml").read_text())
PYTHON = "/opt/venv/bin/python"
HOSTILE = ["gpu\n", "\ngpu", "\rgpu", "g\tpu", "g\x00pu", "g\x1bpu", "g\x7fpu", "'gpu", '"gpu',
           "gp'u", 'gp"u', "g\\pu", "gpu\\", "$(touch PWNED)", "`touch PWNED`", "a;b", "a b",
           "#SBATCH --partition=evil", "x\n#SBATCH --partition=evil", "x #SBATCH --qos=evil",
           "hetjob", "a:packjob", "--partition=evil", "-p evil", "%j%t", "ünï", "\udcff", "",
           "a" * 300]
# (description, where the value goes): a key of the job file, or the run dir.
FIELDS = ["name", "slurm.partition", "slurm.account", "slurm.qos", "slurm.constraint",
          "slurm.mem", "slurm.time", "slurm.signal", "slurm.setup", "slurm.sbatch_extra",
          "slurm.sbatch_extra=--comment", "train.entry", "train.args", "train.model",
          "data.root", "data.dataset", "run_dir"]
CASES = list(itertools.product(FIELDS, HOSTILE))


def _raw_with(field: str, value: str) -> dict[str, Any]:
    raw = copy.deepcopy(RAW)
    if field == "name":
        raw["name"] = value
    elif field == "slurm.sbatch_extra=--comment":
        raw["slurm"]["sbatch_extra"] = [f"--comment={value}"]
    else:
        section, key = field.split(".")
        is_list = key in ("setup", "sbatch_extra", "args")
        raw.setdefault(section, {})[key] = [value] if is_list else value
    return raw


def expected_template(cfg: config.JobConfig) -> set[str]:
    s = cfg.slurm
    want = {"job-name", "nodes", "ntasks-per-node", "cpus-per-task", "time", "open-mode",
            "signal", "output", "error", "requeue" if s.requeue else "no-requeue"}
    want |= {k for k in ("mem", "partition", "account", "qos", "constraint") if getattr(s, k)}
    want |= {"gpus-per-node"} if s.gpus_per_node else set()
    return want | {a[2:].split("=")[0] for a in s.sbatch_extra}


def expected_submitit(cfg: config.JobConfig) -> set[str]:
    return expected_template(cfg) | {"wckey"}


def _check_script(text: str, want: set[str], cfg: config.JobConfig, run_dir: str,
                  tmp_path: Path) -> None:
    script = tmp_path / "s.sh"
    script.write_text(text, encoding="utf-8", errors="surrogateescape")
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    found = sd.options(text)
    names = [k for k, _ in found]
    assert set(names) == want and len(names) == len(set(names)), (names, want)
    values = dict(found)
    assert values["job-name"] == cfg.name
    for key in ("partition", "account", "qos", "constraint", "mem", "time"):
        if key in want:
            assert values[key] == getattr(cfg.slurm, key)
    assert values["output"].replace("%%", "%").startswith(run_dir + "/logs/")
    for arg in cfg.slurm.sbatch_extra:
        key, eq, value = arg[2:].partition("=")
        assert values[key] == (value if eq else None)


@pytest.mark.parametrize("field, value", CASES, ids=[f"{f}={v!r}"[:60] for f, v in CASES])
def test_refused_in_one_line_or_both_scripts_say_what_ddpjob_meant(field: str, value: str,
                                                                   tmp_path: Path) -> None:
    run_dir = str(Path(f"/tmp/ddpjob-runs/{value}" if field == "run_dir" else "/tmp/ddpjob-runs/r1"))
    try:
        cfg = jobfile.from_dict(RAW if field == "run_dir" else _raw_with(field, value))
        template = render.render_sbatch(cfg, run_dir=Path(run_dir), python=PYTHON)
        submitit = submitit_slurm.sbatch_text(cfg, Path(run_dir) / "logs")
    except UsageError as exc:
        line = exc.line()
        assert "\n" not in line and line.startswith("ddpjob: error: ") and " Hint: " in line
        return
    _check_script(template, expected_template(cfg), cfg, run_dir, tmp_path)
    _check_script(submitit, expected_submitit(cfg), cfg, run_dir, tmp_path)


def test_the_parser_reads_like_sbatch() -> None:
    text = ("#!/bin/bash\n#SBATCH --part=a -J 'x y' --sig=USR2@5 # comment --qos=q\n"
            "#SBATCH \"--comment=a\\\"b\"\n# plain comment\n\n#SLURM --time=5\n"
            "echo hi\n#SBATCH --partition=late\n")
    assert sd.options(text) == [("partition", "a"), ("job-name", "x y"), ("signal", "USR2@5"),
                                ("comment", 'a"b'), ("time", "5")]
    for bad in ("#SBATCH --n=1\n", "#SBATCH 'open\n", "#SBATCH --comment=hetjob\n",
                "#SBATCH :x\n"):
        with pytest.raises(sd.SbatchError):
            sd.options(bad)


SAMPLE = [("--name", "smoke\n"), ("--partition", "gpu\n"), ("--qos", "\nq"),
          ("--time", "\n01:00:00"), ("--run-dir", "runs/z\\''\n#SBATCH --partition=evil #"),
          ("--set", "slurm.setup=[\"#SBATCH --partition=evil\"]"),
          ("--set", "slurm.sbatch_extra=[\"--comment=packjob\"]"),
          ("--set", "slurm.sbatch_extra=[\"--part=evil\"]"), ("--account", "a`id`")]


@pytest.mark.parametrize("flag, value", SAMPLE, ids=[f"{f} {v!r}" for f, v in SAMPLE])
@pytest.mark.parametrize("command", [["sbatch", "-o", "-"],
                                     ["submit", "--backend", "slurm", "--dry-run"]])
def test_the_real_cli_refuses_them_on_both_paths(command: list[str], flag: str, value: str,
                                                 tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"  # `--backend slurm` wants sbatch on PATH
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    r = subprocess.run([*DDPJOB, command[0], str(REPO / "jobs/smoke.toml"), *command[1:],
                        flag, value], cwd=tmp_path, capture_output=True, text=True, env=env,
                       timeout=120)
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1 and " Hint: " in lines[0], r.stderr
    assert r.stdout == "" and not (tmp_path / "runs").exists()
