"""`ddpjob selftest` as a user runs it: alone, under torchrun, under the legacy launcher, under srun."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path


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
