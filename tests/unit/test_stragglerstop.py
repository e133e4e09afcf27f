"""Acting on a named straggler ([slurm] on_straggler, rank/stragglerstop.py): the config's values,
the one policy's verdict, at most one action per straggler_exclude_every steps, rank 0's stop
request (and, where it cannot act, the one line why), its decision record, the batch shell's
restart without the host (rank/requeue.main, restart_layout), the requeue through SLURM with the
host excluded, the budgets it leaves alone and what `status` says."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpjob import config, exitcodes, fileio, jobfile
from ddpjob.errors import UsageError
from ddpjob.launch import summary
from ddpjob.ledger import budget, policy, stragglers
from ddpjob.ledger.events import read as read_events
from runlogs import decisions as decided
from ddpjob.node import preemption
from ddpjob.node.cluster import ClusterEnv
from ddpjob.rank import requeue, stragglerstop
from ddpjob.rank.straggler import Flag

ENV = ClusterEnv(source="slurm", job_id="77", restart_count=0, hosts=("n1", "n2"), num_nodes=2)
SLOW = Flag(1, "n1", "compute", 0.180, 0.060, 0.001, 21, 40)
LINE = "rank 1 on n1 is a straggler (compute, 180.0 ms of work a step against 60.0 ms)"


def run_dir(tmp_path: Path, **slurm_keys) -> tuple[config.JobConfig, Path]:
    keys = {"nodes": 1, "tasks_per_node": 2, "spare_nodes": 1, "on_node_loss": "continue",
            "on_straggler": "exclude", **slurm_keys}
    cfg = jobfile.from_dict({"name": "t", "slurm": keys})
    fileio.write_text_atomic(tmp_path / "config.json", cfg.to_json())
    fileio.write_text_atomic(tmp_path / "job.sbatch", "#!/bin/bash\n")
    fileio.write_json_atomic(tmp_path / "job.json", {"backend": "slurm", "job_id": "77"})
    (tmp_path / "logs").mkdir()
    return cfg, tmp_path


def decisions(d: Path) -> list[dict]:
    return decided(read_events(d))


@pytest.mark.parametrize("key, value, said", [
    ("on_straggler", "sometimes", "slurm.on_straggler is 'sometimes', expected off, exclude or requeue. Hint: "),
    ("straggler_exclude_every", 0, "slurm.straggler_exclude_every is 0, expected a positive integer (>= 1)"),
])
def test_the_settings_are_checked_with_one_line(key, value, said) -> None:
    assert jobfile.from_dict({"name": "t"}).slurm.on_straggler == "off"  # off by default
    with pytest.raises(UsageError) as err:
        jobfile.from_dict({"name": "t", "slurm": {key: value}})
    assert said in str(err.value), str(err.value)


def test_the_policy_restarts_in_place_without_the_host_or_requeues_without_it() -> None:
    limits = policy.Limits(max_requeues=2)
    facts = policy.Facts("straggler", what=LINE, leave_out="n1", resume_at=40, here=True)
    v = policy.decide(facts, limits)
    assert (v.action, v.line) == (policy.RESTART, f"{LINE}: restarting in place without n1 from the checkpoint of step 40")
    away = policy.Facts("straggler", what=LINE, leave_out="n1", resume_at=40, requeues=1)
    assert policy.decide(away, limits).line.endswith("requeueing without n1 from the checkpoint of step 40 "
                                                     "(requeue 2 of max_requeues = 2)")
    assert policy.decide(policy.Facts("straggler", what=LINE, requeues=2), limits).action == policy.END
    asked = policy.Facts("straggler", what=LINE, leave_out="n1", here=True, stop_requested=True)
    assert policy.decide(asked, limits).action == policy.END  # `ddpjob stop` asked first


def test_at_most_one_action_per_interval_of_the_runs_progress() -> None:
    evs = [{"event": "stop", "reason": "straggler", "job_id": "77", "restart": 0, "step": 40,
            "excluded_host": "n1", "action": "restart"},
           {"event": "stop", "reason": "straggler", "job_id": "77", "restart": 1, "step": 60, "rank": 0}]
    assert stragglers.blocked(evs, 139, 100) == 40 and stragglers.blocked(evs, 140, 100) is None
    assert stragglers.excluded(evs) == ["n1"] and stragglers.excluded(evs, {"78"}) == []


def test_rank_0_stops_every_rank_for_a_straggler_with_a_spare_held(fake_slurm, tmp_path, monkeypatch) -> None:
    cfg, d = run_dir(tmp_path)
    monkeypatch.setenv("DDPJOB_ATTEMPT", "0")
    fake_slurm.answer("scontrol show job", "JobId=77 JobState=RUNNING NodeList=n[1-2]")
    stop = preemption.StopFlag()
    assert stragglerstop.consider(cfg, ENV, d, SLOW, stop)
    assert stop.code == preemption.STRAGGLER and stop.detail["host"] == "n1" and stop.detail["line"] == LINE
    assert stop.detail["srun_attempt"] == 0  # the batch shell's srun it ends
    # the weakest code: a time limit or a preemption at the same step decides instead
    assert preemption.STRAGGLER < min(preemption.DEADLINE, preemption.REQUEUE, preemption.PREEMPTED)
    # an oversubscribed host is never acted on: its ranks waited for a core
    host = Flag(1, "n1", "host", 0.18, 0.06, 0.0, 21, 40, load=9.0, cores=2)
    assert not stragglerstop.consider(cfg, ENV, d, host, preemption.StopFlag())


@pytest.mark.parametrize("env, keys, why", [
    (ClusterEnv(source="local", job_id="local-1"), {}, "the local backend runs every rank on this host"),
    (ENV, {"spare_nodes": 0}, "no node of the allocation would be left to run on, expected a spare"),
], ids=["local-backend", "no-spare-one-node"])
def test_where_nothing_can_be_left_out_the_straggler_is_only_reported_said_once(
        fake_slurm, tmp_path, monkeypatch, capsys, env, keys, why) -> None:
    cfg, d = run_dir(tmp_path, **keys)
    monkeypatch.setenv("DDPJOB_ATTEMPT", "0")
    monkeypatch.setattr(stragglerstop, "_said", set())
    fake_slurm.answer("scontrol show job", "JobId=77 JobState=RUNNING NodeList=n1")
    stop = preemption.StopFlag()
    assert not stragglerstop.consider(cfg, env, d, SLOW, stop)
    assert not stragglerstop.consider(cfg, env, d, SLOW, stop)
    err = capsys.readouterr().err
    assert stop.code == preemption.NONE and err.count(why) == 1, err
    assert err.startswith('ddpjob: warning: slurm.on_straggler = "exclude": n1 is not left out: '), err


def test_the_straggler_is_left_out_inside_the_allocation_spending_nothing(
        fake_slurm, tmp_path, monkeypatch, capsys) -> None:
    """Rank 0's decision after every rank stopped at step 40 with a checkpoint, then the batch
    shell (`python -m ddpjob.rank.requeue RUN STATUS`: 4, or 137 where srun --kill-on-bad-exit
    ended a rank in its teardown): srun again on the spare, n1 excluded, the world size kept;
    neither budget spent; a second straggler too soon after is only reported; and the next
    srun's end is a crash's to decide, not this stop's again."""
    cfg, d = run_dir(tmp_path)
    fake_slurm.answer("scontrol show job", "JobId=77 JobState=RUNNING Restarts=0 NodeList=n[1-2]")
    detail = {"host": "n1", "line": LINE, "straggler_rank": 1, "cause": "compute", "srun_attempt": 0}
    assert requeue.after_stop(cfg, ENV, d, preemption.STRAGGLER, 40, restart=0, detail=detail) is True
    stop = decisions(d)[-1]
    assert (stop["reason"], stop["excluded_host"], stop["requeued_by"], stop["action"]) == (
        "straggler", "n1", budget.IN_PLACE, policy.RESTART)
    assert stop["note"] == f"{LINE}: restarting in place without n1 from the checkpoint of step 40"
    assert budget.used(read_events(d), "77") == (0, 0)
    assert f"stopped at step 40 (straggler); checkpoint written; {LINE}" in capsys.readouterr().out
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.setenv("DDPJOB_ATTEMPT", "0")
    for status in (exitcodes.RESTART, 137):
        assert requeue.main([str(d), str(status)]) == exitcodes.RESTART
        out = capsys.readouterr()
        assert out.out.splitlines()[-1] == "1 n1", out.out  # one node (the spare), n1 excluded
        assert "excluding n1 (a straggler): the ranks restart on 1 node(s)" in out.err, out.err
    assert len(decisions(d)) == 1  # no crash was recorded: nothing was spent
    monkeypatch.setenv("DDPJOB_ATTEMPT", "1")
    assert not stragglerstop.consider(cfg, ENV, d, Flag(1, "n2", "compute", 0.18, 0.06, 0.0, 80, 100),
                                      preemption.StopFlag())
    assert ("the last straggler was left out at step 40, fewer than slurm.straggler_exclude_every = 1000 "
            "steps ago") in capsys.readouterr().err
    status = "\n".join(summary.summary(d))
    assert f"straggler   n1 left out at step 40 (job 77): {LINE}: restarting in place without n1" in status, status
    monkeypatch.setenv("DDPJOB_ATTEMPT", "0")
    assert requeue._straggler_stop(d, ClusterEnv.batch_shell()) is not None
    monkeypatch.setenv("DDPJOB_ATTEMPT", "1")  # the srun after it: its end is a crash's
    assert requeue._straggler_stop(d, ClusterEnv.batch_shell()) is None


def test_requeue_excludes_the_host_through_slurm(fake_slurm, tmp_path) -> None:
    cfg, d = run_dir(tmp_path, on_straggler="requeue", spare_nodes=0, on_node_loss="requeue")
    fake_slurm.answer("scontrol requeue").answer("scontrol update")
    detail = {"host": "n1", "line": LINE}
    assert requeue.after_stop(cfg, ENV, d, preemption.STRAGGLER, 40, detail=detail) is True
    assert fake_slurm.called("scontrol update") == [["scontrol", "update", "JobId=77", "ExcNodeList=n1"]]
    stop = decisions(d)[-1]
    assert (stop["reason"], stop["requeued_by"], stop["excluded_host"]) == ("straggler", "scontrol", "n1")
    assert stop["note"].endswith("(requeue 1 of max_requeues = 20): requeued job 77; job 77 excludes n1"), stop["note"]
    assert budget.used(read_events(d), "77") == (1, 0)  # a trip through the queue: a requeue, no failure
