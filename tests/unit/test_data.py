"""ddpjob.train.data, .arrays and .tensorloader: the CIFAR-10 reader, the synthetic set, TensorLoader, eval sharding, plugins."""

from __future__ import annotations

import pickle
import signal
import tarfile

import numpy as np
import pytest
import torch

from ddpjob.train import arrays
from ddpjob.train.arrays import CIFAR10_MEAN, CIFAR10_STD, ArrayDataset
from ddpjob.train.tensorloader import TensorLoader
from ddpjob.train.data import (PluginLoader, build_datasets, eval_batches, load_cifar10, load_plugin,
                         make_synthetic, make_train_loader)
from ddpjob.errors import DDPJobError, UsageError
from ddpjob.train.fixtures import (FOLDER, LABEL_NAMES, _py2_pickle, write_cifar10_archive,
                             write_cifar10_folder)

torch.set_num_threads(1)
MEAN = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)
STD = torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """Undo the normalization (exact for values that came from uint8 pixels)."""
    return ((x.float() * STD + MEAN) * 255).round().to(torch.uint8)


def random_set(n: int, seed: int = 0) -> ArrayDataset:
    g = torch.Generator().manual_seed(seed)
    return ArrayDataset(torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g),
                        torch.arange(n) % 10, tuple(LABEL_NAMES))


def loader(ds: ArrayDataset, **kw) -> TensorLoader:
    args = dict(micro_batch=4, accumulation=1, rank=0, world_size=1, seed=0, augment=True)
    args.update(kw)
    return TensorLoader(ds, **args)


# ------------------------------------------------------------------------------ the reader
@pytest.mark.parametrize("str_keys", [False, True])
def test_reads_fixture_in_real_format(tmp_path, str_keys):
    folder = write_cifar10_folder(tmp_path, n_train=53, n_test=17, seed=3, str_keys=str_keys)
    train, test = load_cifar10(tmp_path, train=True), load_cifar10(tmp_path, train=False)
    assert train.images.shape == (53, 3, 32, 32) and train.images.dtype == torch.uint8
    assert train.labels.dtype == torch.int64 and len(test) == 17
    assert train.classes == LABEL_NAMES
    # The fixture is make_synthetic's data: bytes keys (py2 pickles) and str keys read the same.
    ref = make_synthetic(53, 3, split="train")
    assert torch.equal(train.images, ref.images) and torch.equal(train.labels, ref.labels)
    # root may also be the cifar-10-batches-py folder itself
    assert torch.equal(load_cifar10(folder, train=False).images, test.images)


def test_pixel_layout_is_rgb_planes(tmp_path):
    folder = write_cifar10_folder(tmp_path, n_train=5, n_test=2)
    row = (np.arange(3072) % 251).astype(np.uint8)
    (folder / "test_batch").write_bytes(_py2_pickle({b"data": np.stack([row, row[::-1]]),
                                                     b"labels": [4, 9]}))
    ds = load_cifar10(tmp_path, train=False)
    c, y, x = 1, 5, 7  # green plane, row 5, column 7
    assert ds.images[0, c, y, x] == (c * 1024 + y * 32 + x) % 251
    assert torch.equal(ds.images[1].reshape(-1), torch.from_numpy(row[::-1].copy()))
    assert ds.labels.tolist() == [4, 9]


def test_reads_extracted_archive(tmp_path):
    archive = write_cifar10_archive(tmp_path, n_train=10, n_test=5)
    assert archive.name == "cifar-10-python.tar.gz"
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        assert f"{FOLDER}/data_batch_5" in names and f"{FOLDER}/batches.meta" in names
        tar.extractall(tmp_path / "out", filter="data")
    assert len(load_cifar10(tmp_path / "out", train=True)) == 10


def rewrite(folder, name, obj) -> None:
    (folder / name).write_bytes(obj if isinstance(obj, bytes) else pickle.dumps(obj))


GOOD = {b"data": np.zeros((4, 3072), np.uint8), b"labels": [0, 1, 2, 3]}


