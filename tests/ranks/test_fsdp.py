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

from example_jobs import CHARLM, CHARLM_SMALL, hook_job, samples_by_step
from ranks import LAG, assert_bit_equal, events, metrics, run
from runlogs import decisions

FSDP = {"strategy": "fsdp", "entry": "example_hooks:main", "args": [str(CHARLM / "train.py")]}


def charlm_fsdp_job(folder: Path, *, checkpoint: dict[str, Any] | None = None, **user: Any) -> Path:
    return hook_job(folder / "charlm-fsdp.toml", CHARLM / "train.py", CHARLM / "job.toml",
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
    stop = decisions(events(out))[0]
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


def test_fsdp_async_checkpoint_is_complete_and_resumes_bit_exactly(tmp_path: Path, reference: Path) -> None:
    """checkpoint.async = true: step-5 is written in the background (host copy of the shards,
    DCP's gathers on the checkpoint group) while steps 6.. train. The stop's own checkpoint
    (step 8, blocking) is damaged, so the resume has to take the background-written step-5."""
    import torch

    def damage(run_dir: Path) -> None:
        newest, previous = _checkpoints(run_dir)[-2:][::-1]
        assert (newest.name, previous.name) == ("step-000000008", "step-000000005")
        assert sorted(json.loads((previous / "manifest.json").read_text())["files"]) == \
            ["__0_0.distcp", "__1_0.distcp", "dcp.metadata", "rank-0.pt", "rank-1.pt", "sampler.pt",
             "scheduler.pt"]
        (newest / "dcp.metadata").write_bytes(b"x" * (newest / "dcp.metadata").stat().st_size)

    job = charlm_fsdp_job(tmp_path, checkpoint={"async": True})
    out, log = _stop_then_resume(tmp_path, job, 2, 6, 2, between=damage)
    assert "skipping step-8: dcp.metadata sha256 mismatch (corrupted on disk)" in log
    assert "resumed from step-000000005" in log
    assert_bit_equal(torch.load(reference / "final" / "model.pt"), torch.load(out / "final" / "model.pt"), "model")
    assert _losses(out) == _losses(reference)


def test_fsdp_resumes_alone_from_two_shards(tmp_path: Path) -> None:
    """One rank has no process group and shards nothing, yet the checkpoints keep the fsdp
    layout: DCP reads the two shards into whole tensors, and writes one shard file after."""
    out, log = _stop_then_resume(tmp_path, charlm_fsdp_job(tmp_path), 2, 6, 1)
    assert "resumed at another world size: 2 -> 1 ranks (step 8)" in log
    assert "Warning" not in log
    newest = _checkpoints(out)[-1]
    assert newest.name == "step-000000012"
    assert sorted(json.loads((newest / "manifest.json").read_text())["files"]) == \
        ["__0_0.distcp", "dcp.metadata", "rank-0.pt", "sampler.pt", "scheduler.pt"]


# ------------------------------------------------------------------ the built-in trainer
def test_trainer_fsdp_stopped_mid_accumulation_resumes_bit_exactly(tmp_path: Path) -> None:
    """The built-in trainer with strategy fsdp: BatchNorm (buffers: rank 0's are saved), SGD
    (foreach: no fused SGD on DTensors), accumulation 2 (gradient sync only at the last micro-
    step), random crops, an evaluation every epoch (513 test images: shares of 256 and 257 would
    be 1 and 2 batches of 256, but a sharded forward is a collective: both ranks run 2). Rank
    1 signals itself in the first micro-step of step 12 (forward call 23); the resumed run
    equals the uninterrupted one bit for bit: final model, every loss, every evaluation."""
    import torch

    from ranks import write_job

    job = write_job(tmp_path / "job.toml", train=dict(
        model="trainer_plugins:signalling_cnn", batch_size=16, accumulation_steps=2, lr=0.05,
        warmup_steps=3, log_every=1, eval_every=0, amp="off", channels_last=False, threads=1, seed=1,
        max_steps=20, strategy="fsdp"), data=dict(dataset="synthetic", synthetic_train=512,
                                                   synthetic_test=513, augment=True),
        checkpoint=dict(every_steps=7, keep_last=2))
    ref = tmp_path / "reference"
    codes, r = run([str(job), "--run-dir", str(ref)], 2, tmp_path / "logs")
    assert codes == [0, 0], r.output()
    out = tmp_path / "interrupted"
    codes, r = run([str(job), "--run-dir", str(out)], 2, tmp_path / "logs",
                   extra_env={"DDPJOB_TEST_SIGNAL": "1:23:0"})
    assert codes == [3, 3], r.output()
    stop = decisions(events(out))[0]
    assert stop["step"] == 12 + LAG, stop
    ckpt = sorted(p.name for p in (out / "checkpoints" / f"step-{12 + LAG:09d}").iterdir())
    assert ckpt == ["__0_0.distcp", "__1_0.distcp", "dcp.metadata", "manifest.json", "progress.pt",
                    "rank-0.pt", "rank-1.pt", "scaler.pt"], ckpt
    codes, r = run([str(out)], 2, tmp_path / "logs", restart=1)
    assert codes == [0, 0], r.output()
    assert_bit_equal(torch.load(ref / "final" / "model.pt"), torch.load(out / "final" / "model.pt"), "model")
    assert _losses(out) == _losses(ref) and len(_losses(ref)) == 20
    evals = {s: (x["eval_acc"], x["eval_loss"]) for s, x in metrics(out, "eval").items()}
    assert evals == {s: (x["eval_acc"], x["eval_loss"]) for s, x in metrics(ref, "eval").items()}
    assert sorted(evals) == [8, 16, 20]


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


# ------------------------------------------------------------------ 4 ranks -> 2 ranks
@pytest.mark.slow  # 4 ranks on 2 cores, twice
def test_fsdp_4_to_2_reshards_sees_every_sample_once_and_ends_within_1e5(tmp_path: Path) -> None:
    """Stopped mid-epoch on 4 ranks, resumed on 2: DCP reshards model and AdamW state from 4
    shards to 2, the global batch stays 32 and every window is seen once per full epoch. Up to
    the stop the run is the 4-rank reference bit for bit; after it only the summation order
    changes, and the final loss stays within 1e-5 of the uninterrupted 4-rank run."""
    windows = (38664 - 32 - 1) // 32 + 1  # tiny.txt's length, context 32, stride 32
    steps_per_epoch = windows // 32
    total, at = steps_per_epoch + 8, 20  # one full epoch and part of the next
    job = charlm_fsdp_job(tmp_path, max_steps=total, dropout=0.0)
    ref = tmp_path / "reference"
    codes, r = run([str(job), "--run-dir", str(ref)], 4, tmp_path / "ref-logs", timeout=400)
    assert codes == [0] * 4, r.output()
    stop = at + 1 + LAG

    def four_shards(run_dir: Path) -> None:
        newest = _checkpoints(run_dir)[-1]
        assert newest.name == f"step-{stop:09d}"
        assert sorted(p.name for p in newest.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]

    out, log = _stop_then_resume(tmp_path, job, 4, at, 2, between=four_shards)
    assert f"resumed at another world size: 4 -> 2 ranks (step {stop})" in log
    samples = samples_by_step(out)
    assert sorted(samples) == list(range(1, total + 1))
    for step, recs in samples.items():
        assert sum(len(x["ids"]) for x in recs) == 32, step  # the global batch at any world size
        assert {x["world_size"] for x in recs} == ({4} if step <= stop else {2}), step
    epoch0 = [i for s in range(1, steps_per_epoch + 1) for x in samples[s] for i in x["ids"]]
    assert len(epoch0) == len(set(epoch0)) == steps_per_epoch * 32
    epoch1 = [i for s in range(steps_per_epoch + 1, total + 1) for x in samples[s] for i in x["ids"]]
    assert len(epoch1) == len(set(epoch1)) == 8 * 32
    mine, theirs = _losses(out), _losses(ref)
    assert {s: mine[s] for s in range(1, stop + 1)} == {s: theirs[s] for s in range(1, stop + 1)}
    diff = abs(mine[total] - theirs[total])
    print(f"\nfinal loss 4 ranks {theirs[total]!r}, 4 -> 2 ranks {mine[total]!r}, |diff| {diff:.2e}")
    assert diff <= 1e-5, (mine[total], theirs[total])


STAGE_CHECK = """
import tempfile, torch, torch.distributed as dist
from pathlib import Path
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from ddpjob.store import sharded
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
for m in model:
    fully_shard(m)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters())
model(torch.ones(3, 4)).sum().backward()
opt.step()
units = sharded.units({"model": model, "optimizer": opt})
live = sharded.state_dicts(units)
staged = sharded.stage(live, Path(tempfile.mkdtemp()))
assert isinstance(staged["model"]["0.weight"], DTensor)
before = staged["model"]["0.weight"].to_local().clone()
with torch.no_grad():
    for p in model.parameters():
        p.to_local().add_(1.0)
    for s in opt.state.values():
        s["exp_avg"].to_local().add_(1.0)
assert torch.equal(staged["model"]["0.weight"].to_local(), before)
assert not torch.equal(live["model"]["0.weight"].to_local(), before)
assert not torch.equal(staged["optimizer"]["state"]["0.weight"]["exp_avg"].to_local(),
                       live["optimizer"]["state"]["0.weight"]["exp_avg"].to_local())
print("staged copy ok")
dist.destroy_process_group()
"""


def test_fsdp_async_stage_is_a_copy_training_cannot_change() -> None:
    """What makes an async sharded save consistent: after stage() returns, changing the live
    parameters and optimizer state changes nothing in what the background thread writes."""
    import subprocess

    from ranks import PYTHON, base_env, free_port

    p = subprocess.run([PYTHON, "-c", STAGE_CHECK % free_port()], env=base_env(), text=True,
                       capture_output=True, timeout=120)
    assert p.returncode == 0 and "staged copy ok" in p.stdout, p.stdout + p.stderr
