"""rank/rounds.py on a run dir written here: which of a torchrun's rounds are decided, by whom
(the rank that said nothing, a rank's own error), and what a later round of the same agent, or
a new torchrun of the run, is refused. The real torchrun cases are in
tests/ranks/test_api.py (a kill -9 restarted with its verdict, a user's bug run once)."""

from __future__ import annotations

from pathlib import Path

from ddpjob import config
from ddpjob.ledger.events import read as read_events, record
from ddpjob.node.cluster import ClusterEnv
from ddpjob.rank import rounds
from runlogs import stops

JOB = "torchrun-4242"


def env(round_: int, agent: int = 4242) -> ClusterEnv:
    return ClusterEnv(rank=0, world_size=2, local_world_size=2, job_id=JOB, restart_count=round_,
                      source="torchrun", agent_pid=agent, hostname="vm")


def started(run: Path, restart: int) -> None:
    record(run, "start", job_id=JOB, restart=restart, world_size=2, source="torchrun", resumed_step=None)


def test_a_round_ended_by_a_silent_rank_is_restarted_and_spends_a_failure(tmp_path: Path) -> None:
    started(tmp_path, 0)
    # rank 0 only saw its peer go; rank 1 said nothing (killed)
    record(tmp_path, "stop", reason="crash", rank=0, host="vm", job_id=JOB, restart=0, step=7,
           error="rank 0 on vm: DDP's gradient all-reduce failed; rank 1 (vm) did not answer",
           error_class="infrastructure")
    assert rounds.decide_unseen(config.JobConfig(), env(1), tmp_path) is None
    (crash,) = stops(read_events(tmp_path))
    assert (crash["verdict"], crash["action"], crash["requeued_by"], crash["failed_rank"]) == \
        ("infrastructure", "restart", "torchrun", 1), crash
    assert crash["line"].endswith("failure 1 of max_failures = 20"), crash
    # decided once: the same round is not decided again by a later round
    assert rounds.decide_unseen(config.JobConfig(), env(2), tmp_path) is None
    assert len(stops(read_events(tmp_path))) == 1


def test_a_users_bug_ends_this_round_and_every_later_round_of_the_agent_not_a_new_torchrun(tmp_path: Path) -> None:
    started(tmp_path, 0)
    record(tmp_path, "stop", reason="crash", rank=1, host="vm", job_id=JOB, restart=0, step=3,
           error="rank 1: your code raised ValueError: a bug at train.py:9", error_class="user",
           exception="ValueError", where="train.py:9")
    why = rounds.decide_unseen(config.JobConfig(), env(1), tmp_path)
    assert why is not None and why.startswith("round 0 of this torchrun was decided: not retried: rank 1's "
                                              "ValueError at train.py:9"), why
    (crash,) = stops(read_events(tmp_path))
    assert (crash["verdict"], crash["action"], crash["agent"]) == ("user", "end", 4242), crash
    # the same agent's next round: refused with the same verdict, nothing decided again
    assert rounds.decide_unseen(config.JobConfig(), env(2), tmp_path) == why
    # a new torchrun of the run (round 0, another agent): the bug fixed, it trains
    assert rounds.decide_unseen(config.JobConfig(), env(0, agent=5151), tmp_path) is None
    assert rounds.decide_unseen(config.JobConfig(), env(1, agent=5151), tmp_path) is None


def test_outside_torchrun_nothing_is_decided(tmp_path: Path) -> None:
    started(tmp_path, 0)
    slurm_env = ClusterEnv(rank=0, world_size=2, job_id="77", restart_count=1, source="slurm")
    assert rounds.decide_unseen(config.JobConfig(), slurm_env, tmp_path) is None
    assert stops(read_events(tmp_path)) == []
