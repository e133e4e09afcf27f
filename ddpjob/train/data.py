"""Datasets and loaders: what the trainer iterates over.

build_datasets -> (CIFAR-10 pickle reader | synthetic set | "pkg.mod:fn" plugin) -> TensorLoader
(tensorloader.py: the whole set on the device as uint8, airbench-style) or PluginLoader
(DataLoader) -> lists of
`accumulation` normalized micro-batches per optimizer step. For a given global batch size the
data (order and augmentation) depends only on (seed, epoch, step), never on how it is split
over ranks and accumulation, so a job resumes bit-exactly in data at another world size.
The in-memory set (ArrayDataset), the normalization and the seed mixer both loaders use are in
arrays.py.
"""

from __future__ import annotations

import importlib
import pickle
import re
import shlex
import signal
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ddpjob.errors import DDPJobError, UsageError
from ddpjob.train.arrays import CIFAR10_MEAN, CIFAR10_STD, ArrayDataset, Batch, Normalizer, mix
from ddpjob.train.tensorloader import TensorLoader


# ---------------------------------------------------------------- CIFAR-10 python-pickle reader
def _numpy_globals() -> dict[tuple[str, str], Any]:
    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core -> numpy._core
    import codecs

    allowed: dict[tuple[str, str], Any] = {("numpy", "ndarray"): np.ndarray,
                                           ("numpy", "dtype"): np.dtype,
                                           ("_codecs", "encode"): codecs.encode}
    for mod in ("numpy.core", "numpy._core"):  # py2 files say numpy.core; numpy 2 writes _core
        allowed[(f"{mod}.multiarray", "_reconstruct")] = core.multiarray._reconstruct
        allowed[(f"{mod}.numeric", "_frombuffer")] = core.numeric._frombuffer
    return allowed


class _DataUnpickler(pickle.Unpickler):
    """Only plain containers and numpy arrays: a data file cannot name any other callable."""

    _allowed = _numpy_globals()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"it references {module}.{name}, which a CIFAR-10 "
                                         "data file never does") from None


def _cifar_hint(root: Path) -> str:
    return f"run `ddpjob data cifar10 --root {shlex.quote(str(root))}` on the login node"


def _read_pickle(path: Path, root: Path) -> dict[Any, Any]:
    if not path.is_file():
        raise DDPJobError(f"CIFAR-10 file {path} is missing", _cifar_hint(root))
    try:
        # Why pickle at all: CIFAR-10 ships only as pickles (from a trusted, checksum-verified
        # archive); still, the restricted unpickler refuses anything but containers and numpy
        # arrays. encoding="bytes": the files were written by Python 2 (keys are byte strings).
        with open(path, "rb") as f:
            obj = _DataUnpickler(f, encoding="bytes").load()
    except Exception as exc:  # any failure while unpickling means a truncated or foreign file
        raise DDPJobError(f"{path} is not a readable CIFAR-10 pickle ({type(exc).__name__}: {exc})",
                          f"the file is truncated or corrupt: delete {path.parent} and "
                          + _cifar_hint(root)) from None
    if not isinstance(obj, dict):
        raise DDPJobError(f"{path} holds a {type(obj).__name__}, expected a dict", _cifar_hint(root))
    return {(k.decode("latin1") if isinstance(k, bytes) else k): v for k, v in obj.items()}


def _field(d: dict[Any, Any], key: str, path: Path, root: Path) -> Any:
    if key not in d:
        keys = ", ".join(sorted(map(str, d)))[:200]
        raise DDPJobError(f"{path} has no '{key}' entry (found: {keys})",
                          "this is not a CIFAR-10 python-version file; " + _cifar_hint(root))
    return d[key]


def _find_folder(root: Path) -> Path:
    for candidate in (root / "cifar-10-batches-py", root):
        if (candidate / "batches.meta").is_file() or candidate.name == "cifar-10-batches-py" \
                and candidate.is_dir():
            return candidate
    found = "does not exist" if not root.exists() else "has no cifar-10-batches-py folder"
    hint = _cifar_hint(root)
    if (root / "cifar-10-python.tar.gz").is_file():
        hint += " (it verifies and extracts the archive that is already there)"
    raise DDPJobError(f"CIFAR-10 data root {root} {found}", hint)


