"""StepSampler: the data order as a pure function of (seed, epoch, optimizer step), for any
map-style dataset and a plain `torch.utils.data.DataLoader` (`batch_sampler=`).

Why not DistributedSampler: its order depends on the world size and it has no position, so a
resumed job either replays or skips data, and a job resumed on fewer nodes sees other samples.
Here the GLOBAL batch of step g is fixed by (seed, g) alone; the ranks only split it. Resumed at
step g with any world size that divides the global batch, every sample is still seen exactly
once per epoch.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ddpjob.errors import DDPJobError


def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.blake2b(f"stepsampler/{seed}/{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _sample_seed(seed: int, epoch: int, index: int) -> int:
    digest = hashlib.blake2b(f"stepsampler/{seed}/{epoch}/{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


class _Batch(list[int]):
    """A batch of sample indices that seeds a DataLoader worker's RNGs (torch, random, numpy)
    from (seed, epoch, index) just before the worker reads each sample. Why: a worker's streams
    start from a seed drawn when the iterator is made and advance with every batch it reads, so
    after a resume random augmentations (RandomCrop, flips) would differ from the uninterrupted
    run. In the main process (num_workers=0) nothing is seeded: job.resume() restores that RNG."""

    def __init__(self, ids: list[int], seed: int, epoch: int) -> None:
        super().__init__(ids)
        self.seed, self.epoch = seed, epoch

    def __iter__(self) -> Iterator[int]:
        if torch.utils.data.get_worker_info() is None:
            yield from list.__iter__(self)
            return
        for index in list.__iter__(self):
            s = _sample_seed(self.seed, self.epoch, index)
            torch.manual_seed(s)
            random.seed(s)
            np.random.seed(s)
            yield index


class StepSampler:
    """Yields this rank's indices for optimizer step g, g+1, ... (`accumulation` micro-batches
    per step when asked for). Iteration starts at the step set by `load_state_dict` or
    `set_step` (0 for a fresh run) and never ends: take one batch per step with `next()`.

    The last `dataset_len % global_batch` samples of each epoch's permutation are dropped (every
    step has the same global batch). Iterate the DataLoader after `job.resume(...)`.
    """

    def __init__(self, dataset_len: int, global_batch: int, seed: int = 0, shuffle: bool = True,
                 *, accumulation: int = 1, rank: int | None = None,
                 world_size: int | None = None) -> None:
        if rank is None or world_size is None:
            import torch.distributed as tdist  # read only: the group is owned by ddpjob.init()

            live = tdist.is_available() and tdist.is_initialized()
            rank = (tdist.get_rank() if live else 0) if rank is None else rank
            world_size = (tdist.get_world_size() if live else 1) if world_size is None else world_size
        for what, value, least in (("dataset_len", dataset_len, 1), ("global_batch", global_batch, 1),
                                   ("accumulation", accumulation, 1), ("world_size", world_size, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise DDPJobError(f"StepSampler {what} is {value!r}, expected an integer >= {least}",
                                  f"pass a positive {what}")
        if not 0 <= rank < world_size:
            raise DDPJobError(f"StepSampler rank {rank} is outside world size {world_size}, "
                              "expected 0 <= rank < world_size", "leave rank and world_size unset")
        if global_batch % (world_size * accumulation):
            raise DDPJobError(
                f"global batch {global_batch} cannot be split over {world_size} rank(s) x "
                f"accumulation {accumulation}, expected a multiple of {world_size * accumulation}",
                "choose a global batch divisible by ranks x accumulation (or another node count)")
        if global_batch > dataset_len:
            raise DDPJobError(f"global batch {global_batch} is larger than the dataset "
                              f"({dataset_len} samples), expected at most one batch per epoch",
                              "lower the global batch")
        self.dataset_len, self.global_batch, self.seed = dataset_len, global_batch, int(seed)
        self.shuffle, self.accumulation = bool(shuffle), accumulation
        self.rank, self.world_size = rank, world_size
        self.steps_per_epoch = dataset_len // global_batch
        self.per_rank = global_batch // world_size
        self._step = 0
        self._perm: tuple[int, torch.Tensor] | None = None

    # ---- the order: pure functions of (seed, epoch, step) -----------------------------------
    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def global_indices(self, step: int) -> torch.Tensor:
        """Every rank's samples of optimizer step `step`, in rank order (int64)."""
        epoch, i = divmod(step, self.steps_per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
                perm = torch.randperm(self.dataset_len, generator=gen)
            else:
                perm = torch.arange(self.dataset_len)
            self._perm = (epoch, perm)
        return self._perm[1][i * self.global_batch:(i + 1) * self.global_batch]

    def indices(self, step: int) -> torch.Tensor:
        """This rank's share of step `step`: a contiguous slice of the global batch."""
        return self.global_indices(step)[self.rank * self.per_rank:(self.rank + 1) * self.per_rank]

    def __iter__(self) -> Iterator[list[int]]:
        step = self._step  # read when the DataLoader's iterator is made: after resume()
        micro = self.per_rank // self.accumulation
        while True:
            ids, epoch = self.indices(step).tolist(), self.epoch_of(step)
            for k in range(self.accumulation):
                yield _Batch(ids[k * micro:(k + 1) * micro], self.seed, epoch)
            step += 1

    # ---- position and checkpoint state -------------------------------------------------------
    def set_step(self, step: int) -> None:
        """The optimizer step the next iterator starts at (ddpjob's Job calls it at each save)."""
        self._step = int(step)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step, "dataset_len": self.dataset_len,
                "global_batch": self.global_batch, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("dataset_len", "global_batch", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise DDPJobError(
                    f"the checkpoint's data order has {key} = {state[key]!r}, this run's "
                    f"StepSampler has {getattr(self, key)!r}, expected the same (the data order "
                    "would change mid-run)",
                    f"build the StepSampler with {key}={state[key]!r}, or start a new run dir")
        self._step = int(state.get("step", 0))
