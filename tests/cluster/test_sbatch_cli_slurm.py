"""`ddpjob sbatch` through the real CLI: what it writes where, reuse of a run dir, bundled job
names, user templates, and (marker `cluster`) the script run by the real `sbatch` to COMPLETED."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ddpjob import jobfile
from test_sbatch_cli import sbatch

REPO = Path(__file__).resolve().parents[2]
DDPJOB = [str(Path(sys.executable).parent / "ddpjob")]
if not Path(DDPJOB[0]).exists():
    DDPJOB = [sys.executable, "-m", "ddpjob"]


# ----------------------------------------------------------------------------- real SLURM
@pytest.mark.cluster
def test_sbatch_script_trains_on_two_nodes(slurm_cluster, tmp_path: Path) -> None:
    import slurmtools

    run = tmp_path / "run"
    r = sbatch(str(REPO / "jobs/smoke.toml"), "--nodes", "2", "--tasks-per-node", "2",
               "--set", "train.max_steps=20", "--set", "checkpoint.every_steps=10",
               "--time", "00:10:00", "--run-dir", str(run), "-o", "x.sbatch", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    job_id = slurmtools.submit(tmp_path / "x.sbatch", cwd=tmp_path)
    state = slurmtools.wait_done(job_id, timeout=600)
    logs = {p.name: p.read_text(errors="replace")[-2000:] for p in (run / "logs").iterdir()}
    assert state == "COMPLETED", logs
    assert (run / "COMPLETED").is_file(), logs
    assert (run / "final" / "model.pt").is_file()
    assert {f"rank-{i}.log" for i in range(4)} <= set(logs), sorted(logs)
    assert f"batch-{job_id}.out" in logs
    info = slurmtools.job_info(job_id)
    assert info.get("NumNodes") == "2" and str(info.get("NumTasks", "4")) == "4"


# A stand-in for python that records what srun handed it: proves that sbatch's own parsing of
# the quoted #SBATCH --output line and srun's argv keep a hostile run dir byte-for-byte.
RECORDER = r"""#!/bin/bash
printf '%s\0' "$@" > "$DDPJOB_RUN_DIR/argv-$SLURM_PROCID"
echo "rank $SLURM_PROCID says hello"
"""


@pytest.mark.cluster
def test_hostile_run_dir_survives_real_sbatch_and_srun(slurm_cluster, tmp_path: Path) -> None:
    import slurmtools

    from ddpjob.launch import render

    base = tmp_path / "it's \"odd\" $(touch PWNED) `touch PWNED`; #x %j 100%"
    run = base / "run"
    run.mkdir(parents=True)
    (run / "logs").mkdir()
    python = base / "py thon"
    python.write_text(RECORDER)
    python.chmod(0o755)
    # no warm-start server (it would run the recorder too): the ranks' own srun line is what is checked
    cfg = jobfile.resolve(REPO / "jobs/smoke.toml", ["slurm.warm_start=false"], {"nodes": 2, "tasks_per_node": 1})
    script = tmp_path / "x.sbatch"
    script.write_text(render.render_sbatch(cfg, run_dir=run, python=str(python)))
    job_id = slurmtools.submit(script, cwd=tmp_path)
    state = slurmtools.wait_done(job_id, timeout=600)
    assert state == "COMPLETED", sorted(p.name for p in tmp_path.rglob("*"))
    assert (run / "logs" / f"batch-{job_id}.out").is_file()  # %% kept, %j expanded
    for rank in (0, 1):
        argv = (run / f"argv-{rank}").read_bytes().split(b"\0")[:-1]
        assert argv == [b"-u", b"-m", b"ddpjob", b"run", str(run).encode()]
        assert f"rank {rank} says hello" in (run / "logs" / f"rank-{rank}.log").read_text()
    assert not list(tmp_path.rglob("PWNED"))
