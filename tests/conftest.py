"""Shared pytest plumbing: the test tiers, and the real SLURM test cluster for tests marked `cluster`.

The tiers (README "Tests"): tests/unit runs in-process (the default `pytest`), tests/ranks starts
real processes (ranks, `ddpjob run`, the local backend, torchrun), tests/cluster submits to real
SLURM. A `cluster` test outside tests/cluster, or one in it without the marker, is a collection
error: the marker is what makes CI fail on a skip, and the folder is what a tier run selects.

`slurm_cluster` (session) checks that tests/cluster/start.sh's cluster answers; tests marked
`cluster` get it automatically. Without the cluster they skip, except under CI=true, where a
missing cluster fails them and any skipped `cluster` test is reported as a failure, so CI can
never go green without having really run against SLURM.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import slurmtools

if TYPE_CHECKING:
    from fake_slurm import FakeSlurm

ON_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
NODES = ("n1", "n2")
USABLE = ("idle", "mixed", "allocated", "completing")
START_HINT = "start it with: sudo bash tests/cluster/start.sh"


@dataclass(frozen=True)
class SlurmCluster:
    """What tests may rely on about the test cluster."""

    nodes: tuple[str, ...] = NODES
    cpus_per_node: int = 2
    default_partition: str = "low"   # preemptible, jobs with --requeue are requeued
    high_partition: str = "high"     # preempts `low`


def _cmd(args: list[str], timeout: float = 20) -> tuple[int, str]:
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return 127, f"{args[0]} is not installed"
    except subprocess.TimeoutExpired:
        return 124, f"{' '.join(args)} did not answer within {timeout:.0f} s"
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def _node_states() -> tuple[dict[str, str], str]:
    rc, out = _cmd(["sinfo", "-h", "-N", "-o", "%N %T"])
    if rc != 0:
        return {}, f"sinfo failed: {out}"
    return dict(line.split(None, 1) for line in out.splitlines() if " " in line), ""


def _cluster_problem() -> str | None:
    """None when n1 and n2 are usable and sacct answers; otherwise what is wrong."""
    states, err = _node_states()
    if err:
        return err
    if any(n not in states for n in NODES):
        return f"sinfo shows nodes {sorted(states)}, expected {list(NODES)}"
    # Nodes left down/drained by an earlier crash (a slurmd killed mid-test) come back with
    # `resume` once their slurmd answers; give them a moment.
    deadline = time.monotonic() + 30
    resumed = restarted = False
    while any(states.get(n) not in USABLE for n in NODES):
        if not restarted and any(states.get(n, "").endswith("*") for n in NODES):
            # Not responding: its slurmd is gone. slurm-wlm 22.05's slurmd dumped core once, here,
            # launching a requeued job's step ("reissued job credential", 2026-11-28): SLURM's
            # bug, not ddpjob's, and no reason to fail every test after it. start.sh starts only
            # the daemons that are not running; the first test after the crash says so.
            restarted = True
            rc, out = _cmd(["bash", str(Path(__file__).parent / "cluster" / "start.sh")], timeout=180)
            print(f"[cluster] a node was not responding ({states}): start.sh exited {rc}: {out[-300:]}", flush=True)
            deadline = time.monotonic() + 60
        if not resumed:
            bad = [n for n in NODES if states.get(n, "").rstrip("*~#!%$@^-+")
                   in ("down", "drained", "draining", "drain")]
            for n in bad:
                _cmd(["scontrol", "update", f"nodename={n}", "state=resume"])
            resumed = bool(bad)
        if time.monotonic() > deadline:
            return f"nodes not usable: {states} (expected each of {USABLE})"
        time.sleep(1)
        states, err = _node_states()
        if err:
            return err
    rc, out = _cmd(["sacct", "-n", "-X", "-S", "now"])
    if rc != 0:
        return f"sacct failed (accounting is needed): {out}"
    return None


TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "ranks", "cluster")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test sits in its tier's folder: `cluster` tests, and only they, in tests/cluster."""
    wrong = []
    for item in items:
        try:
            tier = item.path.resolve().relative_to(TESTS).parts[0]
        except ValueError:
            continue
        if tier not in TIERS:
            continue  # test_conftest.py's throwaway copies of this file
        marked = item.get_closest_marker("cluster") is not None
        if marked != (tier == "cluster"):
            wrong.append(f"{item.nodeid} ({'marked' if marked else 'not marked'} `cluster`, in tests/{tier})")
    if wrong:
        raise pytest.UsageError("ddpjob: error: tests in the wrong tier: " + "; ".join(wrong)
                                + ". Hint: `cluster` tests go in tests/cluster, the others in tests/unit or tests/ranks")


@pytest.fixture
def fake_slurm(monkeypatch: pytest.MonkeyPatch) -> "FakeSlurm":
    """ddpjob's SLURM commands answered by a script (tests/fake_slurm.py), not by a cluster."""
    from fake_slurm import FakeSlurm

    from ddpjob import slurm
    from ddpjob.rank import requeue

    fake = FakeSlurm()
    monkeypatch.setattr(slurm, "runner", fake)
    monkeypatch.setattr(requeue, "sleep", lambda s: None)
    return fake


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    """The real SLURM test cluster; fails under CI=true, skips otherwise, when it is down."""
    problem = _cluster_problem()
    if problem:
        reason = f"SLURM test cluster unavailable: {problem}; {START_HINT}"
        if ON_CI:
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return SlurmCluster()


@pytest.fixture(autouse=True)
def _cluster_marker(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests marked `cluster` get the cluster check, and their leftover jobs are cancelled."""
    if request.node.get_closest_marker("cluster") is None:
        yield
        return
    request.getfixturevalue("slurm_cluster")
    first = len(slurmtools.submitted)
    yield
    # A test that failed half-way must not leave jobs that hold CPUs for the next test.
    for job_id in slurmtools.submitted[first:]:
        try:
            if slurmtools.active(job_id):
                slurmtools.cancel(job_id)
        except slurmtools.SlurmError:
            pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Under CI=true a skipped `cluster` test is a failure: CI must really exercise SLURM."""
    outcome = yield
    report = outcome.get_result()
    if (ON_CI and report.skipped and not hasattr(report, "wasxfail")
            and item.get_closest_marker("cluster") is not None):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = f"cluster test skipped under CI=true (a skip counts as a failure): {reason}"
    if report.when == "call" and report.failed and item.get_closest_marker("cluster") is not None:
        tmp = getattr(item, "funcargs", {}).get("tmp_path")
        if tmp is not None:
            report.sections.append(("what the failed test's runs left", _runs_left(tmp)))


def _runs_left(tmp: Path, lines: int = 12) -> str:
    """A failed cluster test's evidence, which CI's log otherwise loses with the temp dir: each
    run dir's last events and the tail of every log in it (the ranks' errors are there)."""
    out: list[str] = []
    for events in sorted(tmp.glob("**/events.jsonl"))[:4]:
        run = events.parent
        out.append(f"== {run}: events.jsonl (last {lines})")
        out += events.read_text(errors="replace").splitlines()[-lines:]
        for log in sorted((run / "logs").glob("*"))[:12] if (run / "logs").is_dir() else []:
            if log.is_file() and log.suffix in (".out", ".err", ".log"):
                tail = log.read_text(errors="replace").splitlines()[-lines:]
                if tail:
                    out.append(f"-- {log.name} (last {lines})")
                    out += tail
    return "\n".join(out) or f"no run dir under {tmp}"
