"""The straggler watch (rank/straggler.py) with real ranks on the local backend: one rank made
slow in its own compute at a chosen step (trainer_plugins: a busy-wait in its backward pass
from its 31st training forward call) is named by rank 0, with its host and the cause, and the
event is in the run dir and in `status`. The SLURM 2 x 2 cases (compute, data, a CPU hog, a
clean run) are in tests/cluster/test_straggler_slurm.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from clirun import REPO
from clirun import ddpjob as run_cli
from ddpjob.ledger.events import read as read_events

SMOKE = str(REPO / "jobs" / "smoke.toml")
# train.straggler_threshold for 4 unpinned ranks on this machine's 2 cores, here and in the SLURM
# 2 x 2 cases. Whichever ranks the scheduler runs first in a step arrive sooner, and that can
# hold for a window: clean ranks at about twice the median, named under the default 50% before
# the slow rank began (CI16, idle: 13.5 and 10.6 ms against 6.0; CI17, beside stress-ng: 15.5
# and 17.2 against 8.7). The injected 150 ms is about 15 times the median: named at 300%, which
# no clean rank came near. The default's arithmetic is pinned by tests/unit/test_straggler.py.
NOISY_THRESHOLD = 3.0


def straggler_run(tmp_path: Path, how: str, *, backend: str, nodes: int, tasks: int, slow_rank: int | None,
                  seconds: float = 0.15, steps: int = 120, extra_env: dict[str, str] | None = None,
                  threshold: float | None = None) -> tuple[Path, list[dict[str, Any]]]:
    """A run of `steps` steps in which `slow_rank` is slow by `seconds` per step from step 31
    on (`how`: compute, data or hog; None: nobody is), named when `threshold` above the others'
    median (None: train.straggler_threshold's default). Returns the run dir and its straggler
    events."""
    run = tmp_path / f"run-{how}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDPJOB_"))}
    env.update({"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]), "OMP_NUM_THREADS": "1",
                **(extra_env or {})})
    if slow_rank is not None:
        env["DDPJOB_TEST_STRAGGLE"] = f"{slow_rank}:31:{how}:{seconds}"
    keys = ["--backend", backend, "--run-dir", str(run), "--wait", "--nodes", str(nodes),
            "--set", f"slurm.tasks_per_node={tasks}", "--set", f"train.max_steps={steps}",
            "--set", "train.eval_every=0", "--set", "train.batch_size=16", "--set", "train.log_every=20",
            "--set", 'train.model="trainer_plugins:straggling_cnn"', "--set", "checkpoint.every_steps=0",
            "--set", "train.straggler_window=20"]
    if how == "data":
        keys += ["--set", 'data.dataset="trainer_plugins:slow_synthetic"']
    if threshold is not None:
        keys += ["--set", f"train.straggler_threshold={threshold}"]
    out = run_cli("submit", SMOKE, *keys, cwd=tmp_path, env=env, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return run, [e for e in read_events(run) if e.get("event") == "straggler"]


@pytest.mark.slow
def test_a_rank_slow_in_its_compute_is_named_by_rank_0_with_its_host_and_the_cause(tmp_path: Path) -> None:
    run, flags = straggler_run(tmp_path, "compute", backend="local", nodes=1, tasks=4, slow_rank=2,
                               threshold=NOISY_THRESHOLD)
    assert [(f["rank"], f["cause"]) for f in flags] == [(2, "compute")], flags
    flag = flags[0]
    assert 31 <= flag["step"] <= 31 + 100 and flag["host"] == os.uname().nodename, flag
    # its work per step against the others' (their share of 2 cores shrinks while it spins, so
    # only the order is certain here; the unit tests pin the arithmetic)
    assert flag["busy_ms"] > flag["median_ms"] > 0 and flag["first_step"] < flag["step"], flag
    log0 = (run / "logs" / "rank-0.log").read_text()
    assert f"rank 2 on {flag['host']} is a straggler: " in log0 and "the cause is its own compute" in log0
    status = run_cli("status", str(run), cwd=tmp_path).stdout
    assert f"straggler   rank 2 on {flag['host']} (compute), steps {flag['first_step']}-{flag['step']}: " in status, status