@pytest.mark.parametrize("name, content, expected", [
    ("data_batch_3", None, "data_batch_3 is missing"),
    ("batches.meta", None, "batches.meta is missing"),
    ("test_batch", b"this is not a pickle\n", "not a readable CIFAR-10 pickle"),
    ("test_batch", "truncate", "not a readable CIFAR-10 pickle"),
    ("test_batch", {b"data": print}, "references builtins.print"),
    ("test_batch", [1, 2, 3], "holds a list, expected a dict"),
    ("test_batch", {b"data": GOOD[b"data"]}, "has no 'labels' entry"),
    ("batches.meta", {b"num_vis": 3072}, "has no 'label_names' entry"),
    ("test_batch", {**GOOD, b"data": np.zeros((4, 3072), np.float32)}, "expected uint8 of shape (N, 3072)"),
    ("test_batch", {**GOOD, b"data": np.zeros((4, 1024), np.uint8)}, "expected uint8 of shape (N, 3072)"),
    ("test_batch", {**GOOD, b"data": [[0] * 3072] * 4}, "'data' is a list"),
    ("test_batch", {**GOOD, b"labels": [0, 1, 2, 10]}, "labels range over [0, 10], expected 0..9"),
    ("test_batch", {**GOOD, b"labels": [0, -1, 2, 3]}, "labels range over [-1, 3]"),
    ("test_batch", {**GOOD, b"labels": [0, 1, 2]}, "3 labels for 4 images"),
    ("test_batch", {**GOOD, b"labels": ["a", "b", "c", "d"]}, "expected a list of integers"),
])
def test_malformed_files_give_one_line_errors(tmp_path, name, content, expected):
    folder = write_cifar10_folder(tmp_path, n_train=10, n_test=4, learnable=False)
    if content is None:
        (folder / name).unlink()
    elif content == "truncate":
        raw = (folder / name).read_bytes()
        (folder / name).write_bytes(raw[:len(raw) // 2])
    else:
        rewrite(folder, name, content)
    with pytest.raises(DDPJobError) as err:
        load_cifar10(tmp_path, train=name != "test_batch")
    line = err.value.line()
    assert expected in line and "\n" not in line and err.value.exit_code == 1
    assert "Hint:" in line and "ddpjob data cifar10 --root" in line


def test_missing_root_or_folder_hints_at_data_command(tmp_path):
    with pytest.raises(DDPJobError, match="does not exist") as err:
        load_cifar10(tmp_path / "nowhere", train=True)
    assert f"ddpjob data cifar10 --root {tmp_path / 'nowhere'}" in err.value.line()
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(b"x")
    with pytest.raises(DDPJobError, match="has no cifar-10-batches-py folder") as err:
        load_cifar10(tmp_path, train=True)
    assert "extracts the archive that is already there" in err.value.line()


# -------------------------------------------------------------------------- synthetic set
def test_synthetic_is_deterministic_balanced_and_shaped():
    a, b = make_synthetic(1003, seed=7), make_synthetic(1003, seed=7)
    assert a.images.shape == (1003, 3, 32, 32) and a.images.dtype == torch.uint8
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    counts = torch.bincount(a.labels, minlength=10)
    assert counts.max() - counts.min() <= 1 and len(a.classes) == 10
    assert not torch.equal(make_synthetic(1003, seed=8).images, a.images)
    assert 60 < a.images.float().std() < 90  # uses the pixel range without saturating it
    small = make_synthetic(20, seed=0, num_classes=4, image_size=16)
    assert small.images.shape == (20, 3, 16, 16) and small.labels.max() == 3


def test_synthetic_train_and_test_share_classes_but_not_samples():
    # Class = texture, so a translation-invariant feature (FFT magnitude) + nearest class mean
    # fitted on "train" must transfer to "test" of the same seed, and fail on another seed.
    def feats(ds):
        return torch.fft.fft2(ds.images.float()).abs().view(len(ds), -1).log1p()

    train = make_synthetic(600, 0)
    f = feats(train)
    means = torch.stack([f[train.labels == k].mean(0) for k in range(10)])

    def acc(ds):
        return (torch.cdist(feats(ds), means).argmin(1) == ds.labels).float().mean().item()

    test = make_synthetic(300, 0, split="test")
    assert not torch.equal(test.images, train.images[:300])
    assert acc(test) > 0.7
    assert acc(make_synthetic(300, 1, split="test")) < 0.3


def test_synthetic_rejects_bad_arguments():
    with pytest.raises(UsageError):
        make_synthetic(0, 0)
    with pytest.raises(UsageError, match="'val'"):
        make_synthetic(10, 0, split="val")


# ------------------------------------------------------------------------- TensorLoader
def collect(ld: TensorLoader, epoch: int, start: int = 0):
    return [[(x.clone(), y.clone()) for x, y in step] for step in ld.batches(epoch, start)]


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        len(s) == len(t) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(s, t))
        for s, t in zip(a, b))