def load_cifar10(root: str | Path, train: bool) -> ArrayDataset:
    """Read the official python-version CIFAR-10 files (`root` or `root/cifar-10-batches-py`)."""
    root = Path(root)
    folder = _find_folder(root)
    meta = _read_pickle(folder / "batches.meta", root)
    names = tuple(n.decode() if isinstance(n, bytes) else str(n)
                  for n in _field(meta, "label_names", folder / "batches.meta", root))
    files = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
    datas, labels = [], []
    for name in files:
        path = folder / name
        d = _read_pickle(path, root)
        data, lab = _field(d, "data", path, root), _field(d, "labels", path, root)
        if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2
                and data.shape[1] == 3 * 32 * 32):
            what = (f"{data.dtype} array of shape {data.shape}" if isinstance(data, np.ndarray)
                    else type(data).__name__)
            raise DDPJobError(f"{path}: 'data' is a {what}, expected uint8 of shape (N, 3072)",
                              "the file is corrupt; " + _cifar_hint(root))
        lab = np.asarray(lab)
        if lab.ndim != 1 or (lab.size and lab.dtype.kind not in "iu"):
            raise DDPJobError(f"{path}: 'labels' is {lab.dtype} of shape {lab.shape}, expected a "
                              "list of integers", "the file is corrupt; " + _cifar_hint(root))
        if len(lab) != len(data):
            raise DDPJobError(f"{path}: {len(lab)} labels for {len(data)} images, expected one "
                              "label per image", "the file is truncated; " + _cifar_hint(root))
        if lab.size and (lab.min() < 0 or lab.max() >= len(names)):
            raise DDPJobError(f"{path}: labels range over [{lab.min()}, {lab.max()}], expected "
                              f"0..{len(names) - 1} ({len(names)} label_names in batches.meta)",
                              "the file is corrupt; " + _cifar_hint(root))
        datas.append(data)
        labels.append(lab.astype(np.int64))
    images = torch.from_numpy(np.concatenate(datas)).view(-1, 3, 32, 32)  # R, G, B planes
    return ArrayDataset(images, torch.from_numpy(np.concatenate(labels)), names)


# --------------------------------------------------------------------------- synthetic set
def make_synthetic(n: int, seed: int, num_classes: int = 10, image_size: int = 32, *,
                   split: str = "train") -> ArrayDataset:
    """A learnable CIFAR-shaped set without files: each class is a colour texture.

    Every class has a random 8x8 colour motif (from `seed` only, so "train" and "test" share
    them) tiled over the image; a sample is the tiling at a random phase with random contrast,
    a weaker second class's texture mixed in, a colour cast and pixel noise. Class averages
    are nearly flat, so pixel templates fail (nearest class mean ~30% on 10 classes), while
    cnn_tiny reaches ~90% test accuracy in 300 steps of batch 128. Labels are balanced
    (class counts differ by at most one).
    """
    if n < 1 or num_classes < 2 or image_size < 8:
        raise UsageError(f"synthetic set of n={n}, num_classes={num_classes}, image_size="
                         f"{image_size}, expected n >= 1, num_classes >= 2, image_size >= 8",
                         "e.g. synthetic_train = 4096")
    if split not in ("train", "test"):
        raise UsageError(f"synthetic split {split!r}, expected 'train' or 'test'")
    g = torch.Generator().manual_seed(mix(seed, "synthetic-prototypes", num_classes, image_size))
    period = 8
    coarse = torch.randn(num_classes, 3, 4, 4, generator=g)
    motif = F.interpolate(coarse, size=(period, period), mode="bicubic", align_corners=False)
    reps = (image_size + period) // period + 1
    canvas = motif.repeat(1, 1, reps, reps)[:, :, :image_size + period, :image_size + period]
    canvas = canvas / canvas.std(dim=(1, 2, 3), keepdim=True) * 40.0
    windows = canvas.unfold(2, image_size, 1).unfold(3, image_size, 1)  # [K, 3, p+1, p+1, S, S]
    g = torch.Generator().manual_seed(mix(seed, "synthetic-samples", split, num_classes, image_size))
    labels = (torch.arange(n) % num_classes)[torch.randperm(n, generator=g)]
    images = torch.empty(n, 3, image_size, image_size, dtype=torch.uint8)
    for lo in range(0, n, 2048):  # chunks bound the float working memory
        y = labels[lo:lo + 2048]
        b = len(y)
        shift = torch.randint(0, period, (4, b), generator=g)
        other = (y + torch.randint(1, num_classes, (b,), generator=g)) % num_classes
        x = windows[y, :, shift[0], shift[1]] * (0.6 + 0.8 * torch.rand(b, 1, 1, 1, generator=g))
        x += 0.6 * windows[other, :, shift[2], shift[3]]
        x += 128 + 20 * torch.randn(b, 3, 1, 1, generator=g)
        x += 40 * torch.randn(b, 3, image_size, image_size, generator=g)
        images[lo:lo + b] = x.round_().clamp_(0, 255).to(torch.uint8)
    return ArrayDataset(images, labels, tuple(f"class{k}" for k in range(num_classes)))


