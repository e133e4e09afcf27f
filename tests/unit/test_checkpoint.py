"""CheckpointStore: round trips, pruning, every corruption kind, safe loading, async snapshots,
RNG state and the save schedule. The kill -9 torture test lives in test_checkpoint_crash.py."""

from __future__ import annotations

import json
import os
import pickle
import random
import resource
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ddpjob.errors import DDPJobError, UsageError
from ddpjob.node import dist
from ddpjob.store.commit import CheckpointStore
from ddpjob.store.pipeline import Plan, SavePipeline
from ddpjob.store.rng import capture_rng_state, restore_rng_state
from ddpjob.store.schedule import SaveSchedule

torch.set_num_threads(1)


def tiny_state(step: int) -> dict[str, dict]:
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 8)).sum().backward()
    opt.step()
    return {"model.pt": model.state_dict(), "optim.pt": opt.state_dict(),
            "rank-0.pt": {"marker": torch.full((3,), float(step))}}


def save_steps(store: CheckpointStore, *steps: int) -> None:
    for step in steps:
        store.save(step, tiny_state(step), {"epoch": step // 10, "samples_seen": step * 32, "world_size": 1})


def pipeline(store: CheckpointStore, rank: int = 0) -> SavePipeline:
    """The save pipeline of `rank` in one process: its gather and barriers are no-ops."""
    control = dist.Control(SimpleNamespace(initialized=False, timeout_s=300.0))  # type: ignore[arg-type]
    return SavePipeline(store, control, rank)


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_save_load_round_trip(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck", config_hash="cfg1")
    files = tiny_state(7)
    store.save(7, files, {"epoch": 1, "samples_seen": 224, "world_size": 1})
    lines: list[str] = []
    info = store.latest(log=lines.append)
    assert info is not None and info.step == 7 and lines == ["resuming from step-7"]
    for name, obj in files.items():
        assert_same(obj, store.load(info, name))
    m = info.manifest
    assert (m["step"], m["epoch"], m["samples_seen"], m["world_size"]) == (7, 1, 224, 1)
    assert m["config_hash"] == "cfg1" and m["format_version"] == 1
    assert set(m["versions"]) == {"ddpjob", "torch", "python"} and m["versions"]["torch"] == torch.__version__
    assert set(m["files"]) == set(files)
    # nothing but the committed folder is left behind
    assert [p.name for p in (tmp_path / "ck").iterdir()] == [info.path.name]


def test_files_are_torch_save_files_without_the_crc(tmp_path: Path) -> None:
    """The store writes torch.save's zip without its CRC32 of every record (as much CPU as the
    sha256, and torch.load never checks it): the same records at the same offsets, the same
    tensors back with weights_only, and a flipped byte is still caught, by the manifest's sha256."""
    import zipfile

    state = tiny_state(3)
    store = CheckpointStore(tmp_path / "ck", config_hash="h")
    path = store.save(3, state, {})
    with open(tmp_path / "ref.pt", "wb") as f:  # a file object, as the store writes: same archive name
        torch.save(state["model.pt"], f)
    ours, ref = (zipfile.ZipFile(p).infolist() for p in (path / "model.pt", tmp_path / "ref.pt"))
    assert [(i.filename, i.header_offset, i.file_size) for i in ours] == \
        [(i.filename, i.header_offset, i.file_size) for i in ref]
    assert {i.CRC for i in ours} == {0} and {i.CRC for i in ref} != {0}
    assert_same(torch.load(path / "model.pt", weights_only=True), state["model.pt"])
    data = bytearray((path / "model.pt").read_bytes())
    data[len(data) // 2] ^= 1
    (path / "model.pt").write_bytes(bytes(data))
    assert "model.pt sha256 mismatch" in store.verify(store.list()[0])


def test_crc32_switch_is_off_only_inside_our_saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's CRC32 switch is process-wide: our saves turn it off until their first byte (torch
    has read it by then) and put back the caller's value, False included, also when a save
    fails; saves of ours that overlap share one window; a user's torch.save keeps its CRC."""
    import io
    import zipfile

    from ddpjob.store import nocrc

    ser = torch.serialization
    seen = []
    real_save = torch.save

    def spy(obj, f, *a, **kw):
        seen.append(ser.get_crc32_options())
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", spy)
    store = CheckpointStore(tmp_path / "ck")
    store.save(1, tiny_state(1), {})
    assert seen == [False] * 3 and ser.get_crc32_options() is True
    user = io.BytesIO()
    real_save({"t": torch.ones(4)}, user)
    assert 0 not in {i.CRC for i in zipfile.ZipFile(user).infolist()}

    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):  # fails before any byte
        nocrc.save({"f": lambda: 0}, io.BytesIO())
    assert ser.get_crc32_options() is True

    ser.set_crc32_options(False)  # the caller's own False stays
    try:
        nocrc.save({"t": torch.ones(2)}, io.BytesIO())
        assert ser.get_crc32_options() is False
    finally:
        ser.set_crc32_options(True)

    first, second = nocrc._Crc32Off(), nocrc._Crc32Off()  # overlapping saves (writer threads)
    with first:
        with second:
            first.restore()
            assert ser.get_crc32_options() is False  # second still inside its window
        assert ser.get_crc32_options() is True


def test_folder_names_sort_numerically(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=5)
    save_steps(store, 9, 10, 100)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [int(n.split("-")[1]) for n in names] == [9, 10, 100]
    assert [i.step for i in store.list()] == [100, 10, 9]


def test_keep_last_prunes_oldest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2)
    save_steps(store, 1, 2, 3, 4, 5)
    assert [i.step for i in store.list()] == [5, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000004", "step-000000005"]


def test_a_save_makes_room_first_but_never_takes_the_newest(tmp_path: Path) -> None:
    """The write of step N starts by deleting what N's commit would prune (its write reuses the
    freed memory). Killed before that commit, keep_last - 1 remain and the newest is intact;
    keep_last = 1 deletes nothing early; a process that committed nothing yet leaves it all
    to the commit (it has not verified the newest one)."""
    store = CheckpointStore(tmp_path / "a", keep_last=3)
    save_steps(store, 1, 2, 3)
    store.make_room(4)  # what save(4) does before writing; killed right after:
    assert [i.step for i in store.list()] == [3, 2]
    assert store.latest(log=lambda _: None).step == 3
    save_steps(store, 4)
    assert [i.step for i in store.list()] == [4, 3, 2]
    fresh = CheckpointStore(tmp_path / "a", keep_last=3)  # e.g. after a restart
    fresh.make_room(5)
    assert [i.step for i in fresh.list()] == [4, 3, 2]
    store.make_room(4)  # the same step again: its commit keeps the valid one and prunes nothing
    assert [i.step for i in store.list()] == [4, 3, 2]
    one = CheckpointStore(tmp_path / "one", keep_last=1)
    save_steps(one, 1, 2)
    one.make_room(3)
    assert [i.step for i in one.list()] == [2]
    save_steps(one, 3)
    assert [i.step for i in one.list()] == [3]


def test_keep_last_below_one_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="keep_last is 0"):
        CheckpointStore(tmp_path, keep_last=0)


def test_prune_never_deletes_the_only_valid_one(tmp_path: Path) -> None:
    save_steps(CheckpointStore(tmp_path, keep_last=2), 1, 2)
    # the newer file rotted on disk (same size: only its hash tells); a resume falls back to 1
    p = tmp_path / "step-000000002" / "model.pt"
    p.write_bytes(bytes(len(p.read_bytes())))
    store = CheckpointStore(tmp_path, keep_last=1)
    store.prune()
    assert [i.step for i in store.list()] == [2, 1]
    assert store.latest(log=lambda _: None).step == 1
    # and a later commit: keep_last=1 keeps the newest plus nothing older
    save_steps(store, 3)
    assert [i.step for i in store.list()] == [3]


def test_damaged_checkpoints_are_pruned_and_take_no_keep_last_slot(tmp_path: Path) -> None:
    save_steps(CheckpointStore(tmp_path, keep_last=2), 1, 2)
    # left by a disk that lost its tail: no manifest; a truncated file
    broken = tmp_path / "step-000000003"
    broken.mkdir()
    (broken / "model.pt").write_bytes(b"")
    save_steps(CheckpointStore(tmp_path, keep_last=10), 4)
    _truncate(tmp_path / "step-000000004")
    store = CheckpointStore(tmp_path, keep_last=2)
    store.prune()
    assert [i.step for i in store.list()] == [2, 1]  # two valid ones kept, as keep_last says
    save_steps(store, 5)
    assert [i.step for i in store.list()] == [5, 2]


def _truncate(folder: Path) -> None:
    p = folder / "model.pt"
    p.write_bytes(p.read_bytes()[:-100])


def _zero_length(folder: Path) -> None:
    (folder / "optim.pt").write_bytes(b"")


def _bit_flip(folder: Path) -> None:
    p = folder / "model.pt"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _edit_manifest(folder: Path, change) -> None:
    m = json.loads((folder / "manifest.json").read_text())
    change(m)
    (folder / "manifest.json").write_text(json.dumps(m))


CORRUPTIONS = {
    "truncated": (_truncate, "model.pt is"),
    "zero_length": (_zero_length, "optim.pt is 0 bytes"),
    "bit_flip": (_bit_flip, "model.pt sha256 mismatch"),
    "missing_manifest": (lambda f: (f / "manifest.json").unlink(), "missing manifest.json"),
    "bad_json": (lambda f: (f / "manifest.json").write_text('{"step": 2, '), "unparsable manifest.json"),
    "edited_step": (lambda f: _edit_manifest(f, lambda m: m.update(step=3)), "manifest says step 3"),
    "missing_file_entry": (lambda f: _edit_manifest(f, lambda m: m["files"].pop("rank-0.pt")),
                           "not listed in manifest.json: rank-0.pt"),
    "file_missing": (lambda f: (f / "optim.pt").unlink(), "file optim.pt missing"),
    "unknown_format": (lambda f: _edit_manifest(f, lambda m: m.update(format_version=99)),
                       "format version 99 unknown"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corruption_is_skipped_with_one_line(tmp_path: Path, kind: str) -> None:
    store = CheckpointStore(tmp_path, keep_last=3)
    save_steps(store, 1, 2)
    corrupt, reason = CORRUPTIONS[kind]
    corrupt(tmp_path / "step-000000002")
    lines: list[str] = []
    info = store.latest(log=lines.append)
    assert info is not None and info.step == 1
    assert len(lines) == 2 and lines[1] == "resuming from step-1"
    assert lines[0].startswith("skipping step-2: ") and reason in lines[0], lines[0]
    assert "\n" not in lines[0]
    assert_same(tiny_state(1)["model.pt"], store.load(info, "model.pt"))


def test_wrong_config_hash_is_skipped(tmp_path: Path) -> None:
    save_steps(CheckpointStore(tmp_path, config_hash="hash-B"), 1)
    save_steps(CheckpointStore(tmp_path, config_hash="hash-A"), 2)
    lines: list[str] = []
    info = CheckpointStore(tmp_path, config_hash="hash-B").latest(log=lines.append)
    assert info is not None and info.step == 1
    assert lines == ["skipping step-2: checkpoint was written by a different job config "
                     "(config hash 'hash-A', this job has 'hash-B')", "resuming from step-1"]
    # an explicit argument overrides the store's hash; "" turns the check off
    assert CheckpointStore(tmp_path).latest(config_hash="hash-A", log=lambda _: None).step == 2
    assert CheckpointStore(tmp_path, config_hash="x").latest(config_hash="", log=lambda _: None).step == 2


def test_no_valid_checkpoint_says_so(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    assert store.latest(log=pytest.fail) is None  # empty root: silent
    save_steps(store, 1)
    (tmp_path / "step-000000001" / "manifest.json").unlink()
    lines: list[str] = []
    assert store.latest(log=lines.append) is None
    assert lines == ["skipping step-1: missing manifest.json (the save never finished)",
                     f"no valid checkpoint in {tmp_path}: starting from scratch"]


def test_staging_and_trash_folders_are_never_listed(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    save_steps(store, 1)
    staging = store.staging_dir(2, "job7-0")
    for name, obj in tiny_state(2).items():
        store.write(staging, name, obj)  # complete but not committed
    (tmp_path / ".del-step-000000003-abcd").mkdir()
    assert staging.name == ".tmp-step-000000002-job7-0"
    assert [i.step for i in store.list()] == [1]
    assert store.latest(log=lambda _: None).step == 1


def test_same_step_twice_keeps_a_valid_one_and_replaces_a_broken_one(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    save_steps(store, 4)
    first = (tmp_path / "step-000000004" / "manifest.json").read_text()
    save_steps(store, 4)  # e.g. preempted again right after resuming from step 4
    assert (tmp_path / "step-000000004" / "manifest.json").read_text() == first
    _truncate(tmp_path / "step-000000004")
    save_steps(store, 4)
    assert store.verify(store.list()[0]) is None
    assert [p.name for p in tmp_path.iterdir()] == ["step-000000004"]


def test_collective_save_every_rank_writes_rank0_commits(tmp_path: Path) -> None:
    # what the trainer does on 3 ranks (each rank has its own store object over the shared root)
    ranks = [CheckpointStore(tmp_path, config_hash="h") for _ in range(3)]
    stagings = [store.staging_dir(12, "5001-2") for store in ranks]
    assert len(set(stagings)) == 1  # same attempt on every rank -> one shared folder
    pipes = [pipeline(store, r) for r, store in enumerate(ranks)]
    meta = {"epoch": 2, "samples_seen": 1200, "world_size": 3}
    for r, pipe in enumerate(pipes):  # async: each rank's writer thread
        pipe.run(Plan(12, stagings[r], {f"rank-{r}.pt": {"rank": torch.tensor([r])}}, meta), blocking=False)
    ranks[0].write(stagings[0], "model.pt", {"w": torch.ones(3)})
    for pipe in reversed(pipes):  # then a barrier, then rank 0 alone commits
        pipe.finish_pending()
    info = ranks[1].latest(log=lambda _: None)
    assert info.path == tmp_path / "step-000000012" and info.manifest["samples_seen"] == 1200
    assert sorted(info.manifest["files"]) == ["model.pt", "rank-0.pt", "rank-1.pt", "rank-2.pt"]
    assert [ranks[r].load(info, f"rank-{r}.pt")["rank"].item() for r in range(3)] == [0, 1, 2]


def test_blocking_and_async_saves_through_the_pipeline_commit_the_same_files(tmp_path: Path) -> None:
    """The two modes differ only in where the stages run: the same files and values come out
    (not the same bytes: the async stage's host copy of a state dict drops its `_metadata`)."""
    written = {}
    for blocking in (True, False):
        store = CheckpointStore(tmp_path / f"blocking-{blocking}")
        pipe = pipeline(store)
        pipe.run(Plan(3, store.staging_dir(3, "a"), tiny_state(3), {"world_size": 1}), blocking=blocking)
        assert store.list() == [] or blocking  # async: committed by finish_pending() only
        pipe.finish_pending()
        info = store.latest(log=lambda _: None)
        assert info is not None and info.step == 3 and info.manifest["world_size"] == 1
        written[blocking] = {name: store.load(info, name) for name in info.manifest["files"]}
    assert sorted(written[True]) == ["model.pt", "optim.pt", "rank-0.pt"]
    assert_same(written[True], written[False])


def test_meta_that_is_not_json_fails_before_touching_disk(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    staging = store.staging_dir(1, "a")
    store.write(staging, "model.pt", {"w": torch.ones(2)})
    with pytest.raises(TypeError):
        store.commit(staging, 1, {"loss": torch.tensor(1.0)})
    assert sorted(p.name for p in staging.iterdir()) == ["model.pt"] and store.list() == []


def test_commit_refuses_unfinished_files(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    staging = store.staging_dir(1, "a")
    store.write(staging, "model.pt", {"w": torch.ones(2)})
    (staging / "rank-1.pt.tmp").write_bytes(b"half")  # a rank still writing (or dead mid-write)
    with pytest.raises(DDPJobError, match=r"unfinished files \['rank-1.pt.tmp'\]"):
        store.commit(staging, 1, {})
    assert store.list() == []


class Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@pytest.mark.parametrize("fmt", ["torch_zip", "raw_pickle"])
def test_crafted_pickle_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    monkeypatch.chdir(tmp_path)
    store = CheckpointStore(tmp_path / "ck")
    save_steps(store, 1)
    info = store.list()[0]
    target = info.path / "model.pt"
    if fmt == "torch_zip":
        torch.save({"w": Evil()}, target)  # the attacker's file; torch.save pickles anything
    else:
        target.write_bytes(pickle.dumps(Evil(), protocol=2))
    with pytest.raises(DDPJobError) as caught:
        store.load(info, "model.pt")
    assert str(target) in caught.value.line() and "refusing to load" in caught.value.line()
    assert not (tmp_path / "PWNED").exists()


def test_saving_what_weights_only_cannot_load_fails_early(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    bad = {"rng": {"numpy": np.random.get_state()[1]}}
    with pytest.raises(DDPJobError, match=r"rank-0.pt\['rng'\]\['numpy'\] is a numpy.ndarray"):
        store.save(1, {"rank-0.pt": bad}, {})
    with pytest.raises(DDPJobError, match="numpy.float64"):
        store.save(1, {"x.pt": {"loss": np.float64(1.5)}}, {})  # a float subclass that does not load


def test_load_of_an_absent_file_names_what_exists(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    save_steps(store, 1)
    with pytest.raises(DDPJobError, match="has no rank-3.pt .it holds model.pt, optim.pt, rank-0.pt"):
        store.load(store.list()[0], "rank-3.pt")


def test_disk_full_cleans_staging_and_keeps_old_checkpoints(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    save_steps(store, 1)
    # A real write failure from the kernel: files may not grow past 256 KiB (EFBIG, like ENOSPC).
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, old_limit[1]))
    try:
        with pytest.raises(DDPJobError) as caught:
            store.save(2, {"model.pt": {"w": torch.zeros(1 << 20)}}, {})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    line = caught.value.line()
    assert "could not write the checkpoint file" in line and "disk or quota full" in line
    assert "Hint: free space" in line
    assert [p.name for p in tmp_path.iterdir()] == ["step-000000001"]  # staging folder removed
    assert store.latest(log=lambda _: None).step == 1


def test_unwritable_root_is_a_user_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    store = CheckpointStore(tmp_path / "file" / "ck")
    with pytest.raises(DDPJobError, match="could not create the checkpoint staging folder") as caught:
        store.save(1, {"m.pt": {"w": torch.ones(1)}}, {})
    assert "Hint: point the run directory at a writable folder" in caught.value.line()


def test_prune_removes_stale_staging_of_dead_attempts_only(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, stale_after_s=60)
    dead = CheckpointStore(tmp_path).staging_dir(5, "job1-0")  # another (dead) process's attempt
    (dead / "rank-1.pt.tmp").write_bytes(b"partial")
    alive = CheckpointStore(tmp_path).staging_dir(6, "job1-1")  # another process writing right now
    (alive / "rank-1.pt.tmp").write_bytes(b"partial")
    mine = store.staging_dir(7, "job1-1")  # this process's own, still open
    hour_ago = time.time() - 3600
    for path in (dead, dead / "rank-1.pt.tmp", mine):
        os.utime(path, (hour_ago, hour_ago))
    save_steps(store, 1)  # commit prunes
    assert not dead.exists() and alive.exists() and mine.exists()


def test_async_write_snapshot_is_independent_of_later_mutation(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    model = torch.nn.Linear(16, 16)
    shared = torch.arange(4.0)
    state = {"model": model.state_dict(), "tied": [shared, shared], "progress": {"step": 3, "lr": [0.1]}}
    expected = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                "tied": [shared.clone(), shared.clone()], "progress": {"step": 3, "lr": [0.1]}}
    snap = CheckpointStore.snapshot(state)
    assert snap["tied"][0] is snap["tied"][1]  # shared tensors stay shared (saved once)
    pipe = pipeline(store)
    pipe.run(Plan(3, store.staging_dir(3, "a"), {"trainer.pt": state}, {}), blocking=False)  # stage: the copy
    with torch.no_grad():  # the training step goes on while the writer thread works
        for p in model.parameters():
            p.add_(1.0)
    shared.mul_(0)
    state["progress"]["lr"][0] = 99.0
    pipe.finish_pending()
    assert not pipe.busy()
    assert_same(expected, store.load(store.latest(log=lambda _: None), "trainer.pt"))


def test_a_snapshot_keeps_each_tensors_memory_layout_and_a_fused_optimizer_takes_it_back(tmp_path: Path) -> None:
    """A channels_last model's momentum buffers come back channels_last (fresh and pooled
    copies alike): CUDA's fused SGD refused contiguous ones beside channels_last parameters
    after a resume from an in-memory snapshot. Strided views are copied dense."""
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(conv.parameters(), lr=0.1, momentum=0.9)
    conv(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)).sum().backward()
    opt.step()
    state = {"model": conv.state_dict(), "optimizer": opt.state_dict(), "view": torch.arange(24.0).view(4, 6)[:, ::2]}
    for _ in range(3):  # fresh buffers, then pooled ones
        snap = CheckpointStore.snapshot(state)
        assert snap["model"]["weight"].stride() == conv.weight.stride() != conv.weight.contiguous().stride()
        assert snap["optimizer"]["state"][0]["momentum_buffer"].stride() == conv.weight.stride()
        assert snap["view"].stride() == (3, 1) and torch.equal(snap["view"], state["view"])
    store = CheckpointStore(tmp_path)
    staging = store.staging_dir(1, "a")
    pipe = pipeline(store)
    pipe.run(Plan(1, staging, {"optimizer.pt": snap["optimizer"]}, {}), blocking=False)
    pipe.finish_pending()  # rank 0: commits
    fresh = torch.optim.SGD(conv.parameters(), lr=0.1, momentum=0.9, foreach=True)
    fresh.load_state_dict(store.load(store.latest(log=lambda _: None), "optimizer.pt"))
    assert fresh.state[conv.weight]["momentum_buffer"].stride() == conv.weight.stride()
    fresh.step()  # the foreach path checks the layouts agree


def test_snapshot_buffers_are_reused_only_when_nothing_holds_them() -> None:
    state = {"w": torch.arange(1000.0), "b": torch.zeros(7, dtype=torch.int64)}
    ptr = lambda snap: snap["w"].data_ptr()  # noqa: E731
    first = CheckpointStore.snapshot(state)
    second = CheckpointStore.snapshot(state)
    assert ptr(first) != ptr(second) != state["w"].data_ptr()
    state["w"].add_(1)
    third = CheckpointStore.snapshot(state)  # both pooled sets busy: a fresh copy
    assert len({ptr(first), ptr(second), ptr(third)}) == 3
    assert torch.equal(first["w"], torch.arange(1000.0)) and torch.equal(third["w"], state["w"])
    old_first = ptr(first)
    del first
    fourth = CheckpointStore.snapshot(state)
    assert ptr(fourth) == old_first  # memory reused: no page faults on the next save
    alias = second["w"][:10]  # a view keeps its buffer busy even after the snapshot is dropped
    del second
    state["w"].add_(1)
    fifth = CheckpointStore.snapshot(state)
    assert ptr(fifth) != alias.data_ptr()
    assert torch.equal(alias, torch.arange(10.0))
    assert torch.equal(fifth["w"], state["w"]) and torch.equal(fourth["w"], state["w"] - 1)


def test_async_write_errors_come_back_from_wait(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    staging = store.staging_dir(1, "a")
    (staging / "model.pt.tmp").mkdir()  # the writer cannot create its temporary file
    pipe = pipeline(store)
    pipe.run(Plan(1, staging, {"model.pt": {"w": torch.ones(2)}}, {}), blocking=False)
    with pytest.raises(DDPJobError, match="could not write the checkpoint file"):
        pipe.finish_pending()  # the agreement removed the staging folder
    assert not staging.exists() and store.list() == []


def test_snapshot_of_resnet18_sgd_state_is_an_equal_private_copy() -> None:
    """A real model + optimizer state (nested dicts, momentum buffers, param groups) snapshots to
    equal values in memory of its own. How long it blocks the step is bench P6's third row
    (an async save of the same state, goal <= 50 ms), not a test's: timings belong in bench/."""
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    for _ in range(2):  # the second snapshot draws on the buffers the first one left behind
        snap = CheckpointStore.snapshot(state)
        assert snap["optim"]["param_groups"] == state["optim"]["param_groups"]
        assert snap["model"].keys() == state["model"].keys()
        for key, tensor in state["model"].items():
            assert torch.equal(snap["model"][key], tensor), key
            assert snap["model"][key].untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
        for i, buffers in state["optim"]["state"].items():
            assert torch.equal(snap["optim"]["state"][i]["momentum_buffer"], buffers["momentum_buffer"])
        del snap
    weight = state["model"]["fc.weight"]
    before = weight.clone()
    snap = CheckpointStore.snapshot(state)
    weight.add_(1.0)  # the next step changes the live weights, never the snapshot
    assert torch.equal(snap["model"]["fc.weight"], before) and not torch.equal(weight, before)


def test_rng_state_round_trips_through_weights_only_loading(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    np.random.standard_normal()  # and in numpy's legacy state
    store = CheckpointStore(tmp_path)
    store.save(1, {"rank-0.pt": capture_rng_state()}, {})
    draws = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(),
             np.random.standard_normal(), torch.rand(3).tolist())
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(store.load(store.list()[0], "rank-0.pt"))
    again = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(),
             np.random.standard_normal(), torch.rand(3).tolist())
    assert again == draws


def test_save_schedule_by_steps_and_minutes() -> None:
    now = [1000.0]
    by_steps = SaveSchedule(every_steps=10, every_minutes=0, clock=lambda: now[0])
    assert [s for s in range(0, 31) if by_steps.due(s)] == [10, 20, 30]
    by_time = SaveSchedule(every_steps=0, every_minutes=2, clock=lambda: now[0])
    now[0] += 119
    assert not by_time.due(5)
    now[0] += 1
    assert by_time.due(6)
    assert not by_time.due(7)  # the timer restarted
    both = SaveSchedule(every_steps=100, every_minutes=1, clock=lambda: now[0])
    now[0] += 30
    assert both.due(100)  # a step-triggered save also restarts the minute timer
    now[0] += 45
    assert not both.due(101)
    now[0] += 15
    assert both.due(102)
    with pytest.raises(UsageError, match="expected numbers >= 0"):
        SaveSchedule(every_steps=-1, every_minutes=0)


def test_init_from_loads_the_named_keys_exactly(tmp_path: Path) -> None:
    from ddpjob.errors import DDPJobError
    from ddpjob.store import initfrom

    def target(obj):
        return obj

    src_model = torch.nn.Linear(4, 3)
    src_opt = torch.optim.SGD(src_model.parameters(), lr=0.1, momentum=0.9)
    src_model(torch.randn(2, 4)).sum().backward()
    src_opt.step()
    store = CheckpointStore(tmp_path / "run" / "checkpoints", keep_last=2)
    store.save(5, {"model.pt": src_model.state_dict(), "optimizer.pt": src_opt.state_dict()}, {})
    torch.save(src_model.state_dict(), tmp_path / "weights.pt")
    for source, keys in ((tmp_path / "run", ("model", "optimizer")),
                         (tmp_path / "run" / "checkpoints" / "step-000000005", ("model",)),
                         (tmp_path / "weights.pt", ("model",))):
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        initfrom.load({"model": model, "optimizer": opt}, str(source), keys, 0, target)
        assert_same(model.state_dict(), src_model.state_dict())
        if "optimizer" in keys:
            assert_same(opt.state_dict()["state"], src_opt.state_dict()["state"])
        else:
            assert opt.state_dict()["state"] == {}
    torch.save({"w": torch.nn.Linear(4, 3)}, tmp_path / "evil.pt")  # a pickled module: refused
    (tmp_path / "notes.txt").write_text("hello\n")  # KeyError: 101 inside torch's legacy unpickler
    (tmp_path / "noise.bin").write_bytes(bytes(range(256)) * 20)
    for source, expected in ((tmp_path / "evil.pt", r"refusing to load .*evil.pt: it holds more than tensors "
                                                    r"and plain values \(torch.nn.modules.linear.Linear objects\)"),
                             (tmp_path / "notes.txt", "cannot read .*notes.txt as weights saved by torch.save"),
                             (tmp_path / "noise.bin", "cannot read .*noise.bin as weights saved by torch.save"),
                             (tmp_path / "nowhere", "neither a run dir"),
                             (tmp_path / "weights.pt", "does not fit")):
        with pytest.raises(DDPJobError, match=expected) as caught:
            initfrom.load({"model": torch.nn.Linear(5, 3)}, str(source), ("model",), 0, target)
        assert "weights_only" not in caught.value.line()  # torch's advice to load it unsafely is not repeated
