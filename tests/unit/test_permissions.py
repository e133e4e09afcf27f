"""Run-dir permissions: 0700 (or 0750 with slurm.share_group), files 0600/0640, whatever the
umask; `ddpjob run` and submitit's script refuse a run dir others can write (submitit unpickles
RUN_DIR/logs/*_submitted.pkl at every start: a writable folder is code run as the job's user)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import clirun
import pytest

from ddpjob import fileio, jobfile, rundir
from ddpjob.launch import submit
from ddpjob.launch.backends import submitit_slurm

REPO = Path(__file__).resolve().parents[2]
DDPJOB = [sys.executable, "-m", "ddpjob"]


def _modes(d: Path) -> dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_mode & 0o777 for p in [d, *d.rglob("*")]}


@pytest.mark.parametrize("share, dmode, fmode", [(False, 0o700, 0o600), (True, 0o750, 0o640)])
@pytest.mark.parametrize("umask", [0o000, 0o077])
def test_sbatch_run_dir_modes_ignore_the_umask(share: bool, dmode: int, fmode: int, umask: int,
                                               tmp_path: Path) -> None:
    d = tmp_path / "run"
    r = subprocess.run(DDPJOB + ["sbatch", str(REPO / "jobs/smoke.toml"), "--run-dir", str(d),
                                 "-o", "-", "--set", f"slurm.share_group={str(share).lower()}"],
                       cwd=tmp_path, capture_output=True, text=True, preexec_fn=lambda: os.umask(umask))
    assert r.returncode == 0, r.stderr
    modes = _modes(d)
    code = {k: v for k, v in modes.items() if k.split("/")[0] in ("code", "code.json")}
    assert code and all(v == (dmode if (d / k).is_dir() else fmode) for k, v in code.items())
    rest = {k: v for k, v in modes.items() if k not in code}
    assert rest == {".": dmode, "logs": dmode, "config.json": fmode, "job.sbatch": fmode}
    fileio.append_jsonl(d / rundir.EVENTS, {"event": "start"})
    assert (d / rundir.EVENTS).stat().st_mode & 0o777 == fmode


def test_submit_root_is_private(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        submit._make_root(tmp_path / "a" / "run")
        submit._make_root(tmp_path / "shared", share_group=True)
    finally:
        os.umask(old)
    assert (tmp_path / "a" / "run").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "shared").stat().st_mode & 0o777 == 0o750


@pytest.mark.parametrize("mode, refused", [(0o700, False), (0o750, False), (0o770, True),
                                           (0o702, True)])
def test_check_private(mode: int, refused: bool, tmp_path: Path) -> None:
    d = tmp_path / "run"
    (d / rundir.LOGS).mkdir(parents=True)
    d.chmod(mode)
    if refused:
        with pytest.raises(rundir.DDPJobError, match="group/world-writable"):
            rundir.check_private(d)
    else:
        rundir.check_private(d)
    d.chmod(0o700)
    (d / rundir.LOGS).chmod(0o777)  # the pickle's folder alone is enough
    with pytest.raises(rundir.DDPJobError, match="logs"):
        rundir.check_private(d)


@pytest.mark.parametrize("mode, ok", [(0o700, True), (0o750, True), (0o775, False), (0o707, False)])
def test_submitit_script_refuses_a_pickle_folder_others_can_write(mode: int, ok: bool,
                                                                   tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    run.chmod(0o700)
    (run / "logs").chmod(mode)
    cfg = jobfile.from_dict({"name": "t"})
    lines = submitit_slurm.slurm_parameters(cfg, run / "logs")["setup"]
    script = "\n".join([*lines, "echo started"]) + "\n"
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert (r.returncode == 0 and r.stdout == "started\n") if ok else \
        (r.returncode == 1 and "refusing to unpickle" in r.stderr), (r.stdout, r.stderr)


@pytest.mark.parametrize("mode, ok", [(0o600, True), (0o640, True), (0o664, False), (0o606, False)])
def test_submitit_script_refuses_a_pickle_others_can_write_in_a_private_folder(mode: int, ok: bool,
                                                                              tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    for d in (run, run / "logs"):
        d.chmod(0o750)
    pickle = run / "logs" / "17_submitted.pkl"
    pickle.write_bytes(b"x")
    pickle.chmod(mode)
    lines = submitit_slurm.slurm_parameters(jobfile.from_dict({"name": "t"}), run / "logs")["setup"]
    r = subprocess.run(["bash", "-c", "\n".join([*lines, "echo started"]) + "\n"], capture_output=True, text=True)
    assert (r.returncode == 0 and r.stdout == "started\n") if ok else \
        (r.returncode == 1 and f"{pickle} is writable by others" in r.stderr), (r.stdout, r.stderr)


# ------------------------------------------------------------------ another user's runs
@pytest.fixture(scope="module")
def shared_root() -> Iterator[Path]:
    """A folder anyone may enter (pytest's tmp_path is root's 0700) holding runs/ with root's
    private run `mine` (0700, as ddpjob makes them) and `open` (readable, its logs/ not). The
    cases only read it (what they try to write is refused), so they share it."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the CLI as another user")
    top = Path(tempfile.mkdtemp(prefix="ddpjob-shared-"))
    top.chmod(0o755)
    (top / "runs").mkdir()
    (top / "runs").chmod(0o755)  # not mkdir's mode: an earlier in-process command may have left umask 077
    for name in ("mine", "open"):
        clirun.ddpjob("sbatch", str(REPO / "jobs/smoke.toml"), "--run-dir", f"runs/{name}", "-o", "-",
                      cwd=top, check=True)
    opened = top / "runs" / "open"
    opened.chmod(0o755)
    for record in (rundir.CONFIG, "code.json"):
        (opened / record).chmod(0o644)
    yield top
    shutil.rmtree(top)


