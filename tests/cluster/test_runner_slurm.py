"""`ddpjob run`: the same job under every launcher, the shared run dir, exit codes, the
requeue policy, and (marker `cluster`) 2 nodes x 2 tasks under a real srun.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from ddpjob import jobfile, rundir
from ddpjob.ledger.events import read as read_events
from runlogs import decisions
from ranks import PYTHON, REPO, assert_bit_equal, final_state, metrics, run, write_job
from test_runner import DATA, NOBN


# ------------------------------------------------------------------ real SLURM: 2 nodes x 2 tasks
@pytest.mark.cluster
def test_same_job_under_srun_2_nodes_x_2_tasks(tmp_path: Path, slurm_cluster: Any) -> None:
    """sbatch + `srun --kill-on-bad-exit=1 python -m ddpjob run RUN_DIR` on both nodes; the
    result is bit-identical to the same job run as 4 local ranks (same world size)."""
    import slurmtools

    train = {**NOBN, "model": "cnn_tiny", "batch_size": 16, "global_batch_size": 64}
    job = write_job(tmp_path / "job.toml", train=train, data=DATA,
                    slurm={"nodes": 2, "tasks_per_node": 2})
    run_dir = tmp_path / "srun"
    run_dir.mkdir()
    (run_dir / rundir.CONFIG).write_text(jobfile.resolve(job).to_json())
    python = str(Path(PYTHON).absolute())
    script = tmp_path / "job.sbatch"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --nodes=2
        #SBATCH --ntasks-per-node=2
        #SBATCH --cpus-per-task=1
        #SBATCH --time=00:10:00
        #SBATCH --output={tmp_path}/slurm-%j.out
        export PYTHONPATH={REPO / 'tests'}:{REPO}
        export OMP_NUM_THREADS=1
        srun --kill-on-bad-exit=1 {python} -m ddpjob run {run_dir}
        """))
    job_id = slurmtools.submit(script, cwd=tmp_path)
    state = slurmtools.wait_done(job_id, timeout=600)
    log = "\n".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert state == "COMPLETED", log[-4000:]
    start = [e for e in read_events(run_dir) if e["event"] == "start"][0]
    assert (start["world_size"], start["source"], start["job_id"]) == (4, "slurm", job_id)
    assert "rank 0/4" in log and "node 0/2" in log
    codes, r = run([str(job), "--run-dir", str(tmp_path / "local")], 4, tmp_path / "logs")
    assert codes == [0] * 4, r.output()
    a, opt_a = final_state(run_dir)
    b, opt_b = final_state(tmp_path / "local")
    assert_bit_equal(a, b, "model")
    assert_bit_equal(opt_a["state"], opt_b["state"], "optimizer")


@pytest.mark.cluster
@pytest.mark.slow
def test_partition_preemption_of_srun_ranks_requeues_and_resumes_bit_exactly(
        tmp_path: Path, slurm_cluster: Any) -> None:
    """A `high` job preempts ours (PreemptMode=REQUEUE): SIGTERM to every task, the ranks stop
    at one step and checkpoint within GraceTime, rank 0 requeues (SLURM would not: the job
    ended on its own), the next incarnation resumes; the result equals an uninterrupted run."""
    import slurmtools

    train = {**NOBN, "model": "cnn_tiny", "max_steps": 300, "batch_size": 32, "global_batch_size": 0}
    job = write_job(tmp_path / "job.toml", train=train, data=DATA,
                    slurm={"nodes": 2, "tasks_per_node": 1})
    run_dir = tmp_path / "srun"
    run_dir.mkdir()
    (run_dir / rundir.CONFIG).write_text(jobfile.resolve(job).to_json())
    script = tmp_path / "job.sbatch"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --partition=low
        #SBATCH --requeue
        #SBATCH --open-mode=append
        #SBATCH --nodes=2
        #SBATCH --ntasks-per-node=1
        #SBATCH --cpus-per-task=1
        #SBATCH --time=00:10:00
        #SBATCH --output={tmp_path}/slurm-%j.out
        export PYTHONPATH={REPO / 'tests'}:{REPO}
        export OMP_NUM_THREADS=1
        srun --kill-on-bad-exit=1 {Path(PYTHON).absolute()} -m ddpjob run {run_dir}
        """))
    slurmtools.cluster_free(timeout=300)
    job_id = slurmtools.submit(script, cwd=tmp_path)
    slurmtools.read_when(run_dir / "metrics.jsonl", r'"step": 40,', timeout=300)
    high = slurmtools.submit("#!/bin/bash\nsleep 1\n", "--partition=high", "--nodes=2",
                             "--ntasks-per-node=2", "--time=2", f"--output={tmp_path / 'high.out'}",
                             cwd=tmp_path)
    slurmtools.wait_state(job_id, {"PENDING"}, timeout=60)
    assert slurmtools.wait_done(high, timeout=120) == "COMPLETED"
    slurmtools.release_now(job_id)
    state = slurmtools.wait_done(job_id, timeout=300)
    log = "\n".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert state == "COMPLETED", log[-4000:]
    ev = read_events(run_dir)
    stop = decisions(ev)
    assert stop[0]["reason"] == "preemption" and stop[0]["requeued"] is True, stop
    assert stop[-1]["reason"] == "finished" and stop[-1]["restart"] == 1
    assert [e["resumed_step"] for e in ev if e["event"] == "start"] == [None, stop[0]["step"]]
    codes, r = run([str(job), "--run-dir", str(tmp_path / "local")], 2, tmp_path / "logs")
    assert codes == [0, 0], r.output()
    a, opt_a = final_state(run_dir)
    b, opt_b = final_state(tmp_path / "local")
    assert_bit_equal(a, b, "model")
    assert_bit_equal(opt_a["state"], opt_b["state"], "optimizer")
    assert {s: m["loss"] for s, m in metrics(run_dir).items()} == \
        {s: m["loss"] for s, m in metrics(tmp_path / "local").items()}
