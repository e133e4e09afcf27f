"""Sweeps: `--sweep KEY=V1,V2` -> the cartesian product, one run dir per point, sweep.json;
points run one after another on the local backend and as one job array on SLURM."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from clirun import ddpjob
from ddpjob import fileio, jobfile, rundir

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "jobs" / "smoke.toml")


@pytest.mark.slow
def test_local_sweep_runs_each_point_and_ls_status_show_the_grid(tmp_path):
    t0 = time.monotonic()
    out = ddpjob("submit", SMOKE, "--backend", "local", "--wait", "--sweep", "train.lr=0.1,0.05",
                 "--set", "train.max_steps=2", "--set", "train.eval_every=0", "--set", "train.log_every=1",
                 cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    [sweep] = list((tmp_path / "runs").iterdir())
    assert sweep.name.startswith("smoke-sweep-")
    rec = fileio.read_json(sweep / "sweep.json")
    assert rec["axes"] == {"train.lr": [0.1, 0.05]} and [p["id"] for p in rec["points"]] == ["0", "1"]
    for i, lr in enumerate((0.1, 0.05)):
        point = sweep / str(i)
        assert jobfile.read_run_config(point).train.lr == lr
        job = fileio.read_json(point / "job.json")
        assert job["job_id"] == f"{rec['job_id']}_{i}" and job["array"]["index"] == i
        assert rundir.completed(point) is not None
    ls = ddpjob("ls", cwd=tmp_path)
    rows = [ln for ln in ls.stdout.splitlines() if "/smoke-sweep-" in ln]
    assert len(rows) == 2 and rows[0].rstrip().endswith("train.lr=0.1")
    assert rows[1].rstrip().endswith("train.lr=0.05")
    assert all(" COMPLETED " in r for r in rows)
    status = ddpjob("status", str(sweep), cwd=tmp_path)
    assert status.returncode == 0 and status.stdout.startswith(f"sweep {sweep}")
    assert status.stdout.count("COMPLETED") == 2
    print(f"local sweep of 2 points x 2 ranks x 2 steps: {time.monotonic() - t0:.1f}s")
