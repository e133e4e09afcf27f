"""A [train] command's progress evidence (ddpjob/ledger/progress.py) and what the crash-loop rules
make of it (ledger/crashes.facts, ledger/policy.decide): a program that logs no steps is never
"at step 0 again"; its files or its last line of output say whether an attempt got on."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ddpjob import rundir
from ddpjob.config import JobConfig, SlurmConfig
from ddpjob.ledger import crashes, events, policy, progress


def crash(run: Path, restart: int, *, last: str, at: float, **decided: Any) -> None:
    """An attempt that started at `at` and whose rank 1 was SIGKILLed after printing `last`."""
    events.record(run, "start", job_id="j", restart=restart, launched_time=at)
    events.record(run, "stop", reason="crash", rank=1, job_id="j", restart=restart, last_output=last,
                  error="the command was killed by SIGKILL", error_class=policy.INFRASTRUCTURE)
    if decided:
        events.record(run, "stop", reason="crash", job_id="j", restart=restart, step=None, failed_how="killed by SIGKILL",
                      failed_rank=1, verdict=policy.INFRASTRUCTURE, **decided)


def culprit() -> crashes.Culprit:
    return crashes.Culprit(1, "n2", "killed by SIGKILL", True)


def verdict(run: Path, restart: int, path: Path | None = None) -> tuple[policy.Verdict, progress.Point]:
    evs = events.read(run)
    at = progress.point(run, evs, "j", restart, progress_path=path, culprit_rank=1)
    facts = crashes.facts(evs, "j", restart, culprit(), here=True, **at.facts())
    cfg = JobConfig(slurm=SlurmConfig(max_failures=20))
    return policy.decide(facts, policy.Limits.of(cfg)), at


def test_output_that_moved_on_is_progress_and_the_same_last_line_is_a_loop(tmp_path: Path) -> None:
    crash(tmp_path, 0, last="[rank1] Epoch 4 | loss 0.3", at=1.0, action="restart", progress=None,
          last_output="[rank1] Epoch 4 | loss 0.3")
    crash(tmp_path, 1, last="[rank1] Epoch 7 | loss 0.2", at=2.0)
    second, at = verdict(tmp_path, 1)
    assert at.evidence.progressed is True and at.resume_at is None and at.steps_lost is None
    assert second.action == policy.RESTART and "OOM" not in second.line, second
    assert at.fields() == {"progress": True, "last_output": "[rank1] Epoch 7 | loss 0.2"}
    events.record(tmp_path, "stop", reason="crash", job_id="j", restart=1, failed_how="killed by SIGKILL", failed_rank=1,
                  verdict=policy.INFRASTRUCTURE, action="restart", **at.fields())
    crash(tmp_path, 2, last="[rank1] Epoch 7 | loss 0.2", at=3.0)  # died where it died before
    third, at = verdict(tmp_path, 2)
    assert at.evidence.progressed is False
    assert third.action == policy.END and third.error, third
    # the advice names what a command has, never the trainer's key
    assert "its last line of output unchanged" in third.line and "train.command" in third.line, third.line
    assert "train.batch_size" not in third.line


def test_nothing_to_tell_never_fires_a_loop_rule(tmp_path: Path) -> None:
    """Two SIGKILLs of a program that logs no steps and printed nothing: no 'step 0 == step 0'."""
    for restart in (0, 1):
        events.record(tmp_path, "start", job_id="j", restart=restart, launched_time=float(restart))
        events.record(tmp_path, "stop", reason="crash", rank=1, job_id="j", restart=restart,
                      error="the command was killed by SIGKILL", error_class=policy.INFRASTRUCTURE)
        decided, at = verdict(tmp_path, restart)
        assert at.evidence.progressed is None and decided.action == policy.RESTART, decided
        events.record(tmp_path, "stop", reason="crash", job_id="j", restart=restart, failed_how="killed by SIGKILL",
                      failed_rank=1, verdict=policy.INFRASTRUCTURE, action="restart", **at.fields())


def test_files_under_command_progress_say_whether_an_attempt_got_on(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    snap = out / "snapshot.pt"
    snap.write_bytes(b"x")
    old = time.time() - 100
    os.utime(snap, (old, old))
    os.utime(out, (old, old))
    run = tmp_path / "run"
    run.mkdir()
    crash(run, 0, last="a", at=old + 50)  # nothing written under out/ since the attempt began
    assert progress.of_attempt(run, events.read(run), "j", 0, progress_path=out, culprit_rank=1).progressed is False
    snap.write_bytes(b"newer")
    ev = progress.of_attempt(run, events.read(run), "j", 0, progress_path=out, culprit_rank=1)
    assert ev.progressed is True and ev.by == f"its files under {out}"
    assert progress.newest_change(tmp_path / "missing") is None


def test_checkpoint_lines_make_the_steps_lost_known(tmp_path: Path) -> None:
    lines = [{"kind": "train", "step": s, "restart": 0, "time": float(s)} for s in range(1, 13)]
    lines.insert(10, {"kind": "checkpoint", "step": 10, "restart": 0, "time": 10.5})
    (tmp_path / rundir.METRICS).write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert crashes.command_point(tmp_path) == (10, 2)
    (tmp_path / rundir.METRICS).write_text("".join(json.dumps(r) + "\n" for r in lines if r["kind"] == "train"))
    # its newest step, and a loss nobody can know (never claimed 0)
    assert crashes.command_point(tmp_path) == (12, None)