def test_order_is_a_function_of_seed_and_epoch():
    ds = random_set(64)
    a = collect(loader(ds), 0)
    assert same(a, collect(loader(ds), 0))
    assert not same(a, collect(loader(ds), 1))
    assert not same(a, collect(loader(ds, seed=1), 0))
    assert len(a) == 16 and len(a[0]) == 1 and a[0][0][0].shape == (4, 3, 32, 32)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("augment", [False, True])
def test_the_gpu_paths_one_copy_gives_the_same_batches(monkeypatch, channels_last, augment):
    """On a GPU a step's ids, crop offsets and flips travel in one pinned tensor and the flip is a
    selection (tests/ranks/test_gpu.py compares on a real GPU); here the same arithmetic runs on
    the CPU, with the pinned copy replaced by the tensor itself (pinning needs CUDA)."""
    import ddpjob.train.tensorloader as loader_mod

    ds = random_set(48)
    kw = dict(micro_batch=3, accumulation=2, rank=1, world_size=2, channels_last=channels_last, augment=augment)
    one_copy = loader(ds, **kw)
    one_copy._one_copy = True
    monkeypatch.setattr(loader_mod, "_pinned_to", lambda t, device: t.contiguous())
    for epoch in (0, 1):
        assert same(collect(one_copy, epoch), collect(loader(ds, **kw), epoch))
    assert same(collect(one_copy, 1, 3), collect(loader(ds, **kw), 1, 3))


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("accum", [1, 2])
def test_every_sample_once_per_epoch_across_ranks(world, accum):
    ds = random_set(75)  # not a multiple of the global batch: the tail is dropped
    loaders = [loader(ds, micro_batch=3, accumulation=accum, rank=r, world_size=world)
               for r in range(world)]
    g = 3 * accum * world
    assert all(ld.steps_per_epoch == 75 // g for ld in loaders)
    for epoch in (0, 1):
        seen = []
        for ld in loaders:
            for step, micro in enumerate(ld.batches(epoch)):
                ids = ld.sample_ids(epoch, step)
                assert len(micro) == accum
                # the yielded labels are those of the samples sample_ids names
                assert torch.equal(torch.cat([y for _, y in micro]), ds.labels[ids])
                seen += ids.tolist()
        assert len(seen) == len(set(seen)) == (75 // g) * g


def test_same_sample_same_pixels_at_any_world_size_and_accumulation():
    ds = random_set(96)

    def by_sample(world, accum):
        out = {}
        for r in range(world):
            ld = loader(ds, micro_batch=4, accumulation=accum, rank=r, world_size=world, seed=5)
            for step, micro in enumerate(ld.batches(2)):
                ids = ld.sample_ids(2, step).view(accum, 4)
                for k, (x, _) in enumerate(micro):
                    for i, sid in enumerate(ids[k].tolist()):
                        out[sid] = (step, x[i])
        return out

    # Same global batch G = 16: every sample gets the same step and the same pixels.
    ref = by_sample(1, 4)
    assert len(ref) == 96
    for world, accum in ((2, 2), (4, 1)):
        other = by_sample(world, accum)
        assert other.keys() == ref.keys()
        assert all(other[k][0] == ref[k][0] and torch.equal(other[k][1], ref[k][1]) for k in ref)
    # G = 8: world 2 x accum 1 equals world 1 x accum 2
    a, b = by_sample(2, 1), by_sample(1, 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k][1], b[k][1]) for k in a)
    assert not all(torch.equal(a[k][1], ref[k][1]) for k in a)  # another G is another stream


def test_start_step_resumes_the_identical_stream():
    ld = loader(random_set(80), micro_batch=4, accumulation=2, world_size=2, rank=1)
    full = collect(ld, 3)
    fresh = loader(random_set(80), micro_batch=4, accumulation=2, world_size=2, rank=1)
    assert same(collect(fresh, 3, start=4), full[4:])
    assert collect(fresh, 3, start=ld.steps_per_epoch) == []


def test_crop_is_a_shift_of_the_padded_image_and_flip_a_mirror():
    ds = random_set(64)
    padded = torch.nn.functional.pad(ds.images, (4, 4, 4, 4))
    ld = loader(ds, micro_batch=64)
    (x, _), = next(iter(ld.batches(0)))
    u = to_uint8(x)
    shifts, flips = set(), 0
    for i, sid in enumerate(ld.sample_ids(0, 0).tolist()):
        found = [(dy, dx, f) for dy in range(9) for dx in range(9) for f in (0, 1)
                 if torch.equal(u[i], (lambda c: c.flip(2) if f else c)(
                     padded[sid, :, dy:dy + 32, dx:dx + 32]))]
        assert len(found) == 1, f"sample {sid}: not a (flipped) crop of its padded image"
        shifts.add(found[0][:2])
        flips += found[0][2]
    assert len(shifts) > 20 and 16 < flips < 48  # per-sample randomness, not per-batch


