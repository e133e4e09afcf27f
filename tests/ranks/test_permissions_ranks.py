"""Run-dir permissions: 0700 (or 0750 with slurm.share_group), files 0600/0640, whatever the
umask; `ddpjob run` and submitit's script refuse a run dir others can write (submitit unpickles
RUN_DIR/logs/*_submitted.pkl at every start: a writable folder is code run as the job's user)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_permissions import _modes


REPO = Path(__file__).resolve().parents[2]
DDPJOB = [sys.executable, "-m", "ddpjob"]


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
