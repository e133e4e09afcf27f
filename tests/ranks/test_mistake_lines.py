"""The mistakes ddpjob can see in a user's loop, each said at the first point it can be seen and
before the first checkpoint is written, through 2 real ranks under `ddpjob run` (the script:
tests/mistakes_script.py; the pure checks: tests/unit/test_mistakes.py). And the per-rank way:
a `ddpjob.PerRank` generator resumes per rank, bit for bit, also after a [user] key listed in
train.user_free changed, and at another world size with its one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ranks import LAG, TESTS, Ranks, assert_bit_equal, write_job

SCRIPT = TESTS / "mistakes_script.py"


def _run(tmp_path: Path, name: str, world: int = 2, restart: int = 0, **user: Any) -> tuple[list[int], Ranks, Path]:
    job = write_job(tmp_path / f"{name}.toml", train={"entry": str(SCRIPT), "threads": 1, "user_free": ["steps", "stop_at"]},
                    checkpoint={"every_steps": 3, "keep_last": 5}, user={"steps": 6, "mistake": "", "stop_at": -1, **user})
    run = tmp_path / name
    ranks = Ranks([str(job), "--run-dir", str(run)], world, tmp_path / f"{name}-logs", job_id=name, restart=restart)
    return ranks.wait(240), ranks, run


def _said(ranks: Ranks, kind: str) -> list[tuple[int, str]]:
    """(index, line) of rank 0's `ddpjob: KIND:` lines and its "1 checkpoint(s)" marks."""
    lines = ranks.logs[0].read_text(errors="replace").splitlines()
    return [(i, ln) for i, ln in enumerate(lines) if ln.startswith(f"ddpjob: {kind}:")]


def _before_first_checkpoint(ranks: Ranks, line_at: int) -> None:
    lines = ranks.logs[0].read_text(errors="replace").splitlines()
    first = next((i for i, ln in enumerate(lines) if ln.endswith(": 1 checkpoint(s)")), len(lines))
    assert line_at < first, "\n".join(lines)


@pytest.mark.parametrize("mistake, user, said", [
    ("", {"leraning_rate": 0.5},
     "[user] 'leraning_rate' (did you mean 'learning_rate'?) was never read by the script before its first checkpoint"),
    ("scaler", {}, "an enabled GradScaler is not in state"),
    ("optimizer", {}, "an optimizer (AdamW) over the model's parameters is not in state"),
    ("shared_generator", {}, "state['offsets'] differs between the ranks (rank 1's is not rank 0's)"),
    ("twice", {}, "job.log(1, lr=...) writes a second train record for step 1"),
])
def test_a_mistake_is_one_warning_before_the_first_checkpoint(tmp_path: Path, mistake: str, user: dict,
                                                             said: str) -> None:
    codes, ranks, run = _run(tmp_path, "run", mistake=mistake, **user)
    assert codes == [0, 0], ranks.output()
    ((at, line),) = _said(ranks, "warning")
    assert line.startswith(f"ddpjob: warning: {said}") and " Hint: " in line, line
    _before_first_checkpoint(ranks, at)
    assert "warning" not in ranks.output(1)  # rank 0 says it, once


def test_a_raw_generator_in_state_is_refused_at_resume(tmp_path: Path) -> None:
    codes, ranks, run = _run(tmp_path, "run", mistake="raw_generator")
    assert codes == [1, 1], ranks.output()
    ((at, line),) = _said(ranks, "error")
    assert line.startswith("ddpjob: error: state['offsets'] is a torch.Generator, which a checkpoint cannot "
                           "hold as it is"), line
    assert "step 0:" not in ranks.output(0) and not list(run.glob("checkpoints/step-*"))


def test_a_collective_on_one_rank_only_is_named_not_a_gloo_abort(tmp_path: Path) -> None:
    """`if rank == 0: job.log(..., average=True)`: rank 1 goes on into DDP's gradient all-reduce
    of the next step. Gloo aborted rank 0 ("Received data size doesn't match expected size");
    now the average waits on its own group and the hang watch names the call and the ranks."""
    codes, ranks, run = _run(tmp_path, "run", mistake="master_log")
    assert codes[0] == 1 and codes[1] != 0, ranks.output()
    ((at, line),) = _said(ranks, "error")
    assert line.startswith("ddpjob: error: job.log()'s average at step 0 was called on rank 0 but not on every "
                           "rank (rank 1 (") and "went on to step 1 and waits in DDP's gradient all-reduce" in line, line
    assert "Received data size" not in ranks.output() and not list(run.glob("checkpoints/step-*"))


def _per_rank(run: Path, step: int, world: int) -> list[Any]:
    folder = run / "checkpoints" / f"step-{step:09d}"
    return [torch.load(folder / f"rank-{r}.pt", weights_only=True)["per_rank"]["offsets"] for r in range(world)]


def test_a_per_rank_generator_resumes_per_rank(tmp_path: Path) -> None:
    """Uninterrupted 6 steps against a run of 4 stopped after step 2 + lag, resumed with `steps = 6`
    (a [user] key in train.user_free, so the run dir takes it): each rank's own generator
    continues where that rank's stopped, and the model ends bit-equal. At 3 ranks, one line says
    the rule, and the new rank starts from its generator as built."""
    stopped = 2 + LAG
    codes, ranks, ref = _run(tmp_path, "ref")
    assert codes == [0, 0], ranks.output()
    codes, ranks, run = _run(tmp_path, "run", steps=4, stop_at=1)
    assert codes == [3, 3], ranks.output()
    codes, ranks, run = _run(tmp_path, "run", restart=1, steps=6)
    assert codes == [0, 0], ranks.output()
    assert f"resumed from step-{stopped:09d}" in ranks.output(0) and not _said(ranks, "warning"), ranks.output(0)
    mine, theirs = _per_rank(run, 6, 2), _per_rank(ref, 6, 2)
    assert_bit_equal(mine, theirs, "per-rank generators")
    assert not torch.equal(mine[0]["gen"], mine[1]["gen"])  # each rank's own
    assert_bit_equal(torch.load(run / "final" / "model.pt", weights_only=True),
                     torch.load(ref / "final" / "model.pt", weights_only=True), "model")

    codes, ranks, grown = _run(tmp_path, "grown", steps=4, stop_at=1)
    assert codes == [3, 3], ranks.output()
    codes, ranks, grown = _run(tmp_path, "grown", world=3, restart=1, steps=6)
    assert codes == [0, 0, 0], ranks.output()
    assert ("state['offsets'] (per rank) at 2 -> 3 ranks: ranks 0-1 take their own saved values, ranks 2-2 "
            "start from theirs as built") in ranks.output(0)
    fresh = torch.Generator().manual_seed(1002)  # rank 2's as built, then its own 6 - 3 steps x 2 draws
    for _ in range(2 * (6 - stopped)):
        torch.randint(0, 500, (1,), generator=fresh)
    assert torch.equal(_per_rank(grown, 6, 3)[2]["gen"], fresh.get_state())
    assert_bit_equal(_per_rank(grown, 6, 3)[:2], theirs, "ranks 0-1 at 3 ranks")
