"""ddpjob verify's diagnosis (launch/verdict.py) and its instruction to the ranks (rank/probe.py),
without processes: the facts of two runs in, one line and a cause class out."""

from __future__ import annotations

import math

import pytest

from ddpjob.errors import DDPJobError
from ddpjob.launch import verdict
from ddpjob.launch.verdict import Facts, diagnose
from ddpjob import probeplan
from ddpjob.rank import probe

REF = {s: 3.0 - s / 10 for s in range(1, 21)}


def _diverged(at: int, scale: float = 1.01) -> dict[int, float]:
    return {s: v * (scale if s >= at else 1.0) for s, v in REF.items()}


def test_equal_runs_are_exact() -> None:
    v = diagnose(Facts(at=8, losses=REF, got=dict(REF)))
    assert v.ok and v.line.startswith("exact (20 losses")


def test_losses_differing_with_equal_rng_files_name_a_prefetch() -> None:
    f = Facts(at=8, losses=REF, got=_diverged(11), state_files={"model.pt: module.head.weight": 0.1})
    v = diagnose(f)
    assert not v.ok and v.cause == "data"
    assert "losses differ from step 11" in v.line and "10 of 20" in v.line
    assert "a batch made before `resume()`, or a prefetch" in v.line
    assert "state keys `model` differ (first: model.pt: module.head.weight)" in v.line


def test_a_tiny_first_difference_is_only_the_arithmetic() -> None:
    v = diagnose(Facts(at=8, losses=REF, got=_diverged(12, 1 + 1e-7)))
    assert v.cause == "arithmetic" and "only the arithmetic" in v.line


def test_a_difference_before_the_interruption_is_nondeterminism() -> None:
    v = diagnose(Facts(at=8, losses=REF, got=_diverged(3)))
    assert v.cause == "nondeterministic" and "before the interruption at step 8" in v.line


def test_a_rank_holding_rank_0s_object_names_per_rank_state() -> None:
    f = Facts(at=8, losses=REF, got=_diverged(9))
    verdict.digest_facts(f, {0: {"state": {"gen": "a", "model": "m"}}, 1: {"state": {"gen": "b", "model": "m"}}},
                         {0: {"state": {"gen": "c", "model": "x"}}, 1: {"state": {"gen": "c", "model": "x"}}})
    assert f.per_rank == ["gen"] and f.copied == [("gen", 1)]
    v = diagnose(f)
    assert v.cause == "per-rank" and "rank 1's `gen` equals rank 0's after the resume" in v.line


def test_a_generator_outside_state_that_differs_is_named() -> None:
    f = Facts(at=8, losses=REF, got=_diverged(9))
    verdict.digest_facts(f, {0: {"state": {}, "outside": {"gen": "a"}}}, {0: {"state": {}, "outside": {"gen": "b"}}})
    v = diagnose(f)
    assert v.cause == "outside-generator" and "`gen (rank 0)`" in v.line


def test_rng_files_go_to_the_rng_facts_and_name_the_rank() -> None:
    f = Facts(at=8, losses=REF, got=_diverged(9))
    verdict.split_files({"rank-1.pt: torch": 1.0, "optimizer.pt: state.0.exp_avg": 0.5}, f)
    assert f.rng_ranks == {1: "torch"} and list(f.state_files) == ["optimizer.pt: state.0.exp_avg"]
    v = diagnose(f)
    assert v.cause == "rng" and "rank 1's RNG file differs (torch)" in v.line


def test_equal_losses_with_a_differing_state_file() -> None:
    v = diagnose(Facts(at=8, losses=REF, got=dict(REF), state_files={"scheduler.pt: last_epoch": math.inf}))
    assert v.cause == "state" and "scheduler.pt" in v.line


@pytest.mark.parametrize("scale, distance, ok", [(1.01, 0.01, True), (1.2, 0.01, False), (1.0, 0.2, False)])
def test_another_world_size_is_close_within_the_tolerance(scale: float, distance: float, ok: bool) -> None:
    v = verdict.close(Facts(at=8, losses=REF, got=_diverged(9, scale)), (distance, "head.weight"))
    assert v.ok is ok and v.line.startswith("close:" if ok else "not close:")


def test_losses_keep_each_steps_newest_record(tmp_path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "restart": 0, "loss": 2.0}\n'
                                            '{"step": 2, "restart": 0, "loss": 1.5}\n'
                                            '{"step": 2, "restart": 0, "eval_loss": 9.0}\n'
                                            '{"step": 2, "restart": 1, "loss": 1.25}\nnot json\n')
    assert verdict.losses(tmp_path) == {1: 2.0, 2: 1.25}


def test_the_instruction_is_parsed_strictly() -> None:
    assert probeplan.parse("record") == probeplan.Instruction("record")
    assert probeplan.parse("kill@12:1") == probeplan.Instruction("kill", 12, 1)
    assert probeplan.Instruction("pause", 3, 0).text() == "pause@3:0"
    for bad in ("kill@12", "pause@x:0", "kill@12:1\n", "stop@3:0"):
        with pytest.raises(DDPJobError, match="DDPJOB_VERIFY"):
            probeplan.parse(bad)


def test_digests_follow_contents_not_identity() -> None:
    import torch

    a = {"w": torch.ones(3), "n": 2, "g": torch.Generator().manual_seed(1).get_state()}
    b = {"n": 2, "w": torch.ones(3), "g": torch.Generator().manual_seed(1).get_state()}
    assert probe.digest(a) == probe.digest(b) != probe.digest({**a, "w": torch.zeros(3)})
    assert probe.digest(torch.tensor(1.0)) != probe.digest(torch.tensor(1))
