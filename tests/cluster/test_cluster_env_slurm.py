"""ClusterEnv.from_environ: every launcher as a plain dict, and every contradiction as an error."""

from __future__ import annotations

import pytest

from ddpjob.node.cluster import PORT_BASE, PORT_SPAN


# ------------------------------------------------------------------- on the real cluster
PROBE = ("from ddpjob.node.cluster import ClusterEnv\n"
         "e = ClusterEnv.from_environ()\n"
         "print('ENV', e.rank, e.local_rank, e.world_size, e.local_world_size, e.node_rank, "
         "e.num_nodes, e.hostname, e.master_addr, e.master_port, e.job_id, e.slurm_step, flush=True)\n")


@pytest.mark.cluster
def test_real_sbatch_batch_shell_srun_tasks_and_a_sub_step(slurm_cluster, tmp_path) -> None:
    """What the real SLURM exports, read by the real from_environ: the batch shell is refused,
    the 4 srun tasks get ranks 0-3 on n1/n2, a one-task step on n2 gets MASTER_ADDR n2."""
    import sys

    from slurmtools import submit, wait_done

    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "out.txt"
    py = sys.executable
    script = f"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --time=00:05:00
#SBATCH --output={out}
{py} -m ddpjob selftest >/dev/null 2>{tmp_path}/batch.err; echo "batch rc=$?"
srun {py} {probe}
srun -n1 -N1 -w n2 {py} {probe}
"""
    job_id = submit(script, cwd=tmp_path)
    assert wait_done(job_id, timeout=600) == "COMPLETED", out.read_text()  # may queue behind others
    text = out.read_text()
    assert "batch rc=1" in text
    assert "SLURM_NTASKS=4 but SLURM_STEP_ID is not set" in (tmp_path / "batch.err").read_text()
    rows = sorted(line.split()[1:] for line in text.splitlines() if line.startswith("ENV "))
    port = str(PORT_BASE + int(job_id) % PORT_SPAN)
    assert rows == sorted([
        ["0", "0", "4", "2", "0", "2", "n1", "n1", port, job_id, "True"],
        ["1", "1", "4", "2", "0", "2", "n1", "n1", port, job_id, "True"],
        ["2", "0", "4", "2", "1", "2", "n2", "n1", port, job_id, "True"],
        ["3", "1", "4", "2", "1", "2", "n2", "n1", port, job_id, "True"],
        ["0", "0", "1", "1", "0", "1", "n2", "n2", port, job_id, "True"],
    ])
