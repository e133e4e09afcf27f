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
from runlogs import decisions

SMOKE = str(REPO / "jobs" / "smoke.toml")
# train.straggler_threshold the tests used before the watch followed the run's own spread and
# took the waits for a core out (issue 48): 4 unpinned ranks on 2 cores had clean ranks at about
# twice the median. Kept for callers; the tests here run at the default.
NOISY_THRESHOLD = 3.0


def straggler_run(tmp_path: Path, how: str, *, backend: str, nodes: int, tasks: int, slow_rank: int | str | None,
                  seconds: float = 0.15, steps: int = 120, extra_env: dict[str, str] | None = None,
                  threshold: float | None = None, at: int = 31,
                  settings: tuple[str, ...] = ()) -> tuple[Path, list[dict[str, Any]]]:
    """A run of `steps` steps in which `slow_rank` ("*": every rank) is slow by `seconds` per
    step from step `at` on (`how`: compute, share, data or hog: trainer_plugins' _straggle; None:
    nobody is), named when `threshold` above the others' median (None: train.straggler_threshold's
    default). Returns the run dir and its straggler events."""
    run = tmp_path / f"run-{how}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DDPJOB_"))}
    env.update({"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]), "OMP_NUM_THREADS": "1",
                **(extra_env or {})})
    if slow_rank is not None:
        env["DDPJOB_TEST_STRAGGLE"] = f"{slow_rank}:{at}:{how}:{seconds}"
    more = [x for key in settings for x in ("--set", key)]  # more job keys
    keys = ["--backend", backend, "--run-dir", str(run), "--wait", "--nodes", str(nodes),
            "--set", f"slurm.tasks_per_node={tasks}", "--set", f"train.max_steps={steps}",
            "--set", "train.eval_every=0", "--set", "train.batch_size=16", "--set", "train.log_every=20",
            "--set", 'train.model="trainer_plugins:straggling_cnn"', "--set", "checkpoint.every_steps=0",
            "--set", "train.straggler_window=20"]
    if how.startswith("data"):
        keys += ["--set", 'data.dataset="trainer_plugins:slow_synthetic"']
    if threshold is not None:
        keys += ["--set", f"train.straggler_threshold={threshold}"]
    out = run_cli("submit", SMOKE, *keys, *more, cwd=tmp_path, env=env, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return run, [e for e in read_events(run) if e.get("event") == "straggler"]


@pytest.mark.slow
def test_a_rank_slow_in_its_compute_is_named_by_rank_0_with_its_host_and_the_cause(tmp_path: Path) -> None:
    run, flags = straggler_run(tmp_path, "compute", backend="local", nodes=1, tasks=4, slow_rank=2)
    # the default threshold, 4 ranks on 2 busy cores: the slow rank and nobody else
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


@pytest.mark.slow
def test_the_whole_job_slowed_from_a_step_is_said_against_its_own_speed(tmp_path: Path) -> None:
    """From step 61 every rank's data wait is 20 times the median step before it (trainer_plugins'
    datawait hook: relative to the run's own speed, whatever the host's load was when the
    baseline was taken): no rank is a straggler, but rank 0 says the job runs slower than its
    own baseline, that every rank is, and that the data wait moved; `status` shows it. (A
    threshold of 500%, 6x: on CI's shared 2 cores other work slows the job by 2-4x at times, a
    slowdown as real as the one made here; a first CI run at 200% and a fixed 300 ms saw one.)"""
    run, flags = straggler_run(tmp_path, "datawait", backend="local", nodes=1, tasks=2, slow_rank="*",
                               seconds=20.0, at=61, steps=100,
                               settings=("train.slowdown_window=20", "train.slowdown_threshold=5.0"))
    assert [f for f in flags if f["cause"] != "host"] == [], flags
    evs = read_events(run)
    (base,) = [e for e in evs if e["event"] == "baseline"]
    assert base["step"] == 30 and base["world_size"] == 2, base  # 10 steps of warm-up, then a window
    (slow,) = [e for e in evs if e["event"] == "slowdown"]
    assert slow["state"] == "began" and slow["cause"] == "data" and slow["ranks"] == [0, 1], slow
    assert 61 <= slow["since"] <= slow["step"] <= 61 + 3 * 20, slow
    assert slow["line"].startswith(f"the job runs at {slow['ratio']:.2f}x its own speed since step {slow['since']} "), slow
    assert ": every rank is slower (not one straggler); the data wait went from " in slow["line"], slow
    assert slow["line"] in (run / "logs" / "rank-0.log").read_text()
    status = run_cli("status", str(run), cwd=tmp_path).stdout
    assert f"slowdown    {slow['line']}" in status, status


@pytest.mark.slow
def test_a_rank_that_shares_its_core_with_hogs_names_its_host_not_the_rank(tmp_path: Path) -> None:
    """2 ranks pinned to a core each; from step 31 three CPU hogs at nice -10 share rank 1's core
    (trainer_plugins' hog): rank 1's steps take longer, all of it waiting for its core. Its host
    is named, once: oversubscribed, or contended where the 1-minute load average has not yet
    caught up with the hogs (on an idle host the watch names it a second or two after they
    start, long before a minute's average passes the cores); no rank is named a straggler.
    At nice -10, not nice 0: beside `stress-ng --cpu 2` and the cluster tier, nice-0 hogs (three,
    then six) left rank 0's core as crowded as rank 1's, the two ranks level, and nothing was
    named; favoured hogs make the scheduler move all other work to rank 0's core."""
    run, flags = straggler_run(tmp_path, "hog", backend="local", nodes=1, tasks=2, slow_rank=1, seconds=3)
    log0 = (run / "logs" / "rank-0.log").read_text()
    assert [(f["rank"], f["cause"]) for f in flags] == [(1, "host")], (flags, log0[-2500:])
    assert flags[0]["wait_ms"] > 0 and flags[0]["cores"] == os.cpu_count(), flags
    said = [f"host {flags[0]['host']} is {state} (load " for state in ("oversubscribed", "contended")]
    assert any(line in log0 for line in said) and "is a straggler" not in log0, log0


@pytest.mark.slow
def test_on_straggler_exclude_on_the_local_backend_names_the_rank_and_says_once_why_it_stays(tmp_path: Path) -> None:
    """[slurm] on_straggler = "exclude" where every rank runs on one host: rank 1, slow in its
    compute from a chosen step, is named as without it, one line says why nothing is left out,
    and the run goes on to its end in one attempt (no stop, no decision but the finish). Its
    slowness is a slow device's (a sleep), not a busy-wait: beside `stress-ng --cpu 2` a
    busy-wait on 2 cores waits for a core as long as it spins, and the watch rightly named the
    oversubscribed host instead of the rank (a stressed pass failed so)."""
    run, flags = straggler_run(tmp_path, "device", backend="local", nodes=1, tasks=2, slow_rank=1,
                               settings=('slurm.on_straggler="exclude"',))
    named = [f for f in flags if f["cause"] != "host"]
    assert [(f["rank"], f["cause"]) for f in named][:1] == [(1, "compute")], flags
    log0 = (run / "logs" / "rank-0.log").read_text()
    why = (f'ddpjob: warning: slurm.on_straggler = "exclude": {named[0]["host"]} is not left out: the local '
           "backend runs every rank on this host, none other to run on (the straggler is only reported)")
    assert log0.count(why) == 1, log0[-3000:]
    assert [e["reason"] for e in decisions(read_events(run))] == ["finished"]
    status = run_cli("status", str(run), cwd=tmp_path).stdout
    assert "restarts    0" in status and "left out" not in status, status
