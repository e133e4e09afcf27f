"""Run-dir permissions: 0700 (or 0750 with slurm.share_group), files 0600/0640, whatever the
umask; `ddpjob run` and submitit's script refuse a run dir others can write (submitit unpickles
RUN_DIR/logs/*_submitted.pkl at every start: a writable folder is code run as the job's user)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpjob import config, rundir
from ddpjob.launch import submit
from ddpjob.launch.backends import submitit_slurm

REPO = Path(__file__).resolve().parents[1]
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
    rundir.append_jsonl(d / rundir.EVENTS, {"event": "start"})
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
    cfg = config.from_dict({"name": "t"})
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
    lines = submitit_slurm.slurm_parameters(config.from_dict({"name": "t"}), run / "logs")["setup"]
    r = subprocess.run(["bash", "-c", "\n".join([*lines, "echo started"]) + "\n"], capture_output=True, text=True)
    assert (r.returncode == 0 and r.stdout == "started\n") if ok else \
        (r.returncode == 1 and f"{pickle} is writable by others" in r.stderr), (r.stdout, r.stderr)


def _loose(d: Path, share: bool) -> dict[str, str]:
    """What in `d` others could write (or, without share_group, even read)."""
    bad = 0o022 if share else 0o077
    return {k: oct(v) for k, v in _modes(d).items() if v & bad}


@pytest.mark.parametrize("umask, share", [(0o000, False), (0o002, True)])
def test_a_local_run_writes_nothing_others_can_write_whatever_the_umask(umask: int, share: bool,
                                                                        tmp_path: Path) -> None:
    """Checkpoints, rank logs, events, the final model: 0600/0700, or 0640/0750 with share_group,
    under umask 000 and under Debian's 002."""
    run = tmp_path / "run"
    r = subprocess.run(DDPJOB + ["submit", str(REPO / "jobs/smoke.toml"), "--backend", "local", "--wait",
                                 "--run-dir", str(run), "--set", "train.max_steps=4", "--set", "checkpoint.every_steps=2",
                                 "--set", f"slurm.share_group={str(share).lower()}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, preexec_fn=lambda: os.umask(umask))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert list(run.glob("checkpoints/step-*/*.pt")) and list(run.glob("logs/rank-*.log"))
    assert _loose(run, share) == {}


@pytest.mark.cluster
def test_a_submitit_job_under_umask_002_with_share_group_keeps_its_pickle_private(slurm_cluster, tmp_path: Path) -> None:
    """Through real sbatch/srun: submitit's pickle, its logs, the checkpoints: nothing the group can
    write (the pickle used to be 664, so any group member could run code as the job's owner)."""
    import slurmtools

    run = tmp_path / "run"
    r = subprocess.run(DDPJOB + ["submit", str(REPO / "jobs/smoke.toml"), "--backend", "slurm", "--run-dir", str(run),
                                 "--set", "train.max_steps=4", "--set", "checkpoint.every_steps=2",
                                 "--set", "slurm.share_group=true"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, preexec_fn=lambda: os.umask(0o002))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    job_id = rundir.read_json(run / "job.json")["job_id"]
    slurmtools.submitted.append(job_id)
    assert slurmtools.wait_done(job_id, timeout=300) == "COMPLETED"
    assert list(run.glob("logs/*.pkl")) and list(run.glob("checkpoints/step-*/*.pt"))
    assert _loose(run, share=True) == {}
