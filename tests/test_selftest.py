"""`ddpjob selftest` as a user runs it: alone, under torchrun, under the legacy launcher, under srun."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ddpjob.node.selftest import check_layout

PY = sys.executable
VENV_BIN = Path(PY).parent


def clean_environ(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM", "RANK", "LOCAL_", "WORLD_", "MASTER_", "GROUP_", "DDPJOB_",
                                "TORCHELASTIC", "OMP_NUM_THREADS"))}
    env.update(extra)
    return env


def run(cmd: list[str], timeout: float = 180, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_environ(**extra))


def table_rows(stdout: str) -> list[list[str]]:
    """The rows of the plain-text `ranks` table (rank, local rank, node, host, device, backend)."""
    lines = stdout.splitlines()
    start = lines.index("ranks") + 2  # title, header
    rows = []
    for line in lines[start:]:
        cells = line.split()
        if len(cells) != 6 or not cells[0].isdigit():
            break
        rows.append(cells)
    return rows


def assert_ok(proc: subprocess.CompletedProcess[str], ranks: int) -> list[list[str]]:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.count("selftest: OK") == 1, out  # printed by rank 0 only
    assert "FAILED" not in out
    rows = table_rows(out)
    assert [int(r[0]) for r in rows] == list(range(ranks))
    total = ranks * (ranks - 1) // 2
    assert f"all_reduce sum of ranks: {total} (expected {total})" in out
    return rows


def test_alone() -> None:
    proc = run([PY, "-m", "ddpjob", "selftest"], timeout=120)
    rows = assert_ok(proc, 1)
    assert rows[0][4:] == ["cpu", "none"]
    assert "bus bandwidth: n/a with 1 rank" in proc.stdout


def test_two_ranks_under_torchrun() -> None:
    proc = run([str(VENV_BIN / "torchrun"), "--nproc-per-node", "2", "-m", "ddpjob", "selftest",
                "--size-mb", "2"])
    rows = assert_ok(proc, 2)
    assert [r[1] for r in rows] == ["0", "1"] and {r[5] for r in rows} == {"gloo"}
    assert re.search(r"all-reduce bus bandwidth: \d+\.\d+ GB/s \(2 MB", proc.stdout)


def test_two_ranks_under_legacy_launch_with_local_rank_argument() -> None:
    # torch.distributed.launch (still in torch 2.14, deprecated) without --use-env appends
    # --local-rank=N *before* our subcommand; the CLI must accept it there.
    proc = run([PY, "-m", "torch.distributed.launch", "--nproc-per-node", "2", "-m", "ddpjob",
                "selftest", "--size-mb", "1"])
    assert_ok(proc, 2)


def test_missing_rank0_is_one_line_error_within_timeout() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run([PY, "-m", "ddpjob", "selftest", "--timeout", "3"], timeout=60, RANK="1", LOCAL_RANK="1",
               WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddpjob: error: rank 1 on ")
    assert f"could not reach rank 0 at 127.0.0.1:{port} within 3 s" in err[0] and "Hint:" in err[0]


def test_layout_check_names_the_problem() -> None:
    good = [(0, 0, 0, "n1", "cpu", "gloo"), (1, 1, 0, "n1", "cpu", "gloo"), (2, 0, 1, "n2", "cpu", "gloo")]
    assert check_layout(good) is None
    assert "ranks [0, 2]" in check_layout([good[0], good[2]])
    assert "several hosts" in check_layout([good[0], (1, 1, 0, "n9", "cpu", "gloo")])
    assert "local ranks on node 0 are [0, 0]" in check_layout([good[0], (1, 0, 0, "n1", "cpu", "gloo")])


@pytest.mark.cluster
def test_two_nodes_two_tasks_each_under_srun(slurm_cluster, tmp_path: Path) -> None:
    from slurmtools import job_info, submit, wait_done

    out = tmp_path / "selftest.out"
    script = f"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --time=00:05:00
#SBATCH --job-name=ddpjob-selftest
#SBATCH --output={out}
# in the batch shell itself (not a rank): must refuse with one line
{PY} -m ddpjob selftest --timeout 10 && echo "batch-shell: ran" || echo "batch-shell: refused $?"
srun {PY} -m ddpjob selftest --size-mb 4 --timeout 60
"""
    job_id = submit(script, cwd=tmp_path)
    state = wait_done(job_id, timeout=600)  # may queue behind other tests
    text = out.read_text()
    assert state == "COMPLETED", text
    assert job_info(job_id).get("ExitCode", "0:0") == "0:0", text
    assert "batch-shell: refused 1" in text
    assert re.search(r"ddpjob: error: SLURM_NTASKS=4 but SLURM_STEP_ID is not set: this process runs "
                     r"in the sbatch batch script of job \d+.*Hint: start it with `srun", text)
    rows = table_rows(text)
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert [(r[1], r[2], r[3]) for r in rows] == [("0", "0", "n1"), ("1", "0", "n1"),
                                                   ("0", "1", "n2"), ("1", "1", "n2")]
    assert "all_reduce sum of ranks: 6 (expected 6)" in text
    assert "selftest: 4 rank(s) on 2 node(s) via slurm" in text and "master n1:" in text
    assert text.count("selftest: OK") == 1
