"""Sweeps: `--sweep KEY=V1,V2` -> the cartesian product, one run dir per point, sweep.json;
points run one after another on the local backend and as one job array on SLURM."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from clirun import ddpjob
from ddpjob import fileio, jobfile, rundir
from ddpjob.ledger.events import read as read_events
from runlogs import decisions

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "jobs" / "smoke.toml")


@pytest.mark.cluster
def test_slurm_sweep_of_two_points_is_one_job_array(slurm_cluster, tmp_path):
    import slurmtools

    from ddpjob.launch.backends import TERMINAL, slurmjobs

    sweep = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, "-m", "ddpjob", "submit", SMOKE, "--backend", "slurm",
                             "--run-dir", str(sweep), "--sweep", "train.lr=0.1,0.05", "--wait",
                             "--set", "train.max_steps=2", "--set", "train.eval_every=0"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (sweep / "sweep.json").is_file():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    base = fileio.read_json(sweep / "sweep.json")["job_id"]
    slurmtools.submitted.append(base)
    try:
        out, err = proc.communicate(timeout=300)  # --wait: streams each point's rank 0, then returns
        assert proc.returncode == 0, out[-2000:] + err[-2000:]
        assert f"{sweep}/0: COMPLETED" in out and f"{sweep}/1: COMPLETED" in out
        ids = [fileio.read_json(sweep / str(i) / "job.json")["job_id"] for i in range(2)]
        assert ids == [f"{base}_0", f"{base}_1"]
        assert "#SBATCH --array=0-1%2" in (sweep / "0" / "job.sbatch").read_text()
        deadline = time.monotonic() + 300  # (slurmtools.wait_done takes plain job ids, not A_i)
        while not all(slurmjobs.slurm_states(ids).get(j, {}).get("state") in TERMINAL for j in ids):
            assert time.monotonic() < deadline, slurmjobs.slurm_states(ids)
            time.sleep(1)
        acct = {r["JobID"]: r["State"] for r in slurmtools.sacct_rows(base, "JobID,State")}
        assert acct.get(f"{base}_0") == acct.get(f"{base}_1") == "COMPLETED", acct
        for i in range(2):
            assert rundir.completed(sweep / str(i)) is not None
        status = ddpjob("status", base, "--runs-root", ".", cwd=tmp_path)  # the array id finds the sweep
        assert status.returncode == 0 and status.stdout.count("COMPLETED") == 2
    finally:  # (conftest's cleanup looks jobs up by plain id: cancel the array here)
        proc.kill()
        subprocess.run(["scancel", base], capture_output=True, timeout=30)


@pytest.mark.cluster
def test_slurm_sweep_points_run_and_resume_their_own_frozen_code(slurm_cluster, tmp_path):
    """Each array task of a submitit sweep imports ddpjob (and its entry) from its own point's
    frozen copy, SWEEP/<index>/code, and when a requeue brings it back it checks its checkpoint
    against that copy's hash. (It used to put SWEEP/code/python, which does not exist, first: the
    points ran the installed ddpjob, and a resume compared the live code's hash.) The entry is
    edited on disk after the submission, so the live code hashes differently from the frozen copy:
    a rank that imported or hashed the live code fails the asserts, or refuses its checkpoint
    ("written by other code") instead of finishing.

    Both points get the time-limit warning, among them the one whose SLURM_JOB_ID equals the
    array's id (one task of every array has it): rank 0 must requeue that task alone, as
    ARRAYID_TASK (a bare `scontrol requeue <array id>` requeued the whole array, was read as a
    refusal, and the successor fallback then submitted the whole sweep again)."""
    import json

    import slurmtools

    from ddpjob import freeze
    from ddpjob.launch import runs

    entry = tmp_path / "where.py"
    entry.write_text("import ddpjob\nprint('ddpjob imported from', ddpjob.__file__, flush=True)\n"
                     "from ddpjob.train.trainer import main\nmain()\n")
    sweep = tmp_path / "sweep"
    out = ddpjob("submit", SMOKE, "--backend", "slurm", "--run-dir", str(sweep), "--sweep", "train.lr=0.1,0.05",
                 "--set", "train.max_steps=300", "--set", "train.eval_every=0", "--set", "train.log_every=5",
                 "--set", "checkpoint.every_steps=0", "--set", f"train.entry={json.dumps(str(entry))}",
                 cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    base = fileio.read_json(sweep / "sweep.json")["job_id"]
    slurmtools.submitted.append(base)
    with entry.open("a") as f:  # the live code moves on; each point keeps the code it was frozen with
        f.write("# edited after the submission\n")
    points = [sweep / str(i) for i in range(2)]
    ids = [f"{base}_{i}" for i in range(2)]
    frozen = [fileio.read_json(p / "code.json")["hash"] for p in points]
    for p, code in zip(points, frozen):
        assert freeze.digest(freeze.collect(jobfile.read_run_config(p))["files"]) != code  # the test can tell
    try:
        for p, jid in zip(points, ids):
            slurmtools.wait_state(jid, ("RUNNING",), timeout=180)
            deadline = time.monotonic() + 180
            while (runs.last_metric(p)[0] or 0) < 10:
                assert time.monotonic() < deadline, f"no step 10 in {p}/metrics.jsonl"
                time.sleep(0.5)
        # a time-limit warning to each point: checkpoint, requeue, the same array task resumes
        colliding = [i for i, jid in enumerate(ids) if slurmtools.job_info(jid)["JobId"] == base]
        assert colliding, [slurmtools.job_info(jid)["JobId"] for jid in ids]  # what this test covers
        for jid in ids:
            subprocess.run(["scancel", "--signal=USR2", jid], check=True, timeout=30)
        for jid in ids:
            slurmtools.wait_state(jid, ("PENDING", "REQUEUED"), timeout=120)
            slurmtools.release_now(jid)
        for p in points:
            deadline = time.monotonic() + 400
            while rundir.completed(p) is None:
                assert time.monotonic() < deadline, f"{p} did not complete: {read_events(p)[-3:]}"
                time.sleep(1)
        logs = {f.name: f.read_text() for f in (sweep / "logs").glob("*_log.out")}
        for i, (p, code) in enumerate(zip(points, frozen)):
            mine = [t for name, t in logs.items() if name.startswith(f"{base}_{i}_")]
            assert len(mine) == 2, sorted(logs)  # both ranks of the point, appended across the requeue
            where = f"ddpjob imported from {(p / 'code' / 'python').resolve()}/ddpjob/__init__.py"
            starts = 2  # each point: its first run and the resumed one
            for text in mine:
                assert text.count(where) == starts, text[-3000:]
            stops = decisions(read_events(p))
            assert stops[0]["reason"] == "time_limit" and stops[0]["requeued_by"] == "scontrol", stops
            assert stops[0]["job_id"] == ids[i] and stops[0]["note"] == f"requeued job {ids[i]}", stops
            assert stops[-1]["reason"] == "finished" and stops[-1]["restart"] == starts - 1, stops
            assert fileio.read_json(p / "job.json")["job_id"] == ids[i]  # no successor job took over
            manifests = list((p / "checkpoints").glob("step-*/manifest.json"))
            assert manifests and all(json.loads(m.read_text())["code_hash"] == code for m in manifests)
    finally:
        subprocess.run(["scancel", base], capture_output=True, timeout=30)
