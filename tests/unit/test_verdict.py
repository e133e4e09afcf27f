"""ddpjob verify's diagnosis (launch/verdict.py), its readers (launch/verifyfacts.py) and its
instruction to the ranks (rank/probe.py, rank/loopview.py), without processes: the facts of two
runs in, one line and a cause class out."""

from __future__ import annotations

import math
import random
import sys

import pytest

from ddpjob import probeplan
from ddpjob.errors import DDPJobError
from ddpjob.launch import verdict, verifyfacts
from ddpjob.launch.verdict import Facts, Twin, diagnose
from ddpjob.rank import loopview, probe

REF = {s: {"loss": 3.0 - s / 10, "lr": 0.5} for s in range(1, 21)}


def _diverged(at: int, scale: float = 1.01, name: str = "loss") -> dict[int, dict[str, float | str]]:
    return {s: {**v, name: v[name] * (scale if s >= at else 1.0)} for s, v in REF.items()}


def _views(**at_steps: dict[str, tuple[str, str, str]]) -> dict[int, dict[int, dict[str, tuple[str, str, str]]]]:
    """rank 0's view: {"s8": {...}} -> step 8."""
    return {0: {int(k[1:]): v for k, v in at_steps.items()}}


def test_equal_runs_are_exact() -> None:
    v = diagnose(Facts(at=8, resumed=10, ref=REF, got=dict(REF)))
    assert v.ok and v.line.startswith("exact (20 losses, every logged value")


def test_a_logged_value_differing_before_the_loss_names_the_value() -> None:
    got = _diverged(11, 4.0, "lr")
    v = diagnose(Facts(at=8, resumed=10, ref=REF, got=got))
    assert v.cause == "outside-value", v.line
    assert v.line.startswith("`lr` differs from step 11 (0.5 vs 2), the first step after the resume at step 10 "
                             "where a logged value differs: a value the loop changes that is not in `state`")


def test_a_logged_clock_that_differs_before_the_resume_is_noise() -> None:
    ref = {s: {**v, "step_s": 0.1 * s} for s, v in REF.items()}
    got = {s: {**v, "step_s": 0.2 * s} for s, v in REF.items()}
    f = Facts(at=8, resumed=10, ref=ref, got=got)
    assert verdict.noise(f) == {"step_s"} and not verdict.needs_twin(f)
    assert diagnose(f).ok and verdict.close(f, (0.0, "")).ok
    late = {20: {**ref[20], "eval_s": 0.2}}  # a clock's value logged only after the resume: by its name
    f = Facts(at=8, resumed=10, ref={**ref, **late}, got={**got, 20: {**got[20], "eval_s": 0.3}})
    assert "eval_s" in verdict.noise(f) and diagnose(f).ok


def test_a_difference_in_a_replayed_step_is_after_the_resume_never_nondeterminism() -> None:
    """kill resumes from an older snapshot (step 6) and replays steps 7..8: step 7 is after it."""
    f = Facts(at=8, resumed=6, ref=REF, got=_diverged(7), ref_views=_views(s6={"X": ("tensor:int", "a", "")}),
              got_views=_views(s6={"X": ("tensor:int", "b", "")}))
    assert not verdict.needs_twin(f)
    v = diagnose(f)
    assert v.cause == "prefetch" and "`X`, a tensor held from before the step, differs at the start of step 7" in v.line


def test_a_difference_before_the_resume_is_nondeterminism_only_when_a_second_run_differs() -> None:
    f = Facts(at=8, resumed=10, ref=REF, got=_diverged(3))
    assert verdict.needs_twin(f)
    f.twin = Twin(None)
    assert diagnose(f).cause == "before-resume"
    f.twin = Twin(3, ["rng"])
    v = diagnose(f)
    assert v.cause == "nondeterministic" and "a second uninterrupted run differs from the first from step 3" in v.line
    assert "the generator `rng` differs between them from their start: an unseeded generator" in v.line
    f.twin = Twin(3)
    assert "on CPU with deterministic kernels the arithmetic cannot differ" in diagnose(f).line