def test_channels_last_and_dtype_give_the_same_values():
    ds = random_set(32)
    (x, y), = next(iter(loader(ds, micro_batch=32).batches(1)))
    (xc, yc), = next(iter(loader(ds, micro_batch=32, channels_last=True).batches(1)))
    assert xc.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous(
        memory_format=torch.channels_last)
    assert torch.equal(x, xc) and torch.equal(y, yc)
    (xb, _), = next(iter(loader(ds, micro_batch=32, dtype=torch.bfloat16).batches(1)))
    assert xb.dtype == torch.bfloat16 and torch.allclose(xb.float(), x, atol=0.02)
    (xn, _), = next(iter(loader(ds, micro_batch=32, augment=False, channels_last=True).batches(1)))
    assert xn.is_contiguous(memory_format=torch.channels_last)


def test_normalization_values_without_augmentation():
    ds = random_set(16)
    ld = loader(ds, micro_batch=16, augment=False)
    (x, y), = next(iter(ld.batches(0)))
    ids = ld.sample_ids(0, 0)
    expected = (ds.images[ids].float() / 255 - MEAN) / STD
    assert x.dtype == torch.float32 and torch.allclose(x, expected, atol=1e-5)
    assert torch.equal(y, ds.labels[ids])
    black = ArrayDataset(torch.zeros(2, 3, 32, 32, dtype=torch.uint8), torch.zeros(2, dtype=torch.long), ("a",))
    (xb, _), = next(iter(loader(black, micro_batch=2, augment=False).batches(0)))
    assert torch.allclose(xb[0, :, 0, 0], -MEAN.view(3) / STD.view(3), atol=1e-6)


def test_loader_rejects_impossible_sizes():
    with pytest.raises(DDPJobError, match="fewer than one global batch of 64"):
        loader(random_set(50), micro_batch=16, world_size=2, accumulation=2, rank=0)
    with pytest.raises(UsageError):
        loader(random_set(50), rank=2, world_size=2)
    with pytest.raises(DDPJobError, match="expected uint8"):
        ArrayDataset(torch.zeros(2, 3, 4, 4), torch.zeros(2, dtype=torch.long), ("a",))


# --------------------------------------------------------------------------------- eval
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_eval_shards_cover_every_sample_exactly_once(world):
    ds = random_set(10)
    labels, images = [], []
    for r in range(world):
        for x, y in eval_batches(ds, batch_size=3, rank=r, world_size=world, device="cpu"):
            labels.append(y)
            images.append(x)
    assert torch.equal(torch.cat(labels), ds.labels)
    assert torch.equal(to_uint8(torch.cat(images)), ds.images)


def test_eval_with_more_ranks_than_samples_and_plugin_sets():
    ds = random_set(2)
    shards = [list(eval_batches(ds, batch_size=4, rank=r, world_size=3, device="cpu")) for r in range(3)]
    assert sum(len(s) for s in shards) == 2 and sum(len(y) for s in shards for _, y in s) == 2
    plugin = torch.utils.data.TensorDataset(ds.images, ds.labels)
    got = [y for r in range(3) for _, y in eval_batches(plugin, batch_size=4, rank=r, world_size=3,
                                                         device="cpu")]
    assert torch.equal(torch.cat(got), ds.labels)


# ------------------------------------------------------------------------------ plugins
def test_load_plugin_resolves_and_explains_failures():
    assert load_plugin("ddpjob.train.data:make_synthetic") is make_synthetic
    assert load_plugin("ddpjob.train.tensorloader:TensorLoader.sample_ids") is TensorLoader.sample_ids
    with pytest.raises(DDPJobError, match="cannot import no_such_pkg_xyz") as err:
        load_plugin("no_such_pkg_xyz.mod:fn")
    assert "PYTHONPATH" in err.value.line()
    with pytest.raises(DDPJobError, match="has no attribute 'nope'"):
        load_plugin("ddpjob.train.data:nope")
    with pytest.raises(DDPJobError, match="is a tuple, expected a function"):
        load_plugin("ddpjob.train.data:CIFAR10_MEAN")
    with pytest.raises(UsageError, match="package.module:function"):
        load_plugin("ddpjob.train.data.make_synthetic")


