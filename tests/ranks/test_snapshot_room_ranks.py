"""The in-memory snapshots fitted to the node at their first one (store/memsnap.py: fit): real
ranks whose checkpoint.snapshot_dir is a tmpfs too small for 2 ranks x (2 kept + 1 being written)
keep 1 snapshot, or none, each start saying so in one line, and train on to the end. Needs root
(a tmpfs of a chosen size is mounted per test); the arithmetic is in tests/unit/test_memsnap.py."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ranks import metrics, run, write_job
from runlogs import events

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
STEPS = 12
# tests/trainer_plugins.py's cnn_tiny twin with SGD + momentum: the size fit() counts for one
# rank's snapshot (tensors' bytes, 64 per plain value; the line prints it), measured here
SNAPSHOT_KIB = 532.2


def tmpfs(folder: Path, kib: int) -> Iterator[Path]:
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k,mode=0700", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture
def tiny(tmp_path: Path) -> Iterator[Path]:
    yield from tmpfs(tmp_path / "tiny", 64)


@pytest.fixture
def for_one(tmp_path: Path) -> Iterator[Path]:
    """Room for 2 ranks x (1 kept + 1 being written), not for 2 x (2 + 1)."""
    yield from tmpfs(tmp_path / "small", int(SNAPSHOT_KIB * 5))


def train(tmp_path: Path, snapshot_dir: Path, *, restart: int = 0, **env: str) -> tuple[list[int], str]:
    """Two local ranks (job "fit"), a snapshot every 2 steps into `snapshot_dir`, the test
    plugins' `env` set; (exit codes, rank 0's log)."""
    job = write_job(tmp_path / "job.toml", slurm=dict(nodes=1, tasks_per_node=2, max_failures=1),
                    train=dict(model="trainer_plugins:signalling_cnn", batch_size=16, max_steps=STEPS,
                               lr=0.05, log_every=1, amp="off", channels_last=False, threads=1, seed=3),
                    data=dict(dataset="synthetic", synthetic_train=512, synthetic_test=64),
                    checkpoint=dict(snapshot_every=2, snapshot_dir=str(snapshot_dir)))
    args = [str(job), "--run-dir", str(tmp_path / "run")] if restart == 0 else [str(tmp_path / "run")]
    codes, ranks = run(args, 2, tmp_path / "logs", job_id="fit", restart=restart, timeout=300,
                       extra_env={"DDPJOB_TEST_SNAP_DIR": str(snapshot_dir), **env})
    return codes, ranks.logs[0].read_text() + f"\n(rank 1: {ranks.logs[1].read_text()[-1500:]})"


def fitted(log: str) -> list[str]:
    return [x for x in log.splitlines() if "in-memory snapshots" in x]


def finished(tmp_path: Path, snapshot_dir: Path, codes: list[int], log: str) -> None:
    assert codes == [0, 0], log[-3000:]  # no OOM kill, no failed write: it trained on
    assert max(metrics(tmp_path / "run")) == STEPS
    assert not list(snapshot_dir.glob("ddpjob-*/*")), list(snapshot_dir.rglob("*"))  # the job's tree went at its end


def test_a_folder_too_small_for_one_snapshot_each_turns_them_off_in_one_line(tmp_path: Path, tiny: Path) -> None:
    codes, log = train(tmp_path, tiny)
    finished(tmp_path, tiny, codes, log)
    lines = fitted(log)
    assert len(lines) == 1, log[-3000:]
    m = re.fullmatch(rf"ddpjob: warning: in-memory snapshots off on \S+: 2 rank\(s\) x 3 x ([\d.]+) KiB = "
                     rf"[\d.]+ (KiB|MiB) needed, 64\.0 KiB free in {tiny}", lines[0])
    assert m, lines[0]
    assert float(m.group(1)) == SNAPSHOT_KIB, lines[0]  # the next test sizes its tmpfs from it


def test_a_folder_with_room_for_one_each_keeps_one_and_a_restart_resumes_from_it(tmp_path: Path, for_one: Path) -> None:
    """Each start fits them (one line each); rank 1 is SIGKILLed in step 9 once both snapshots of
    step 8 are committed, and the restart resumes from that snapshot: kept 1 deep, it was there.
    Rank 1's folder also holds three older snapshots, as kills between a commit and its prune
    leave them (a stressed run saw one): the restart drops them once it has resumed, so its
    first snapshots find the room the fit counted on and no "snapshots off" line is printed."""
    codes, log = train(tmp_path, for_one, DDPJOB_TEST_SIGNAL="1:9:0:kill", DDPJOB_TEST_SNAP_WAIT="8")
    assert codes[1] == -signal.SIGKILL and codes[0] != 0, log[-3000:]
    lines = fitted(log)
    assert len(lines) == 1 and "in-memory snapshots kept 1 deep instead of 2 on " in lines[0], log[-3000:]
    (eight,) = for_one.glob("ddpjob-*/*/*/rank-1/step-000000008")
    for step in (2, 4, 6):  # 4 x 532 KiB of the tmpfs's 5 x 532: without the drop no rank has room
        old = eight.with_name(f"step-{step:09d}")
        shutil.rmtree(old, ignore_errors=True)  # under load the kill can beat the prune of step 6 itself
        shutil.copytree(eight, old)
        (old / "manifest.json").write_text((old / "manifest.json").read_text().replace('"step": 8', f'"step": {step}'))
    codes, log = train(tmp_path, for_one, restart=1)
    finished(tmp_path, for_one, codes, log)
    assert "resuming from the in-memory snapshot of step 8" in log, log[-3000:]
    assert [s["resumed_step"] for s in events(tmp_path / "run", "start")] == [None, 8]
    lines = fitted(log)
    assert len(lines) == 1 and "in-memory snapshots kept 1 deep instead of 2 on " in lines[0], log[-3000:]
