"""What DDP, accumulation and SyncBN promise, checked numerically with real processes.

- K micro-batches of B (accumulation) == one batch of K*B, and 2 ranks x B == 1 rank x 2B: the
  same samples (the loader's order does not depend on the layout), the same mean gradient up to
  float32 summation order. Model without BatchNorm (per-batch statistics would differ).
- SyncBN over 2 ranks x B == plain BN on 1 rank x 2B: batch statistics over the global batch.
- Distributed eval (each rank a contiguous share, counts all-reduced) == one-process eval,
  exactly for the accuracy.

Tolerance: float32 sums in a different order differ by a few ulps per step (~1e-7 relative);
20 SGD steps with momentum amplify that to ~1e-6 on weights of size ~0.1. 2e-5 absolute is
10x above what we observe and still far below a real bug (a wrong scale of the gradient
moves weights by ~1e-2 in 20 steps at lr 0.05).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ddpjob import api, config
from ddpjob.train import data, models, trainer
from ranks import metrics, run, write_job
from test_trainer import fit_here

TOL = 2e-5
NOBN = dict(model="trainer_plugins:conv_nobn", max_steps=20, lr=0.05, warmup_steps=2, log_every=1,
            eval_every=0, amp="off", channels_last=False, seed=3, threads=1)
SYNCBN = {**NOBN, "model": "cnn_tiny", "max_steps": 5}
DATA = dict(dataset="synthetic", synthetic_train=1280, synthetic_test=509, augment=True)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "final" / "model.pt", weights_only=True)


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for _, r in sorted(metrics(run_dir).items())]


def test_accumulation_equals_the_big_batch(tmp_path: Path) -> None:
    fit_here(tmp_path / "acc", {**NOBN, "batch_size": 16, "accumulation_steps": 4}, DATA)
    fit_here(tmp_path / "big", {**NOBN, "batch_size": 64, "accumulation_steps": 1}, DATA)
    diff = _max_diff(_final(tmp_path / "acc"), _final(tmp_path / "big"))
    print(f"accumulation 4 x 16 vs batch 64: max |weight diff| {diff:.2e}")
    assert diff < TOL
    assert _losses(tmp_path / "acc") == pytest.approx(_losses(tmp_path / "big"), abs=1e-5)
    # and a real difference is visible at this tolerance: half the lr is not "equal"
    fit_here(tmp_path / "half", {**NOBN, "batch_size": 64, "lr": 0.025}, DATA)
    assert _max_diff(_final(tmp_path / "half"), _final(tmp_path / "big")) > 100 * TOL


def test_two_ranks_equal_one_rank_with_twice_the_batch(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.toml", train={**NOBN, "batch_size": 32}, data=DATA)
    codes, r = run([str(job), "--run-dir", str(tmp_path / "ddp")], 2, tmp_path / "logs")
    assert codes == [0, 0], r.output()
    fit_here(tmp_path / "one", {**NOBN, "batch_size": 64}, DATA)
    diff = _max_diff(_final(tmp_path / "ddp"), _final(tmp_path / "one"))
    print(f"2 ranks x 32 vs 1 rank x 64: max |weight diff| {diff:.2e}")
    assert diff < TOL
    assert _losses(tmp_path / "ddp") == pytest.approx(_losses(tmp_path / "one"), abs=1e-5)


@pytest.fixture(scope="module")
def syncbn_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("syncbn")
    train: dict[str, Any] = {**SYNCBN, "batch_size": 32, "sync_batchnorm": True}
    job = write_job(d / "job.toml", train=train, data=DATA)
    codes, r = run([str(job), "--run-dir", str(d / "run")], 2, d / "logs")
    assert codes == [0, 0], r.output()
    return d / "run"


def test_syncbn_statistics_equal_full_batch_bn(tmp_path: Path, syncbn_run: Path) -> None:
    """5 steps: a BN+max-pool net is chaotic in the last bits (observed: ~3e-7 after 5 steps,
    then a max-pool decision flips and the runs drift apart at ~1e-4 by step 20 - for any
    change of summation order, not only this one), so the statistics are compared early."""
    fit_here(tmp_path / "one", {**SYNCBN, "batch_size": 64}, DATA)
    a, b = _final(syncbn_run), _final(tmp_path / "one")
    stats = [k for k in a if "running_" in k]
    assert len(stats) == 8  # 4 BN layers x (mean, var)
    diff = _max_diff({k: a[k] for k in stats}, {k: b[k] for k in stats})
    print(f"SyncBN 2 x 32 vs BN 64: max |running stat diff| {diff:.2e}, all weights {_max_diff(a, b):.2e}")
    assert diff < TOL and _max_diff(a, b) < TOL
    counts = [k for k in a if k.endswith("num_batches_tracked")]
    assert all(int(a[k]) == int(b[k]) == SYNCBN["max_steps"] for k in counts)
    # Statistics of 32-sample batches (what unsynchronised ranks compute) are far off.
    fit_here(tmp_path / "per32", {**SYNCBN, "batch_size": 32, "accumulation_steps": 2}, DATA)
    c = _final(tmp_path / "per32")
    assert _max_diff({k: c[k] for k in stats}, {k: b[k] for k in stats}) > 100 * TOL


def test_distributed_eval_equals_one_process_eval_exactly(syncbn_run: Path) -> None:
    """509 test images: rank 0 evaluates 254, rank 1 255; the all-reduced count must equal
    what one process counts on the same weights, exactly."""
    final = SYNCBN["max_steps"]
    logged = metrics(syncbn_run, "eval")[final]["eval_acc"]
    model = models.build_model("cnn_tiny", 10)
    model.load_state_dict(_final(syncbn_run))
    _, test_set = data.build_datasets("synthetic", "", 3, 1280, 509)
    job = api.init(config.JobConfig(), run_dir=syncbn_run.parent / "eval-alone")
    try:
        acc, loss = trainer.evaluate(model, test_set, job, batch_size=256, amp_dtype=None, channels_last=False)
    finally:
        job.close()
    assert acc == logged
    assert acc == round(acc * 509) / 509  # a count over the whole set: no padding, no duplicates
    assert loss == pytest.approx(metrics(syncbn_run, "eval")[final]["eval_loss"], rel=1e-6)