def test_plugin_module_with_import_error(tmp_path, monkeypatch):
    (tmp_path / "broken_plugin_mod.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(DDPJobError, match="RuntimeError: boom"):
        load_plugin("broken_plugin_mod:fn")


def uint8_set(n: int) -> torch.utils.data.TensorDataset:
    ds = random_set(n)
    return torch.utils.data.TensorDataset(ds.images, torch.arange(n))  # label = sample id


def test_plugin_loader_shards_resumes_and_normalizes():
    ds = uint8_set(50)
    world, micro, accum = 2, 3, 2
    seen = []
    for r in range(world):
        ld = PluginLoader(ds, micro_batch=micro, accumulation=accum, rank=r, world_size=world, seed=1)
        assert ld.steps_per_epoch == (50 // world) // (micro * accum) == 4
        steps = list(ld.batches(0))
        assert len(steps) == 4 and all(len(s) == accum for s in steps)
        for step in steps:
            for x, y in step:
                assert x.dtype == torch.float32 and torch.equal(to_uint8(x), ds.tensors[0][y])
                seen += y.tolist()
        resumed = list(ld.batches(0, start_step=2))
        assert all(torch.equal(a[1], b[1]) for s, t in zip(resumed, steps[2:]) for a, b in zip(s, t))
        other_epoch = [y for s in ld.batches(1) for _, y in s]
        assert not torch.equal(torch.cat(other_epoch), torch.cat([y for s in steps for _, y in s]))
    assert len(seen) == len(set(seen)) == 48
    with pytest.raises(DDPJobError, match="fewer than one global batch of 64"):
        PluginLoader(uint8_set(50), micro_batch=8, accumulation=2, rank=0, world_size=4, seed=0)


class SignalProbe(torch.utils.data.Dataset):
    """label = 1 when the process serving the item ignores SIGUSR2 and SIGTERM."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        ignored = (signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
                   and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN)
        return torch.zeros(3, 2, 2), int(ignored)


def test_plugin_workers_ignore_preemption_signals():
    kw = dict(micro_batch=2, accumulation=1, rank=0, world_size=1, seed=0)
    in_main = [y for s in PluginLoader(SignalProbe(), **kw).batches(0) for _, y in s]
    assert torch.cat(in_main).tolist() == [0] * 8  # the main process keeps its handlers
    in_worker = [y for s in PluginLoader(SignalProbe(), num_workers=1, **kw).batches(0) for _, y in s]
    assert torch.cat(in_worker).tolist() == [1] * 8


def test_build_datasets_dispatch(tmp_path, monkeypatch):
    train, test = build_datasets("synthetic", "unused", seed=2, synthetic_train=40, synthetic_test=12)
    assert (len(train), len(test)) == (40, 12) and torch.equal(
        train.images, make_synthetic(40, 2).images)
    write_cifar10_folder(tmp_path / "c", n_train=10, n_test=5)
    train, test = build_datasets("cifar10", str(tmp_path / "c"), 0, 1, 1)
    assert (len(train), len(test)) == (10, 5)
    assert isinstance(make_train_loader(train, micro_batch=2, accumulation=1, rank=0, world_size=1,
                                        seed=0, augment=True, num_workers=3), TensorLoader)
    (tmp_path / "my_ds_plugin.py").write_text(
        "import torch\n"
        "def build(root, train):\n"
        "    n = 12 if train else 6\n"
        "    return torch.utils.data.TensorDataset(torch.zeros(n, 3, 8, 8), torch.zeros(n, dtype=torch.long))\n"
        "def bad(root, train):\n"
        "    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    train, test = build_datasets("my_ds_plugin:build", "r", 0, 1, 1)
    assert (len(train), len(test)) == (12, 6)
    assert isinstance(make_train_loader(train, micro_batch=2, accumulation=1, rank=0, world_size=1,
                                        seed=0, augment=True), PluginLoader)
    with pytest.raises(DDPJobError, match="returned a int"):
        build_datasets("my_ds_plugin:bad", "r", 0, 1, 1)
    with pytest.raises(UsageError, match="expected cifar10, synthetic"):
        build_datasets("imagenet", "r", 0, 1, 1)


def test_seed_mixing_is_stable():
    # Changing mix would silently change every run's data order and break exact resumes.
    assert arrays.mix(0, "perm", 0) == arrays.mix(0, "perm", 0) != arrays.mix(0, "perm", 1)
    assert arrays.mix(1, "perm", 0) == 644165939665651323
