"""TensorLoader: the whole training set on the device as uint8 (airbench-style); a step is
index arithmetic plus one gather, crop and flip included, so batches cost next to nothing
(bench P3: 37x the seeds' PIL pipeline on one core; P8: 540k images/s into an H100).
data.py builds the data sets and picks this loader for in-memory ones."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from ddpjob.errors import DDPJobError, UsageError
from ddpjob.train.arrays import CIFAR10_MEAN, CIFAR10_STD, ArrayDataset, Batch, Normalizer, mix

PAD = 4  # random-crop padding, as in the standard CIFAR recipe


class TensorLoader:
    """The whole set lives on `device` as uint8; a step is index arithmetic plus one gather.

    Step s of epoch e uses the global batch perm(seed, e)[s*G:(s+1)*G], G = micro_batch *
    world_size * accumulation, viewed as [accumulation, world_size, micro_batch]: micro-step k
    of rank r is [k, r]. Crop offsets and flips are drawn for the whole global batch from a
    generator seeded by (seed, e, s), so a sample is augmented identically at any world size.
    """

    def __init__(self, ds: ArrayDataset, *, micro_batch: int, accumulation: int, rank: int,
                 world_size: int, seed: int, augment: bool, device: torch.device | str = "cpu",
                 channels_last: bool = False, mean: Sequence[float] = CIFAR10_MEAN,
                 std: Sequence[float] = CIFAR10_STD, dtype: torch.dtype = torch.float32) -> None:
        if micro_batch < 1 or accumulation < 1 or not 0 <= rank < world_size:
            raise UsageError(f"micro_batch={micro_batch}, accumulation={accumulation}, rank={rank}"
                             f", world_size={world_size}: expected positive sizes, 0 <= rank < world")
        self.micro_batch, self.accumulation = micro_batch, accumulation
        self.rank, self.world_size, self.seed, self.augment = rank, world_size, seed, augment
        self.global_batch = micro_batch * world_size * accumulation
        self.steps_per_epoch = len(ds) // self.global_batch  # drop_last: equal steps on all ranks
        if self.steps_per_epoch == 0:
            raise DDPJobError(f"the training set has {len(ds)} samples, fewer than one global batch "
                              f"of {self.global_batch} (batch_size {micro_batch} x world size "
                              f"{world_size} x accumulation {accumulation})",
                              "lower train.batch_size or the accumulation, or use more data")
        self.device = torch.device(device)
        self._one_copy = self.device.type == "cuda"  # a step's indices reach the GPU in one pinned copy
        self.channels_last, self.dtype = channels_last, dtype
        _, c, h, w = ds.images.shape
        self._shape = (c, h, w)
        images = F.pad(ds.images, (PAD,) * 4) if augment else ds.images  # pad once, on the host
        if channels_last:  # store NHWC: batches come out channels_last with no permuting copy
            images = images.permute(0, 2, 3, 1)
        self._images = images.contiguous().to(self.device)  # the one host->device copy
        self._labels = ds.labels.to(self.device)
        self._normalize = Normalizer(mean, std, c, self.device, dtype, channels_last)
        hp, wp = h + 2 * PAD, w + 2 * PAD
        self._sample_stride = c * hp * wp
        # Every crop row is a run of pixels starting somewhere in the flat padded set (w values
        # of one channel, or w*c interleaved values when NHWC). This overlapping view has one
        # row per start, so a whole augmented batch is ONE index_select: a memcpy per row,
        # ~10x faster on a CPU than advanced indexing or a per-element gather.
        if channels_last:
            run, self._pitch, self._px = w * c, wp * c, c
            offsets = torch.arange(h) * wp * c
        else:
            run, self._pitch, self._px = w, wp, 1
            offsets = ((torch.arange(c) * hp * wp).view(c, 1) + (torch.arange(h) * wp)).view(-1)
        flat = self._images.view(-1)
        self._runs = flat.as_strided((flat.numel() - run + 1, run), (1, 1))
        self._row_offsets = offsets.view(1, -1).to(self.device)
        self._perm_epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def _epoch_perm(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(mix(self.seed, "perm", epoch))
            self._perm, self._perm_epoch = torch.randperm(len(self._labels), generator=g), epoch
        return self._perm

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        """[G, ...] global-batch tensor -> [accumulation, micro_batch, ...] for this rank."""
        return t.view(self.accumulation, self.world_size, self.micro_batch, *t.shape[1:])[:, self.rank]

    def sample_ids(self, epoch: int, step: int) -> torch.Tensor:
        """Global indices of the samples this rank uses at `step`, in micro-batch order."""
        g = self.global_batch
        return self._split(self._epoch_perm(epoch)[step * g:(step + 1) * g]).reshape(-1).clone()

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[list[Batch]]:
        """For each optimizer step from `start_step`: `accumulation` (images, labels) pairs."""
        perm, g = self._epoch_perm(epoch), self.global_batch
        for step in range(start_step, self.steps_per_epoch):
            ids = self._split(perm[step * g:(step + 1) * g])
            if self.augment:  # all of this is host-side arithmetic on small CPU tensors
                gen = torch.Generator().manual_seed(mix(self.seed, "augment", epoch, step))
                shift = self._split(torch.randint(0, 2 * PAD + 1, (g, 2), generator=gen))
                flip = self._split(torch.randint(0, 2, (g,), generator=gen, dtype=torch.bool))
                if self._one_copy:
                    yield self._augmented_on_device(ids, shift, flip)
                else:
                    yield [self._augmented(ids[k], shift[k], flip[k]) for k in range(self.accumulation)]
            elif self._one_copy:
                ids = _pinned_to(ids, self.device)
                yield [self._plain(ids[k]) for k in range(self.accumulation)]
            else:
                yield [self._plain(ids[k]) for k in range(self.accumulation)]

    def _stored(self, u: torch.Tensor) -> torch.Tensor:
        """Flat rows of a batch -> [B, C, H, W], or [B, H, W, C] when stored NHWC."""
        c, h, w = self._shape
        return u.view(-1, h, w, c) if self.channels_last else u.view(-1, c, h, w)

    def _nchw(self, u: torch.Tensor) -> torch.Tensor:
        """Stored layout -> logical [B, C, H, W] (a free permute: channels_last strides)."""
        return u.permute(0, 3, 1, 2) if self.channels_last else u

    def _plain(self, ids: torch.Tensor) -> Batch:
        ids = ids.to(self.device, non_blocking=True)
        u = self._nchw(self._stored(self._images.index_select(0, ids)))
        return self._normalize(u), self._labels.index_select(0, ids)

    def _augmented_on_device(self, ids: torch.Tensor, shift: torch.Tensor, flip: torch.Tensor) -> list[Batch]:
        """The step's micro-batches with ONE host->device copy: ids, crop offsets and flips
        packed into one pinned tensor. A copy from pageable memory (or a `nonzero` on the
        device) waits for the GPU, so the host could no longer queue work ahead of it: on an
        H100 the per-step copies cost ResNet-18 at batch 128 about a fifth of its images/s.
        The same pixels as `_augmented` (a flip by selection instead of index_copy_)."""
        packed = _pinned_to(torch.cat([ids.unsqueeze(-1), shift, flip.unsqueeze(-1).long()], -1), self.device)
        width_dim = 2 if self.channels_last else 3
        out = []
        for k in range(self.accumulation):
            ids_k, dy, dx, flip_k = packed[k].unbind(1)
            u = self._crop(ids_k, dy, dx)
            u = torch.where(flip_k.bool().view(-1, 1, 1, 1), u.flip(width_dim), u)
            out.append((self._normalize(self._nchw(u)), self._labels.index_select(0, ids_k)))
        return out

    def _crop(self, ids: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
        """The padded images `ids` cropped at (dy, dx): one gather of crop rows, stored layout."""
        starts = ids * self._sample_stride + dy * self._pitch + dx * self._px
        return self._stored(self._runs.index_select(0, (starts.view(-1, 1) + self._row_offsets).view(-1)))

    def _augmented(self, ids: torch.Tensor, shift: torch.Tensor, flip: torch.Tensor) -> Batch:
        """The CPU path (everything already on the host): flips copied in place, only those drawn."""
        u = self._crop(ids, shift[:, 0], shift[:, 1])
        flipped = flip.nonzero().view(-1)
        if len(flipped):
            width_dim = 2 if self.channels_last else 3
            u.index_copy_(0, flipped, u.index_select(0, flipped).flip(width_dim))
        return self._normalize(self._nchw(u)), self._labels.index_select(0, ids)


def _pinned_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor onto a GPU without waiting for it: through page-locked memory,
    whose asynchronous copy the caching host allocator keeps alive until it is done."""
    return t.contiguous().pin_memory().to(device, non_blocking=True)
