"""`job.wrap` leaves the user's model picklable (issue 46): 2 real ranks under `ddpjob run`,
the straggler watch on (its hooks ran at every step), then `torch.save` and `copy.deepcopy` of
what job.wrap returned and of the user's own module (tests/wrap_script.py)."""

from __future__ import annotations

from pathlib import Path

from ranks import TESTS, Ranks, write_job


def test_torch_save_and_deepcopy_work_after_job_wrap_on_every_rank(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.toml", train={"entry": str(TESTS / "wrap_script.py"), "threads": 1,
                                                  "straggler_window": 2})
    ranks = Ranks([str(job), "--run-dir", str(tmp_path / "run")], 2, tmp_path / "logs", job_id="pickle")
    codes = ranks.wait(180)
    out = ranks.output()
    assert codes == [0, 0], out
    for rank in (0, 1):
        assert (f"rank {rank}: torch.save(model) and copy.deepcopy(model) work, same output True, hooks 0"
                in out), out
        assert (f"rank {rank}: torch.save(model.module) and copy.deepcopy(model.module) work, same output True, "
                "hooks 0, ddpjob in the pickle False" in out), out