def test_only_the_arithmetic_only_where_it_can_differ() -> None:
    f = Facts(at=8, resumed=10, ref=REF, got=_diverged(12, 1 + 1e-7))
    assert diagnose(f).cause == "unseen"
    f.arithmetic = True
    assert diagnose(f).cause == "arithmetic" and "only the arithmetic" in diagnose(f).line


@pytest.mark.parametrize("kind, shown, cause, words", [
    ("generator", "", "outside-generator", "the generator `g`, not in `state`, differs at the start of step 11"),
    ("optimizer", "AdamW", "outside-optimizer", "`g` (AdamW), not in `state`, differs at the start of step 11"),
    ("scaler", "GradScaler", "outside-scaler", "a GradScaler outside `state` starts again at its initial scale"),
    ("tensor:int", "", "prefetch", "a batch drawn before the loop or prefetched"),
    ("number", "7.5", "outside-value", "`g` (30 vs 7.5) differs at the start of step 11"),
])
def test_what_the_loop_holds_outside_state_is_named_by_its_kind(kind: str, shown: str, cause: str, words: str) -> None:
    got = _diverged(12)
    f = Facts(at=8, resumed=10, ref=REF, got=got, ref_views=_views(s10={"g": (kind, "a", "30" if shown == "7.5" else shown)}),
              got_views=_views(s10={"g": (kind, "b", shown)}))
    v = diagnose(f)
    assert v.cause == cause and words in v.line, v.line


def test_a_zeroed_carried_tensor_is_a_reinitialised_hidden_state() -> None:
    f = Facts(at=8, resumed=10, ref=REF, got=_diverged(11), ref_views=_views(s10={"hidden": ("tensor:float", "a", "")}),
              got_views=_views(s10={"hidden": ("tensor:zeros", "b", "")}))
    v = diagnose(f)
    assert v.cause == "carried" and "an RNN hidden state) re-initialised at the resume" in v.line


def test_numbers_that_differ_before_the_resume_and_the_resumed_step_are_not_culprits() -> None:
    views = {s: {"t0": ("number", f"t{s}", "1.5"), "start": ("number", "z", "0")} for s in range(0, 12)}
    mine = {s: {**v, "t0": ("number", f"u{s}", "2.5"), "start": ("number", "r", "10")} for s, v in views.items()}
    f = Facts(at=8, resumed=10, ref=REF, got=_diverged(12), ref_views={0: views}, got_views={0: mine})
    assert diagnose(f).cause == "unseen"


def test_a_batch_equal_to_an_earlier_one_is_data_restarting() -> None:
    ref = {s: {"x": ("tensor:int", f"b{s}", ""), "h": ("tensor:float", f"h{s}", "")} for s in range(1, 14)}
    got = {**ref, 11: {"x": ("tensor:int", "b1", ""), "h": ("tensor:float", "other", "")}}
    v = diagnose(Facts(at=8, resumed=10, ref=REF, got=_diverged(11), ref_views={0: ref}, got_views={0: got}))
    assert v.cause == "data-order" and "the batch of step 11 (`x`) is the uninterrupted run's batch of step 1" in v.line


def test_a_rank_holding_rank_0s_object_names_per_rank_state() -> None:
    f = Facts(at=8, resumed=10, ref=REF, got=_diverged(11))
    verdict.digest_facts(f, {0: {"state": {"gen": "a", "model": "m"}}, 1: {"state": {"gen": "b", "model": "m"}}},
                         {0: {"state": {"gen": "c", "model": "x"}}, 1: {"state": {"gen": "c", "model": "x"}}})
    assert f.copied == [("gen", 1)]
    v = diagnose(f)
    assert v.cause == "per-rank" and "rank 1's `gen` equals rank 0's after the resume at step 10" in v.line


def test_a_perrank_value_is_not_an_rng_stream() -> None:
    f = Facts(at=8, resumed=10, ref=REF, got=_diverged(11))
    verdict.split_files({"rank-1.pt: per_rank.offsets.state": 1.0, "rank-0.pt: torch": 1.0,
                         "optimizer.pt: state.0.exp_avg": 0.5}, f)
    assert f.per_rank_values == [("offsets", 1)] and f.rng_ranks == {0: "torch"}
    assert list(f.state_files) == ["optimizer.pt: state.0.exp_avg"]
    assert diagnose(f).cause == "per-rank-value"
    f.per_rank_values = []
    assert diagnose(f).cause == "rng"


