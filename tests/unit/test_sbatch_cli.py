"""`ddpjob sbatch` through the real CLI: what it writes where, reuse of a run dir, bundled job
names, user templates, and (marker `cluster`) the script run by the real `sbatch` to COMPLETED."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ddpjob import jobfile

REPO = Path(__file__).resolve().parents[2]
DDPJOB = [str(Path(sys.executable).parent / "ddpjob")]
if not Path(DDPJOB[0]).exists():
    DDPJOB = [sys.executable, "-m", "ddpjob"]


def sbatch(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(DDPJOB + ["sbatch", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_writes_script_and_run_dir(tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = sbatch(str(REPO / "jobs/smoke.toml"), "--nodes", "2", "--set", "train.max_steps=20",
               "--run-dir", str(run), "-o", "x.sbatch", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    expected = jobfile.resolve(REPO / "jobs/smoke.toml", ["train.max_steps=20"], {"nodes": 2})
    assert (run / "config.json").read_text() == expected.to_json()
    assert jobfile.read_run_config(run) == expected
    assert (run / "logs").is_dir()
    script = (tmp_path / "x.sbatch").read_text()
    assert (run / "job.sbatch").read_text() == script
    assert "#SBATCH --nodes=2\n" in script and f"export DDPJOB_RUN_DIR={run}\n" in script
    # the interpreter running ddpjob here (absolute) runs the ranks
    (srun_args,) = [shlex.split(line) for line in script.splitlines() if "-m ddpjob run" in line]
    # 2 ranks a node: through the node's warm-start server (slurmopts.warm_start)
    assert srun_args[1:] == ["-u", "-m", "ddpjob.node.warm", "run", "-m", "ddpjob", "run", str(run)]
    assert os.path.isabs(srun_args[0]) and os.path.samefile(srun_args[0], sys.executable)
    assert f"run dir {run}" in r.stdout and r.stdout.rstrip().endswith("next: sbatch x.sbatch")
    assert subprocess.run(["bash", "-n", str(tmp_path / "x.sbatch")]).returncode == 0


def test_default_run_dir_and_stdout(tmp_path: Path) -> None:
    r = sbatch(str(REPO / "jobs/smoke.toml"), "-o", "-", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (run,) = (tmp_path / "runs").iterdir()
    assert run.name.startswith("smoke-")
    assert r.stdout == (run / "job.sbatch").read_text()  # stdout holds only the script
    assert r.stdout.startswith("#!/bin/bash\n")
    assert all(line.startswith("ddpjob: ") and "error" not in line
               for line in r.stderr.splitlines())
    assert f"next: sbatch {run}/job.sbatch" in r.stderr


def test_same_run_dir_same_config_is_reused_and_config_written_once(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [str(REPO / "jobs/smoke.toml"), "--run-dir", str(run), "-o", "x.sbatch"]
    assert sbatch(*args, cwd=tmp_path).returncode == 0
    before = (run / "config.json").stat()
    (tmp_path / "x.sbatch").write_text("old")
    assert sbatch(*args, cwd=tmp_path).returncode == 0
    after = (run / "config.json").stat()
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)
    assert (tmp_path / "x.sbatch").read_text() == (run / "job.sbatch").read_text() != "old"
    # another config in the same run dir: refused, -o untouched (test_bad_input covers more)
    (tmp_path / "x.sbatch").write_text("old")
    r = sbatch(*args, "--set", "train.lr=0.5", cwd=tmp_path)
    assert r.returncode == 2 and "holds another job" in r.stderr
    assert (tmp_path / "x.sbatch").read_text() == "old"


def test_empty_run_dir_given_by_the_user_is_used(tmp_path: Path) -> None:
    run = tmp_path / "empty"
    run.mkdir()
    assert sbatch(str(REPO / "jobs/smoke.toml"), "--run-dir", str(run), "-o", "x",
                  cwd=tmp_path).returncode == 0
    assert sorted(p.name for p in run.iterdir()) == ["code", "code.json", "config.json", "job.sbatch", "logs"]


@pytest.mark.parametrize("name", ["smoke", "smoke.toml", "jobs/smoke.toml", "cifar10_resnet18"])
def test_bundled_job_names_work_from_any_folder(name: str, tmp_path: Path) -> None:
    # --no-data-check: the cifar10 jobs' data.root does not exist in tmp_path
    r = sbatch(name, "--run-dir", str(tmp_path / "run"), "-o", "x", "--no-data-check", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    expected = Path(name).stem.replace("_", "-") if "cifar" in name else "smoke"
    assert json.loads((tmp_path / "run/config.json").read_text())["name"] == expected


def test_a_local_job_file_wins_over_the_bundled_one(tmp_path: Path) -> None:
    (tmp_path / "jobs").mkdir()
    text = (REPO / "jobs/smoke.toml").read_text().replace('name = "smoke"', 'name = "mine"')
    (tmp_path / "jobs/smoke.toml").write_text(text)
    assert sbatch("jobs/smoke.toml", "--run-dir", "run", "-o", "x", cwd=tmp_path).returncode == 0
    assert json.loads((tmp_path / "run/config.json").read_text())["name"] == "mine"
    r = sbatch("nosuchjob", "-o", "x", cwd=tmp_path)
    assert r.returncode == 2 and "job file 'nosuchjob' not found" in r.stderr


def test_user_template(tmp_path: Path) -> None:
    mine = tmp_path / "site.tmpl"
    default = (REPO / "templates/sbatch.sh.tmpl").read_text()
    mine.write_text(default.replace("# setup:", "module load site-python  # site tweak\n# setup:"))
    r = sbatch(str(REPO / "jobs/smoke.toml"), "--template", str(mine), "--run-dir", "run",
               "-o", "x", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "\nmodule load site-python  # site tweak\n" in (tmp_path / "x").read_text()


def test_hostile_run_dir_through_the_cli(tmp_path: Path) -> None:
    run = tmp_path / "we'ird \"dir\" $(touch PWNED) `touch PWNED`; %j -x"
    r = sbatch(str(REPO / "jobs/smoke.toml"), "--run-dir", str(run), "-o", "x", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (run / "config.json").is_file() and (run / "logs").is_dir()
    assert subprocess.run(["bash", "-n", str(tmp_path / "x")]).returncode == 0
    assert not list(tmp_path.rglob("PWNED"))


def test_same_run_dir_with_other_resources_resumes_elastically_other_training_is_refused(
        tmp_path: Path) -> None:
    """After a preemption a user resubmits the run dir on fewer nodes: same training (config
    hash), new resources -> config.json updated, checkpoints kept; another lr -> refused."""
    run = tmp_path / "run"
    job = str(REPO / "jobs/smoke.toml")
    assert sbatch(job, "--nodes", "2", "--run-dir", str(run), "-o", "a.sbatch",
                  cwd=tmp_path).returncode == 0
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "marker").write_text("kept")
    r = sbatch(job, "--nodes", "1", "--run-dir", str(run), "-o", "b.sbatch", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "config.json updated" in r.stderr
    assert jobfile.read_run_config(run).slurm.nodes == 1
    assert "#SBATCH --nodes=1\n" in (tmp_path / "b.sbatch").read_text()
    assert (run / "checkpoints" / "marker").read_text() == "kept"
    before = (run / "config.json").read_text()
    r = sbatch(job, "--nodes", "1", "--set", "train.lr=0.5", "--run-dir", str(run), "-o",
               "c.sbatch", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Hint:" in r.stderr
    assert (run / "config.json").read_text() == before and not (tmp_path / "c.sbatch").exists()


# ------------------------------------------------------------------ -o: the one rule for a file the user names
def test_o_into_a_pipe_through_dev_stdout_writes_the_script_in_place(tmp_path: Path) -> None:
    """`ddpjob sbatch JOB -o /dev/stdout | sbatch`: the script goes into the pipe, the report to
    stderr, and nothing replaces /dev/stdout."""
    r = sbatch(str(REPO / "jobs/smoke.toml"), "--run-dir", str(tmp_path / "run"), "-o", "/dev/stdout", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == (tmp_path / "run" / "job.sbatch").read_text()
    assert "ddpjob: next: sbatch /dev/stdout" in r.stderr
    assert Path("/dev/stdout").is_symlink()


def test_o_into_a_fifo_with_a_reader_is_written_and_without_one_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    r = sbatch(str(REPO / "jobs/smoke.toml"), "--run-dir", str(tmp_path / "none"), "-o", str(fifo), cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"ddpjob: error: -o '{fifo}' is a FIFO nobody reads, expected a new file, a regular file, a character "
        "device or a FIFO with a reader. Hint: choose another -o, e.g. -o out."]
    assert not (tmp_path / "none").exists()  # refused before anything was written
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    deadline = time.monotonic() + 30
    while True:  # the reader opens the FIFO when its thread gets to it: retry until it has
        r = sbatch(str(REPO / "jobs/smoke.toml"), "--run-dir", str(tmp_path / "run"), "-o", str(fifo), cwd=tmp_path)
        if r.returncode == 0 or time.monotonic() > deadline:
            break
    reader.join(timeout=30)
    assert r.returncode == 0, r.stderr
    assert got == [(tmp_path / "run" / "job.sbatch").read_text()]
    assert fifo.is_fifo()


@pytest.mark.parametrize("target", ["/dev/full", "folder", "blockdev", "dangling"])
def test_o_onto_a_device_a_folder_or_a_dangling_link_is_never_replaced(tmp_path: Path, target: str) -> None:
    if target == "folder":
        path = tmp_path / "folder"
        path.mkdir()
    elif target == "blockdev":
        if os.geteuid() != 0:
            pytest.skip("mknod of a block device needs root")
        path = tmp_path / "loop"
        os.mknod(path, 0o600 | stat.S_IFBLK, os.makedev(7, 200))
    elif target == "dangling":
        path = tmp_path / "link"
        path.symlink_to(tmp_path / "nowhere")
    else:
        path = Path(target)
    before = os.lstat(path)
    r = sbatch(str(REPO / "jobs/smoke.toml"), "--run-dir", str(tmp_path / "run"), "-o", str(path), cwd=tmp_path)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("ddpjob: error: ") and "Traceback" not in r.stderr
    after = os.lstat(path)
    assert (after.st_mode, after.st_ino, after.st_rdev) == (before.st_mode, before.st_ino, before.st_rdev)


def test_o_through_a_symlink_to_a_file_keeps_the_link(tmp_path: Path) -> None:
    real, link = tmp_path / "real.sbatch", tmp_path / "link.sbatch"
    real.write_text("old\n")
    link.symlink_to(real)
    r = sbatch(str(REPO / "jobs/smoke.toml"), "--run-dir", str(tmp_path / "run"), "-o", str(link), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and real.read_text() == (tmp_path / "run" / "job.sbatch").read_text()
    assert real.stat().st_mode & 0o022 == 0  # never writable by others
