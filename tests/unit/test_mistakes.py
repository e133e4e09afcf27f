"""The lines for mistakes ddpjob can see in a user's loop, and the per-rank state, in-process:
the checks of rank/checks.py, job.user's record of reads, the second record of a kind for one
step, the collective-mismatch line (node/hang.py), `ddpjob.PerRank` (store/perrank.py), a raw
Generator refused at resume(), and [train] user_free with the keys named when a hash differs.
The same through real ranks: tests/ranks/test_mistake_lines.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import ddpjob
from ddpjob import config, rundir
from ddpjob.errors import DDPJobError, UsageError
from ddpjob.node import hang
from ddpjob.rank import checks
from ddpjob.rank.usertable import UserTable
from ddpjob.rank.records import MetricLog
from ddpjob.store import perrank
from ddpjob.store.statecheck import check_state
from mistakes_script import Offsets  # the user's own per-rank object of the ranks test


def test_user_keys_never_read_are_named_with_the_key_they_miss() -> None:
    table = UserTable({"leraning_rate": 0.1, "steps": 5, "note": "x"})
    assert table.get("learning_rate", 3e-4) == 3e-4 and table["steps"] == 5
    line = checks.unread_user_keys(dict.keys(table), table.read)
    assert line == ("[user] 'leraning_rate' (did you mean 'learning_rate'?), 'note' were never read by the "
                    "script before its first checkpoint: a typo trains at the script's default. Hint: correct "
                    "the name in the job file or drop it; a key used only later (after training): read it "
                    "before the loop")
    assert "note" in table and checks.unread_user_keys(["note"], table.read) is None  # `in` is a read


def test_a_whole_table_read_reads_every_key() -> None:
    table = UserTable({"a": 1, "b": 2})
    assert dict(**table) == {"a": 1, "b": 2}
    assert checks.unread_user_keys(dict.keys(table), table.read) is None
    with pytest.raises(KeyError, match="'c' is not in the job file's \\[user\\] table, which has: a, b"):
        UserTable({"a": 1, "b": 2})["c"]


def test_a_second_record_of_a_kind_for_one_step_is_said_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = MetricLog(tmp_path, restart=0)
    log.write(1, {"loss": 1.0})
    log.write(1, {"eval_loss": 2.0})  # an eval record beside the train one: fine
    assert capsys.readouterr().err == ""
    log.write(1, {"lr": 0.1})
    log.write(2, {"loss": 1.0})
    log.write(2, {"lr": 0.1})  # said once per run, at the first
    err = capsys.readouterr().err.splitlines()
    assert err == ["ddpjob: warning: job.log(1, lr=...) writes a second train record for step 1: `ddpjob plot` "
                   "and `status` expect one train record per step. Hint: log a step's values in one call, "
                   "job.log(step, loss=..., lr=...); name evaluation values eval_* (an eval record)"]


def test_an_own_object_that_differs_between_ranks_is_said() -> None:
    model = torch.nn.Linear(2, 2)
    ranks = [checks.own_digests({"model": model, "offsets": Offsets(1000 + r), "same": Offsets(7)})
             for r in range(2)]
    assert set(ranks[0]) == {"offsets", "same"}  # torch's objects are every rank's alike
    (line,) = checks.differing(ranks)
    assert line.startswith("state['offsets'] differs between the ranks (rank 1's is not rank 0's): a "
                           "checkpoint saves rank 0's and loads it into every rank")
    assert "Hint: a rank's own object (a generator seeded by rank): state['offsets'] = ddpjob.PerRank(obj)" in line


def test_an_enabled_grad_scaler_outside_state_is_said_at_resume() -> None:
    model = torch.nn.Linear(2, 2)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    said = [g for g in checks.state_gaps({"model": model}) if "GradScaler" in g]
    assert said == ["an enabled GradScaler is not in state: after a resume its scale starts again at its "
                    "initial value and the first steps are skipped as overflows again. Hint: add it, e.g. "
                    "state['scaler'] = scaler"]
    assert not [g for g in checks.state_gaps({"model": model, "scaler": scaler}) if "GradScaler" in g]
    scaler2 = torch.amp.GradScaler("cpu", enabled=False)  # bf16 / fp32 share the path: nothing to keep
    del scaler
    assert not [g for g in checks.state_gaps({"model": model}) if "GradScaler" in g], scaler2


def test_an_optimizer_over_the_models_parameters_outside_state_is_said_at_resume() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # another model's: not this one's
    said = [g for g in checks.state_gaps({"model": model}) if "optimizer" in g]
    assert said == ["an optimizer (AdamW) over the model's parameters is not in state: after a resume it starts "
                    "again without its moments and step counts. Hint: add it, e.g. state['optimizer'] = optimizer"]
    assert not [g for g in checks.state_gaps({"model": model, "optimizer": opt}) if "optimizer (" in g], other


def test_a_raw_generator_or_unsaveable_value_is_refused_at_resume() -> None:
    with pytest.raises(DDPJobError) as err:
        check_state({"model": torch.nn.Linear(2, 2), "offsets": torch.Generator()})
    assert err.value.line().startswith("ddpjob: error: state['offsets'] is a torch.Generator, which a "
                                       "checkpoint cannot hold as it is")
    assert "Hint: each rank's own generator: state['offsets'] = ddpjob.PerRank(generator)" in err.value.line()
    import numpy as np

    with pytest.raises(DDPJobError, match=r"checkpoint value state\['best'\] is a numpy.float64"):
        check_state({"best": np.float64(1.0)})
    check_state({"offsets": ddpjob.PerRank(torch.Generator()), "note": "fine", "n": [1, 2.0]})


def test_per_rank_values_ride_in_the_rank_file_and_come_back() -> None:
    gen, offsets = torch.Generator().manual_seed(1), Offsets(2)
    state = {"gen": ddpjob.PerRank(gen), "offsets": ddpjob.PerRank(offsets), "n": 3}
    saved = perrank.capture(state)
    assert set(saved[perrank.KEY]) == {"gen", "offsets"}
    expected = (torch.rand(3, generator=gen), torch.rand(3, generator=offsets.gen))
    assert perrank.restore(state, saved, where="step-1") == []
    assert torch.equal(torch.rand(3, generator=gen), expected[0])
    assert torch.equal(torch.rand(3, generator=offsets.gen), expected[1])
    # a rank the checkpoint has no file of (the job grew): it starts from its object as built
    assert perrank.restore(state, None, where="step-1") == ["gen", "offsets"]
    with pytest.raises(DDPJobError, match="ddpjob.PerRank\\(\\) got a int, expected a torch.Generator"):
        ddpjob.PerRank(3)


def test_the_rule_at_another_world_size_is_one_line() -> None:
    assert perrank.resize_line(["gen"], 2, 4) == ("state['gen'] (per rank) at 2 -> 4 ranks: ranks 0-1 take "
                                                 "their own saved values, ranks 2-3 start from theirs as built")
    assert perrank.resize_line(["gen"], 4, 1) == ("state['gen'] (per rank) at 4 -> 1 ranks: rank 0 takes its own "
                                                 "saved values, the saved values of ranks 1-3 are dropped")


def test_a_collective_one_rank_skipped_is_named_with_the_ranks() -> None:
    at = hang.Report(0, "n1", 5, "job.log()'s average", "train.py:40 in main", 12.0, False)
    ahead = hang.Report(1, "n2", 6, None, "train.py:33 in main", 11.0, True)
    err = hang.mismatch("job.log()'s average", 5, {0: at, 1: ahead}, {1: ahead})
    assert err.line() == (
        "ddpjob: error: job.log()'s average at step 5 was called on rank 0 but not on every rank (rank 1 (n2) "
        "went on to step 6 and waits in DDP's gradient all-reduce), expected every rank to make each collective "
        "call. Hint: a collective (job.log(..., average=...), job.all_reduce, job.finish) runs on every rank: "
        "move it out of `if rank == 0:` (job.log without average may stay inside).")


def _cfg(**user: object) -> config.JobConfig:
    return config.JobConfig(user=user)


def test_user_free_keys_leave_the_hash_and_an_unset_list_keeps_it() -> None:
    base = _cfg(max_iters=100, lr=0.1)
    assert base.identity() == json.loads(json.dumps(config._identity(base)))  # unchanged: pinned hashes hold
    free = dataclasses.replace(base, train=dataclasses.replace(base.train, user_free=("max_iters",)))
    longer = dataclasses.replace(free, user={"max_iters": 200, "lr": 0.1})
    assert free.hash() != base.hash()  # declared at submission: part of the run's identity
    assert longer.hash() == free.hash()
    assert dataclasses.replace(free, user={"max_iters": 100, "lr": 0.2}).hash() != free.hash()


def test_user_free_names_keys_of_the_user_table() -> None:
    from ddpjob import validate

    cfg = _cfg(max_iters=100)
    with pytest.raises(UsageError, match=r"train.user_free names \['max_iter'\], expected at most 100 keys of "
                                         r"the \[user\] table \(it has: max_iters\)"):
        validate.validate(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, user_free=("max_iter",))))


def test_another_job_in_a_run_dir_names_each_key_that_differs(tmp_path: Path) -> None:
    old = dataclasses.replace(_cfg(max_iters=100), train=dataclasses.replace(config.TrainConfig(), lr=0.1))
    rundir.prepare(tmp_path / "run", old)
    new = dataclasses.replace(_cfg(max_iters=200), train=dataclasses.replace(config.TrainConfig(), lr=0.2))
    with pytest.raises(UsageError) as err:
        rundir.check_reuse(tmp_path / "run", new)
    assert "holds another job (config hash" in err.value.line()
    assert ": train.lr 0.1 -> 0.2; user.max_iters 100 -> 200), expected the same" in err.value.line()
    assert "train.user_free" in err.value.line()


def _store(root: Path, cfg: config.JobConfig) -> object:
    from types import SimpleNamespace

    from ddpjob.node import dist
    from ddpjob.node.cluster import ClusterEnv
    from ddpjob.store.state import StateStore

    control = dist.Control(SimpleNamespace(initialized=False, timeout_s=300.0))  # type: ignore[arg-type]
    return StateStore(cfg, ClusterEnv(), root, control=control, restart=0)


def test_a_checkpoint_of_another_config_names_each_key_that_differs(tmp_path: Path) -> None:
    old = _cfg(max_iters=100)
    state = {"model": torch.nn.Linear(2, 2), "gen": ddpjob.PerRank(torch.Generator().manual_seed(3))}
    _store(tmp_path, old).save(1, state, blocking=True)  # type: ignore[attr-defined]
    new = dataclasses.replace(old, train=dataclasses.replace(old.train, lr=0.2))
    with pytest.raises(DDPJobError) as err:
        _store(tmp_path, new).resume(state, enabled=True, seed=0)  # type: ignore[attr-defined]
    assert (f"step-000000001: checkpoint was written by a different job config (config hash '{old.hash()}', "
            f"this job has '{new.hash()}'): train.lr 0.1 -> 0.2)") in err.value.line(), err.value.line()
    # the same config resumes it, with the generator's per-rank state
    expected = torch.Generator().manual_seed(3).get_state()
    state["gen"].obj.manual_seed(9)
    assert _store(tmp_path, old).resume(state, enabled=True, seed=0) == 1  # type: ignore[attr-defined]
    assert torch.equal(state["gen"].obj.get_state(), expected)


class _Store:
    """A TCPStore's four requests over a dict, shared by the watches of one test."""

    def __init__(self) -> None:
        self.d: dict[str, object] = {}

    def set(self, key: str, value: str) -> None:
        self.d[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.d[key]  # type: ignore[return-value]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.d for k in keys)

    def add(self, key: str, n: int) -> int:
        self.d[key] = int(self.d.get(key, 0)) + n  # type: ignore[call-overload]
        return int(self.d[key])  # type: ignore[call-overload]


def _watch(store: _Store, rank: int, step: int, inside: str | None, waited_s: float) -> hang.Watch:
    from types import SimpleNamespace

    w = object.__new__(hang.Watch)
    w.rank, w.world_size, w.host, w._main, w._store = rank, 2, f"n{rank + 1}", None, store
    w.steps, w.inside, w.since = SimpleNamespace(current_step=step), inside, hang.time.monotonic() - waited_s
    w._prefix = "ddpjob/hang/0/"
    w._alarm_key, w._peek_key, w._answered, w._asked = w._key("alarm"), w._key("peek"), 0, -1.0
    return w


@pytest.mark.parametrize("peer_step, named", [(6, True), (5, False)])
def test_a_rank_past_the_call_is_named_by_the_rank_waiting_in_it(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  peer_step: int, named: bool) -> None:
    """The peek protocol in-process: rank 0 has waited in job.log's average at step 5 for 12 s;
    rank 1 waits at step 6 (it went past the call: named, the alarm set, exit 1) or at step 5
    (a slow peer: nothing said). Rank 1's watch answers during rank 0's wait (its poll)."""
    store = _Store()
    asker = _watch(store, 0, 5, "job.log()'s average", 12.0)
    peer = _watch(store, 1, peer_step, None, 3.0)
    monkeypatch.setattr(hang.time, "sleep", lambda s: peer._peek())
    monkeypatch.setattr(hang.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    if named:
        with pytest.raises(SystemExit, match="1"):
            asker._peek()
        assert capsys.readouterr().err.startswith(
            "ddpjob: error: job.log()'s average at step 5 was called on rank 0 but not on every rank "
            "(rank 1 (n2) went on to step 6 (?)), expected every rank to make each collective call.")
        assert store.check([asker._alarm_key])
    else:
        asker._peek()
        assert capsys.readouterr().err == "" and not store.check([asker._alarm_key])
    asker._peek()  # asked once per collective entered: no second round
    assert store.add(asker._peek_key, 0) == 1