def test_equal_values_with_a_differing_state_file() -> None:
    v = diagnose(Facts(at=8, resumed=10, ref=REF, got=dict(REF), state_files={"scheduler.pt: last_epoch": math.inf}))
    assert v.cause == "state" and "`scheduler`" in v.line


def test_differing_values_are_shown_with_the_digits_that_differ() -> None:
    assert verdict.shown(6.794130802154541, 6.794130325317383) == "6.7941308 vs 6.7941303"
    assert verdict.shown(0.5, 2.0) == "0.5 vs 2"


@pytest.mark.parametrize("scale, ok", [(1.01, True), (1.2, False)])
def test_another_world_size_is_close_by_the_losses_and_reports_the_parameters(scale: float, ok: bool) -> None:
    v = verdict.close(Facts(at=8, resumed=10, ref=REF, got=_diverged(11, scale)), (0.07, "head.weight"))
    assert v.ok is ok and v.line.startswith("close:" if ok else "not close:")
    assert "final parameters 7.00% apart (most in head.weight)" in v.line


def test_another_world_size_names_a_logged_value_that_is_not_close() -> None:
    v = verdict.close(Facts(at=8, resumed=10, ref=REF, got=_diverged(11, 4.0, "lr")), (0.0, ""))
    assert v.cause == "world-size" and "`lr` differs from step 11 (0.5 vs 2), a value the uninterrupted run never " \
        "had: the loop computes it from the world size" in v.line
    annealed = {s: {**v, "lr": 2.0 if s < 5 else 0.5} for s, v in REF.items()}  # restarted at its first value
    restarted = {s: {**v, "lr": 2.0 if s < 5 or s >= 11 else 0.5} for s, v in REF.items()}
    v = verdict.close(Facts(at=8, resumed=10, ref=annealed, got=restarted), (0.0, ""))
    assert v.cause == "outside-value" and "a value the loop changes that is not in `state`" in v.line


def test_scalars_keep_each_names_newest_record(tmp_path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "restart": 0, "loss": 2.0}\n'
                                            '{"step": 2, "restart": 0, "loss": 1.5, "lr": 0.1}\n'
                                            '{"step": 2, "restart": 0, "eval_loss": 9.0}\n'
                                            '{"step": 2, "restart": 1, "loss": 1.25}\nnot json\n')
    assert verifyfacts.losses(tmp_path) == {1: 2.0, 2: 1.25}
    assert verifyfacts.scalars(tmp_path)[2] == {"loss": 1.25, "lr": 0.1, "eval_loss": 9.0}


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


def test_a_perrank_value_is_digested_by_its_content() -> None:
    import torch

    import ddpjob

    one, two = ddpjob.PerRank(torch.Generator().manual_seed(1)), ddpjob.PerRank(torch.Generator().manual_seed(1))
    assert probe.digest(probe._content(one)) == probe.digest(probe._content(two))
    two.obj.manual_seed(2)
    assert probe.digest(probe._content(one)) != probe.digest(probe._content(two))


def test_the_loop_view_sees_what_the_loop_holds_outside_state() -> None:
    import torch

    model = torch.nn.Linear(2, 2)
    opt, lost = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.2)
    gen, batch, hidden, lr = torch.Generator().manual_seed(3), torch.arange(4), torch.zeros(2), 0.25
    rng, logged, out = random.Random(1), {"loss": 1.0}, model(torch.ones(2))
    seen = loopview.view(sys._getframe(), loopview.inside_ids({"model": model, "optimizer": opt}), {})
    assert seen["gen"][::2] == ("generator", "torch.Generator") and seen["rng"][::2] == ("generator", "random.Random")
    assert seen["lost"][:1] == ("optimizer",) and seen["lost"][2] == "SGD"
    assert seen["batch"][0] == "tensor:int" and seen["hidden"][0] == "tensor:zeros"
    assert seen["lr"] == ("number", loopview.digest(0.25), "0.25")
    assert not {"model", "opt", "logged", "out", "torch"} & set(seen)
    del gen, batch, hidden, lr, rng, logged, out
