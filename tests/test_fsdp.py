"""`[train] strategy = "fsdp"`: examples/charlm sharded with FSDP2, checkpoints through DCP.

Local ranks (tests/ranks.py); stops caused at a given step by tests/example_hooks.py, never by a
timer. Same world size: the resumed run equals the uninterrupted one bit for bit. 4 ranks -> 2:
every sample once per epoch, and the final loss within 1e-5 of the uninterrupted run at the
original world size (4 ranks) - with dropout 0: dropout masks come from each rank's own RNG, so
another rank count draws other masks and no tolerance would hold.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ranks import LAG, assert_bit_equal, events, metrics, run
from test_examples import CHARLM, CHARLM_SMALL, _hook_job, _samples_by_step

FSDP = {"strategy": "fsdp", "entry": "example_hooks:main", "args": [str(CHARLM / "train.py")]}


def charlm_fsdp_job(folder: Path, *, checkpoint: dict[str, Any] | None = None, **user: Any) -> Path:
    return _hook_job(folder / "charlm-fsdp.toml", CHARLM / "train.py", CHARLM / "job.toml",
                     user={**CHARLM_SMALL, "num_workers": 0, **user}, train=FSDP,
                     checkpoint={"every_steps": 5, **(checkpoint or {})})


def _losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in metrics(run_dir).items()}


def _stop_then_resume(folder: Path, job: Path, world: int, at: int, resume_world: int,
                      between: Any = None) -> tuple[Path, str]:
    """Stopped during step `at` on `world` ranks, resumed on `resume_world`; returns the run
    dir and the resumed rank 0's log."""
    out = folder / "interrupted"
    codes, r = run([str(job), "--run-dir", str(out)], world, folder / "logs", timeout=300,
                   extra_env={"DDPJOB_TEST_STOP_AT": str(at)})
    assert codes == [3] * world, r.output()
    stop = [e for e in events(out) if e["event"] == "stop"][0]
    assert stop["step"] == at + 1 + LAG, stop
    if between is not None:
        between(out)
    codes, r = run([str(out)], resume_world, folder / "logs", restart=1, timeout=300)
    assert codes == [0] * resume_world, r.output()
    assert (out / "COMPLETED").is_file() and (out / "final" / "model.pt").is_file()
    return out, r.output(0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fsdp_ref")
    codes, r = run([str(charlm_fsdp_job(d)), "--run-dir", str(d / "run")], 2, d / "logs", timeout=300)
    assert codes == [0, 0], r.output()
    assert "sample:" in r.output(0)
    return d / "run"


def _checkpoints(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "checkpoints").glob("step-*"))


def test_fsdp_checkpoint_holds_one_shard_per_rank_listed_in_the_manifest(reference: Path) -> None:
    import torch

    step = _checkpoints(reference)[-1]
    manifest = json.loads((step / "manifest.json").read_text())
    files = manifest["files"]
    assert sorted(files) == ["__0_0.distcp", "__1_0.distcp", "dcp.metadata", "rank-0.pt", "rank-1.pt",
                             "sampler.pt", "scheduler.pt"], files  # no model.pt, optimizer.pt
    assert sorted(p.name for p in step.iterdir()) == sorted([*files, "manifest.json"])
    assert manifest["sharded"] == ["model", "optimizer"] and manifest["world_size"] == 2
    assert all(len(e["sha256"]) == 64 and e["size"] == (step / n).stat().st_size for n, e in files.items())
    final = torch.load(reference / "final" / "model.pt", weights_only=True)  # whole, plain tensors
    assert type(final["head.weight"]) is torch.Tensor and final["embed.weight"].shape[1] == CHARLM_SMALL["hidden"]


def test_fsdp_interrupted_resumes_bit_exactly(tmp_path: Path, reference: Path) -> None:
    import torch

    out, log = _stop_then_resume(tmp_path, charlm_fsdp_job(tmp_path), 2, 6, 2)
    assert "resumed from step-000000008" in log
    assert_bit_equal(torch.load(reference / "final" / "model.pt"), torch.load(out / "final" / "model.pt"), "model")
    assert _losses(out) == _losses(reference) and len(_losses(out)) == CHARLM_SMALL["max_steps"]


def test_fsdp_damaged_shard_falls_back_to_the_previous_checkpoint(tmp_path: Path, reference: Path) -> None:
    import torch

    def damage(run_dir: Path) -> None:
        shard = _checkpoints(run_dir)[-1] / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size: only the sha256 can tell
        shard.write_bytes(bytes(data))

    out, log = _stop_then_resume(tmp_path, charlm_fsdp_job(tmp_path), 2, 6, 2, between=damage)
    assert "skipping step-8: __1_0.distcp sha256 mismatch (corrupted on disk)" in log
    assert "resumed from step-000000005" in log
    # the replayed steps 6..8 and the rest: still the uninterrupted run, bit for bit
    assert_bit_equal(torch.load(reference / "final" / "model.pt"), torch.load(out / "final" / "model.pt"), "model")
    assert _losses(out) == _losses(reference)


