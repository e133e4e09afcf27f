"""Proof that the SLURM test cluster is real: multi-node srun, accounting, real preemption.

Everything else that runs against the cluster (launcher, requeue, resume tests) relies on these
behaviours; when one of these tests fails, fix the cluster (tests/cluster/) before anything else.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

import slurmtools

pytestmark = pytest.mark.cluster

# Each of the 4 tasks prints its SLURM view; sorted output is compared against the expected set.
SRUN_JOB = """#!/bin/bash
#SBATCH --job-name=infra-srun
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --time=2
srun bash -c 'echo "task PROCID=$SLURM_PROCID LOCALID=$SLURM_LOCALID NODEID=$SLURM_NODEID NODE=$SLURMD_NODENAME LIST=$SLURM_JOB_NODELIST"'
"""

# A preemptible job occupying all 4 CPUs. Its srun tasks trap SIGTERM (what SLURM sends to job
# steps when preemption starts) and log it; the batch shell only gets signalled at the final kill.
# AFTER_STEP decides what the batch shell does once its step has ended on the first run.
PREEMPTIBLE_JOB = """#!/bin/bash
#SBATCH --job-name=infra-preempt
#SBATCH --partition=low
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --time=5
echo "batch start restart=${SLURM_RESTART_COUNT:-unset} job=$SLURM_JOB_ID"
if [ "${SLURM_RESTART_COUNT:-0}" -ge 1 ]; then echo "second run done"; exit 0; fi
srun bash -c 'trap "echo task \\$SLURM_PROCID got SIGTERM; exit 0" TERM
echo "task $SLURM_PROCID ready"; sleep 300 & wait $!'
echo "step ended"
AFTER_STEP
"""
# Linger until SLURM's own kill at the end of GraceTime: SLURM requeues the job itself.
LINGER = "sleep 300 & wait $!"
# What a checkpointing job does: requeue itself during the grace period. (Exiting 0 or 1 instead
# makes the job COMPLETED or FAILED: SLURM does not requeue a job that ends on its own.)
SELF_REQUEUE = 'scontrol requeue "$SLURM_JOB_ID"; sleep 30'


def test_two_nodes_two_tasks_each(slurm_cluster, tmp_path: Path) -> None:
    out = tmp_path / "srun.out"
    job = slurmtools.submit(SRUN_JOB, f"--output={out}", cwd=tmp_path)
    # Generous: the job queues behind whatever else holds the 4 CPUs.
    assert slurmtools.wait_done(job, timeout=300) == "COMPLETED", out.read_text()
    tasks = sorted(line for line in out.read_text().splitlines() if line.startswith("task "))
    assert tasks == [
        "task PROCID=0 LOCALID=0 NODEID=0 NODE=n1 LIST=n[1-2]",
        "task PROCID=1 LOCALID=1 NODEID=0 NODE=n1 LIST=n[1-2]",
        "task PROCID=2 LOCALID=0 NODEID=1 NODE=n2 LIST=n[1-2]",
        "task PROCID=3 LOCALID=1 NODEID=1 NODE=n2 LIST=n[1-2]",
    ]
    # Accounting: slurmdbd records the job (written asynchronously, so give it a moment).
    deadline = time.monotonic() + 30
    while slurmtools.sacct_state(job) != "COMPLETED" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert slurmtools.sacct_state(job) == "COMPLETED"


def test_the_cluster_grows_to_more_nodes_when_asked(slurm_cluster, tmp_path: Path) -> None:
    """start.sh --nodes 3: a third slurmd (n3 on 127.0.0.4) in partition `wide`; `low` and
    `high` keep n1 and n2, so the preemption tests see the cluster they were written for, and a
    later start.sh without --nodes keeps the three. The test gives the 2-node cluster back (the
    other tests list the partitions)."""
    start = Path(__file__).parent / "start.sh"
    slurmtools.cluster_free(timeout=300)
    try:
        _grown_cluster_runs_a_3_node_job(start, tmp_path)
    finally:
        back = subprocess.run(["bash", str(start), "--nodes", "2"], capture_output=True, text=True, timeout=300)
        assert back.returncode == 0, back.stdout[-2000:] + back.stderr[-2000:]


def _grown_cluster_runs_a_3_node_job(start: Path, tmp_path: Path) -> None:
    for args in (["--nodes", "3"], []):
        out = subprocess.run(["bash", str(start), *args], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert "n1=idle n2=idle n3=idle" in out.stdout, out.stdout[-500:]
    parts = subprocess.run(["sinfo", "-h", "-o", "%P %D %N"], capture_output=True, text=True, timeout=30).stdout
    assert parts.split("\n")[:3] == ["low* 2 n[1-2]", "high 2 n[1-2]", "wide 3 n[1-3]"], parts
    script = tmp_path / "wide.sh"
    script.write_text("#!/bin/bash\nsrun bash -c 'echo task $SLURM_PROCID $SLURMD_NODENAME'\n")
    out_file = tmp_path / "wide.out"
    job = slurmtools.submit(script, "-p", "wide", "-N", "3", "--ntasks-per-node=1", f"--output={out_file}", cwd=tmp_path)
    assert slurmtools.wait_done(job, timeout=300) == "COMPLETED", out_file.read_text()
    assert sorted(ln for ln in out_file.read_text().splitlines() if ln.startswith("task ")) == \
        ["task 0 n1", "task 1 n2", "task 2 n3"]
    assert subprocess.run(["getent", "hosts", "n3"], capture_output=True, text=True).stdout.split()[0] == "127.0.0.4"


def test_node_names_resolve_to_their_own_addresses(slurm_cluster) -> None:
    hostnames = subprocess.run(["scontrol", "show", "hostnames", "n[1-2]"],
                               capture_output=True, text=True, check=True).stdout.split()
    assert hostnames == ["n1", "n2"]
    addrs = [subprocess.run(["getent", "hosts", n], capture_output=True, text=True,
                            check=True).stdout.split()[0] for n in hostnames]
    assert addrs == ["127.0.0.2", "127.0.0.3"]


def _preempt(tmp_path: Path, after_step: str, requeue_timeout: float) -> tuple[str, str]:
    """Run PREEMPTIBLE_JOB, preempt it from `high`, and see it restart; return (job id, log)."""
    slurmtools.cluster_free(timeout=180)
    log = tmp_path / "preempt.out"
    job = slurmtools.submit(PREEMPTIBLE_JOB.replace("AFTER_STEP", after_step),
                            f"--output={log}", cwd=tmp_path)
    slurmtools.wait_state(job, {"RUNNING"}, timeout=60)
    # All four tasks have installed their trap before the high job arrives.
    slurmtools.read_when(log, r"(?s)(task \d ready.*){4}", timeout=30)
    high = slurmtools.submit("#!/bin/bash\nsleep 1\n", "--partition=high", "--nodes=2",
                             "--ntasks-per-node=2", "--job-name=infra-high", "--time=2",
                             f"--output={tmp_path / 'high.out'}", cwd=tmp_path)
    slurmtools.read_when(log, r"task \d got SIGTERM", timeout=30)
    # Back in the queue with the same id, restart counted.
    slurmtools.wait_state(job, {"PENDING"}, timeout=requeue_timeout)
    info = slurmtools.job_info(job)
    assert info["JobId"] == job and info["Restarts"] == "1", info
    assert slurmtools.wait_done(high, timeout=60) == "COMPLETED"
    slurmtools.release_now(job)  # skip the ~11 s BeginTime hold of a requeued job
    assert slurmtools.wait_done(job, timeout=60) == "COMPLETED"
    return job, log.read_text()


def _check_restart_log(job: str, text: str) -> None:
    # --open-mode=append kept the first run's lines; the second run saw SLURM_RESTART_COUNT=1.
    assert f"batch start restart=unset job={job}" in text, text
    assert re.search(r"task \d got SIGTERM", text), text
    assert f"batch start restart=1 job={job}" in text, text
    assert text.index("restart=unset") < text.index("got SIGTERM") < text.index("restart=1")
    assert text.rstrip().endswith("second run done"), text


def test_preemption_self_requeue_during_grace(slurm_cluster, tmp_path: Path) -> None:
    job, text = _preempt(tmp_path, SELF_REQUEUE, requeue_timeout=30)
    _check_restart_log(job, text)
    assert "DUE TO JOB REQUEUE" in text, text


@pytest.mark.slow
def test_preemption_requeue_by_slurm_after_grace(slurm_cluster, tmp_path: Path) -> None:
    # GraceTime=20 plus slurmctld's periodic check (up to ~30 s) before SLURM kills and requeues.
    start = time.monotonic()
    job, text = _preempt(tmp_path, LINGER, requeue_timeout=90)
    _check_restart_log(job, text)
    assert "DUE TO PREEMPTION" in text, text
    assert time.monotonic() - start < 150
