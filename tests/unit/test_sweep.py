"""Sweeps: `--sweep KEY=V1,V2` -> the cartesian product, one run dir per point, sweep.json;
points run one after another on the local backend and as one job array on SLURM."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpjob import jobfile
from ddpjob.errors import UsageError
from ddpjob.launch import sweep as sweeps

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "jobs" / "smoke.toml")


def test_expand_is_the_cartesian_product_typed_like_set():
    pts = sweeps.expand_sweep(["train.lr=0.1,0.05", "train.batch_size=64,128", "train.amp=off"])
    assert [p.values for p in pts] == [
        {"train.lr": 0.1, "train.batch_size": 64, "train.amp": "off"},
        {"train.lr": 0.1, "train.batch_size": 128, "train.amp": "off"},
        {"train.lr": 0.05, "train.batch_size": 64, "train.amp": "off"},
        {"train.lr": 0.05, "train.batch_size": 128, "train.amp": "off"}]
    assert [p.id for p in pts] == ["0", "1", "2", "3"]
    assert pts[1].overrides == ("train.lr=0.1", "train.batch_size=128", "train.amp=off")
    assert sweeps.expand_sweep([]) == []


def test_values_with_commas_inside_lists_or_quotes_stay_whole():
    assert sweeps.split_values('[1, 2],"a,b",3') == ["[1, 2]", '"a,b"', "3"]
    pts = sweeps.expand_sweep(['slurm.setup=["a", "b"],"c,d"'])
    assert [p.values["slurm.setup"] for p in pts] == [["a", "b"], "c,d"]


def test_each_point_resolves_to_a_valid_config_and_bad_points_are_caught():
    for p in sweeps.expand_sweep(["train.lr=0.1,0.05"]):
        cfg = jobfile.resolve(SMOKE, list(p.overrides))
        assert cfg.train.lr == p.values["train.lr"]
    with pytest.raises(UsageError, match="given twice"):
        sweeps.expand_sweep(["train.lr=0.1", "train.lr=0.2"])
    with pytest.raises(UsageError, match="not section.key"):
        sweeps.expand_sweep(["lr=0.1,0.2"])
    with pytest.raises(UsageError, match="at most 1000"):
        sweeps.expand_sweep([f"train.seed={','.join(map(str, range(40)))}",
                             f"train.epochs={','.join(map(str, range(1, 40)))}"])