# ------------------------------------------------------------------ config and the metadata reader
@pytest.mark.parametrize("sets, found", [
    (["train.strategy=\"zero\""], "train.strategy is 'zero', expected one of ddp, fsdp"),
    (["train.strategy=\"fsdp\"", "train.sync_batchnorm=true"], "with train.sync_batchnorm"),
    (["train.strategy=\"fsdp\"", "train.compile=true"], "with train.compile"),
    (["train.strategy=\"fsdp\"", "train.amp=\"fp16\""], "with train.amp = \"fp16\""),
])
def test_config_refuses_what_fsdp_cannot_do_in_one_line(sets: list[str], found: str) -> None:
    from ddpjob import config
    from ddpjob.errors import UsageError
    from ranks import REPO

    with pytest.raises(UsageError) as err:
        config.resolve(REPO / "jobs" / "smoke.toml", sets)
    line = err.value.line()
    assert found in line and "Hint: " in line and "\n" not in line


def test_strategy_ddp_keeps_the_config_hash_fsdp_changes_it() -> None:
    """Runs started before the key existed still resume (ddp is the default); a run cannot
    switch strategy (its checkpoints are another layout)."""
    from ddpjob import config

    plain = config.from_dict({})
    assert config.from_dict({"train": {"strategy": "ddp"}}).hash() == plain.hash()
    assert config.from_dict({"train": {"strategy": "fsdp"}}).hash() != plain.hash()
    d = plain.to_dict()
    del d["train"]["strategy"]  # a config.json written by an older ddpjob
    assert config.from_dict(d).hash() == plain.hash()


def test_dcp_metadata_reader_builds_only_dcp_classes(tmp_path: Path) -> None:
    """DCP's .metadata is a pickle: ddpjob's reader refuses anything but DCP's own classes, and
    file names outside the checkpoint folder."""
    import os
    import pickle

    from ddpjob.errors import DDPJobError
    from ddpjob.store import sharded

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (tmp_path / sharded.METADATA).write_bytes(pickle.dumps(Evil()))
    with pytest.raises(DDPJobError, match="posix.system is not part of DCP's metadata|system is not part"):
        sharded.read_metadata(tmp_path)
    assert not (tmp_path / "pwned").exists()

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    md = Metadata({}, storage_data={MetadataIndex("x"): _StorageInfo("../../etc/passwd", 0, 1)})
    (tmp_path / sharded.METADATA).write_bytes(pickle.dumps(md))
    with pytest.raises(DDPJobError, match="names files outside its checkpoint"):
        sharded.read_metadata(tmp_path)
    md.storage_data = {MetadataIndex("x"): _StorageInfo("__0_0.distcp", 0, 1)}
    (tmp_path / sharded.METADATA).write_bytes(pickle.dumps(md))
    assert sharded.read_metadata(tmp_path).storage_data[MetadataIndex("x")].relative_path == "__0_0.distcp"


def test_fsdp_init_from_takes_the_final_weights_and_refuses_a_sharded_checkpoint(
        tmp_path: Path, reference: Path) -> None:
    """init_from reads <key>.pt files: an fsdp run dir is refused in one line naming its
    final/model.pt, which a new fsdp run then starts from (scattered into its shards)."""
    import torch

    job = charlm_fsdp_job(tmp_path, max_steps=1, lr=1e-12)  # one step that barely moves a weight
    codes, r = run([str(job), "--run-dir", str(tmp_path / "refused"),
                    f"--set=checkpoint.init_from={json.dumps(str(reference))}"], 2, tmp_path / "logs")
    assert codes == [1, 1], r.output()
    (line,) = [x for x in r.output(0).splitlines() if x.startswith("ddpjob: error:")]
    assert "holds model as DCP shards" in line and f"{reference / 'final' / 'model.pt'}" in line
    final = reference / "final" / "model.pt"
    codes, r = run([str(job), "--run-dir", str(tmp_path / "run"),
                    f"--set=checkpoint.init_from={json.dumps(str(final))}"], 2, tmp_path / "logs")
    assert codes == [0, 0], r.output()
    assert f"initialised model from {final}" in r.output(0)
    before, after = torch.load(final), torch.load(tmp_path / "run" / "final" / "model.pt")
    assert before.keys() == after.keys()
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=1e-6)