def eval_batches(ds: Any, *, batch_size: int, rank: int, world_size: int,
                 device: torch.device | str, channels_last: bool = False,
                 mean: Sequence[float] = CIFAR10_MEAN, std: Sequence[float] = CIFAR10_STD,
                 dtype: torch.dtype = torch.float32, same_count: bool = False) -> Iterator[Batch]:
    """This rank's contiguous share [r*N//W, (r+1)*N//W) of an eval set: no padding, no
    duplicates, so all-reduced correct/total counts equal a one-process evaluation exactly.
    `same_count`: every rank yields the same number of batches (the largest share's count,
    batches split evenly), because a sharded model's forward is a collective."""
    n, device = len(ds), torch.device(device)
    lo, hi = rank * n // world_size, (rank + 1) * n // world_size
    largest = -(-n // world_size)  # ceil: the last rank's share
    count = -(-(largest if same_count else hi - lo) // batch_size)
    bounds = [lo + (hi - lo) * k // max(count, 1) for k in range(count + 1)] if same_count else \
        [min(lo + k * batch_size, hi) for k in range(count + 1)]
    if isinstance(ds, ArrayDataset):
        normalize = Normalizer(mean, std, ds.images.shape[1], device, dtype, channels_last)
        for i, j in zip(bounds, bounds[1:]):
            u = ds.images[i:j].to(device, non_blocking=True)
            yield (normalize(u),
                   ds.labels[i:j].to(device, non_blocking=True))
        return
    if same_count:
        for i, j in zip(bounds, bounds[1:]):
            x, y = torch.utils.data.default_collate([ds[k] for k in range(i, j)])
            yield _plugin_batch(x, y, device, channels_last, mean, std, dtype)
        return
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(ds, range(lo, hi)),
                                         batch_size=batch_size, shuffle=False)
    for x, y in loader:
        yield _plugin_batch(x, y, device, channels_last, mean, std, dtype)


# --------------------------------------------------------------------------------- plugins
_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", re.ASCII)


def load_plugin(spec: str) -> Callable[..., Any]:
    """Resolve "package.module:function" (the attribute may be dotted) to a callable."""
    if not _SPEC.fullmatch(spec):
        raise UsageError(f"plugin {spec!r} is not of the form \"package.module:function\"",
                         "e.g. \"mypkg.datasets:build\"")
    mod_name, attr = spec.split(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        raise DDPJobError(f"plugin {spec!r}: cannot import {mod_name} ({exc})",
                          "install the package in the job's environment or add its folder to "
                          "PYTHONPATH") from None
    except Exception as exc:  # the plugin's own import-time failure: show it in one line
        raise DDPJobError(f"plugin {spec!r}: importing {mod_name} failed with "
                          f"{type(exc).__name__}: {exc}", "fix the module (try `python -c "
                          f"'import {mod_name}'`)") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise DDPJobError(f"plugin {spec!r}: {mod_name} has no attribute {attr!r}",
                              "check the name after the colon")
        obj = getattr(obj, part)
    if not callable(obj):
        raise DDPJobError(f"plugin {spec!r}: {attr} is a {type(obj).__name__}, expected a function",
                          "point at a function (or class) that builds the object")
    return obj


def _ignore_preemption_signals(_worker_id: int) -> None:
    # Workers inherit the trainer's flag-only handlers; only the main process may react to
    # SLURM's requeue/stop signals (it checkpoints, then shuts the workers down itself).
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _plugin_batch(x: torch.Tensor, y: torch.Tensor, device: torch.device, channels_last: bool,
                  mean: Sequence[float], std: Sequence[float], dtype: torch.dtype) -> Batch:
    x = x.to(device, non_blocking=True)
    if x.dtype == torch.uint8:  # raw pixels: normalize like the fast path
        x = Normalizer(mean, std, x.shape[1], device, dtype, channels_last)(x)
    else:  # the plugin's transforms already produced float tensors
        x = x.to(dtype=dtype, memory_format=torch.channels_last if channels_last
                 else torch.contiguous_format)
    return x, torch.as_tensor(y).to(device, torch.int64, non_blocking=True)


class PluginLoader:
    """A plain DataLoader over a plugin's map-style Dataset, ordered by ddpjob's public
    StepSampler, with TensorLoader's interface: the order is a function of (seed, epoch, step)
    only, so a resume (also at another world size) continues the same sample sequence.
    The plugin's own transforms do augmentation (`augment` is ignored)."""

    def __init__(self, ds: torch.utils.data.Dataset, *, micro_batch: int, accumulation: int,
                 rank: int, world_size: int, seed: int, augment: bool = False,
                 device: torch.device | str = "cpu", channels_last: bool = False,
                 mean: Sequence[float] = CIFAR10_MEAN, std: Sequence[float] = CIFAR10_STD,
                 dtype: torch.dtype = torch.float32, num_workers: int = 0) -> None:
        from ddpjob.node.sampler import StepSampler

        self.ds, self.micro_batch, self.accumulation = ds, micro_batch, accumulation
        self.device = torch.device(device)
        self.num_workers, self.channels_last, self.dtype = num_workers, channels_last, dtype
        self.mean, self.std, self.seed = mean, std, seed
        self.global_batch = micro_batch * world_size * accumulation
        n = len(ds)  # type: ignore[arg-type]
        if n < self.global_batch:
            raise DDPJobError(f"the training set has {n} samples, fewer than one global batch of "
                              f"{self.global_batch}", "lower train.batch_size or the accumulation, "
                              "or use more data")
        # In workers, StepSampler's batches seed each sample's random transforms from
        # (seed, epoch, sample): a resume reproduces them.
        self.sampler = StepSampler(n, self.global_batch, seed, accumulation=accumulation,
                                   rank=rank, world_size=world_size)
        self.steps_per_epoch = self.sampler.steps_per_epoch

    def __len__(self) -> int:
        return self.steps_per_epoch

    def sample_ids(self, epoch: int, step: int) -> torch.Tensor:
        return self.sampler.indices(epoch * self.steps_per_epoch + step)

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[list[Batch]]:
        # Resume skips indices, not loaded batches: nothing before start_step is read.
        self.sampler.set_step(epoch * self.steps_per_epoch + start_step)
        # The DataLoader draws its workers' base seed from this generator, not the global RNG,
        # whose state a resumed run restores exactly and must not be shifted.
        gen = torch.Generator().manual_seed(mix(self.seed, "workers", epoch))
        loader: torch.utils.data.DataLoader = torch.utils.data.DataLoader(
            self.ds, batch_sampler=self.sampler, num_workers=self.num_workers, generator=gen,
            worker_init_fn=_ignore_preemption_signals, pin_memory=self.device.type == "cuda")
        it = iter(loader)
        for _ in range(start_step, self.steps_per_epoch):
            step = []
            for _ in range(self.accumulation):
                x, y = next(it)
                step.append(_plugin_batch(x, y, self.device, self.channels_last, self.mean,
                                          self.std, self.dtype))
            yield step


def make_train_loader(ds: Any, *, num_workers: int = 0, **kwargs: Any) -> TensorLoader | PluginLoader:
    """TensorLoader for in-memory sets (cifar10, synthetic, ArrayDataset plugins), else PluginLoader."""
    if isinstance(ds, ArrayDataset):
        return TensorLoader(ds, **kwargs)
    return PluginLoader(ds, num_workers=num_workers, **kwargs)


def build_datasets(dataset: str, root: str, seed: int, synthetic_train: int,
                   synthetic_test: int) -> tuple[Any, Any]:
    """(train, test) for `data.dataset`: "cifar10", "synthetic" or "pkg.mod:fn".

    A plugin is called as fn(root=root, train=True|False) and returns an ArrayDataset (fast
    path) or a torch Dataset of (image tensor, label) pairs.
    """
    if dataset == "cifar10":
        return load_cifar10(root, train=True), load_cifar10(root, train=False)
    if dataset == "synthetic":
        return (make_synthetic(synthetic_train, seed, split="train"),
                make_synthetic(synthetic_test, seed, split="test"))
    if ":" not in dataset:
        raise UsageError(f"data.dataset is {dataset!r}, expected cifar10, synthetic or "
                         "\"package.module:function\"", "e.g. dataset = \"cifar10\"")
    fn = load_plugin(dataset)
    sets = []
    for train in (True, False):
        ds = fn(root=root, train=train)
        if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__") or isinstance(ds, ArrayDataset)):
            raise DDPJobError(f"dataset plugin {dataset!r} returned a {type(ds).__name__}, expected "
                              "a torch Dataset of (image, label) or an ArrayDataset",
                              "return e.g. a torchvision dataset with ToTensor()")
        sets.append(ds)
    return sets[0], sets[1]