def _as_nobody(root: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return clirun.ddpjob(*argv, cwd=root, env={**os.environ, "HOME": str(root)}, user=clirun.AS_NOBODY,
                         timeout=120)


MINE = "'runs/mine' belongs to root (mode 0700) and ddpjob runs as nobody"


@pytest.mark.parametrize("argv", [["status", "runs/mine"], ["logs", "runs/mine"], ["stop", "runs/mine"],
                                  ["submit", str(REPO / "jobs/smoke.toml"), "--backend", "local",
                                   "--run-dir", "runs/mine"]], ids=lambda a: a[0])
def test_another_users_run_is_one_line_not_an_internal_error(shared_root: Path, argv: list[str]) -> None:
    """These said "internal error, PermissionError" (the tests run as root, whom no mode stops)."""
    r = _as_nobody(shared_root, *argv)
    assert r.returncode == 1 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr == (f"ddpjob: error: cannot read run directory: {MINE}, expected a run dir you can "
                        f"read. Hint: {rundir.UNREADABLE_HINT}.\n")


def test_a_file_ddpjob_cannot_read_in_a_readable_run_is_one_line(shared_root: Path) -> None:
    r = _as_nobody(shared_root, "logs", "runs/open")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("ddpjob: error: permission denied: 'runs/open/logs' belongs to root "
                               "(mode 0700) and ddpjob runs as nobody") and "Hint: " in r.stderr


@pytest.mark.parametrize("command", ["ls", "status"])
def test_ls_and_status_show_an_unreadable_run_as_such_and_list_the_others(shared_root: Path,
                                                                         command: str) -> None:
    r = _as_nobody(shared_root, command)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    rows = {ln.split()[0]: ln.split() for ln in r.stdout.splitlines() if ln.startswith("runs/")}
    assert set(rows) == {"runs/mine", "runs/open"}
    assert "DAMAGED" in rows["runs/mine"] and "DAMAGED" not in rows["runs/open"], r.stdout
    r = _as_nobody(shared_root, command, "--json")
    reasons = {rec["run_dir"]: rec["reason"] for rec in map(json.loads, r.stdout.splitlines())}
    assert reasons["runs/mine"] == f"cannot read it: {MINE}", reasons


@pytest.mark.parametrize("mode, refused", [(0o777, True), (0o1777, False), (0o775, False), (0o757, True)])
def test_a_run_dir_below_a_folder_anyone_may_rename_in_is_refused(mode: int, refused: bool, tmp_path: Path) -> None:
    """World-writable without the sticky bit: anyone could rename the run away and plant theirs
    (its code/ and submitit's pickle run as the job's user). /tmp's 1777 is fine."""
    scratch = tmp_path / "scratch"
    (scratch / "me" / "runs").mkdir(parents=True)
    scratch.chmod(mode)
    link = tmp_path / "runs-link"  # through a link: the folder it leads into counts
    link.symlink_to(scratch / "me" / "runs")
    for run_dir in (scratch / "me" / "runs" / "new" / "run", link / "run"):
        if refused:
            with pytest.raises(rundir.DDPJobError, match=f"is below '{scratch}', which anyone may write"):
                rundir.check_parents(run_dir)
        else:
            rundir.check_parents(run_dir)
    scratch.chmod(0o700)
