"""Host snapshots of checkpoint state and their background writes (runner/trainer side).

snapshot() copies nested dicts/lists/tuples of tensors to CPU (reusing pooled buffers), so the
training step blocks only for the copy; AsyncWrite runs a background write in a thread (an async
save's sink and agreement, pipeline.py; an in-memory snapshot, memsnap.py).
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import torch

from ddpjob.errors import DDPJobError


class AsyncWrite:
    """A background write of snapshotted files; `wait()` re-raises whatever the writer raised."""

    def __init__(self, work: Callable[[], None], where: Path) -> None:
        self._where = where
        self._error: BaseException | None = None
        # daemon: nothing is committed before wait() returned, so a write cut short by the
        # process exiting leaves only a staging folder, which prune() removes later.
        self._thread = threading.Thread(target=self._run, args=(work,), name="ddpjob-ckpt", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as err:  # handed to the waiting thread, never lost
            self._error = err

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise DDPJobError(f"checkpoint write into {self._where} still running after {timeout:g} s",
                              "the checkpoint filesystem is slow or hung: check it on this node (df, mount)")
        if self._error is not None:
            raise self._error


def snapshot_tree(obj: Any) -> Any:
    sources: dict[int, torch.Tensor] = {}  # by id: a tensor seen twice (tied weights) stays shared
    _walk_tensors(obj, lambda t: sources.setdefault(id(t), t.detach()))
    plain = [t for t in sources.values() if not t.is_cuda and t.layout == torch.strided and not t.is_quantized]
    pooled = iter(_POOL.take(tuple((t.shape, _strides(t), t.dtype) for t in plain)) or [])
    pin = torch.cuda.is_available()
    memo: dict[int, torch.Tensor] = {}
    cuda_devices = set()
    for key, src in sources.items():  # same order as `plain`, so pooled buffers line up
        if src.layout != torch.strided or src.is_quantized:
            memo[key] = src.to("cpu", copy=True)
            continue
        dst = None if src.is_cuda else next(pooled, None)
        if dst is None:
            dst = torch.empty_strided(src.shape, _strides(src), dtype=src.dtype, pin_memory=pin and src.is_cuda)
        memo[key] = dst.copy_(src, non_blocking=src.is_cuda)
        if src.is_cuda:
            cuda_devices.add(src.device)
    for device in cuda_devices:  # non_blocking copies must land before the caller mutates
        torch.cuda.synchronize(device)
    return _rebuild(obj, memo)


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    """The copy's strides: the source's own memory layout (channels_last stays channels_last)
    where it is dense, else contiguous. A restored optimizer state must match its parameters'
    layout: CUDA's fused SGD/Adam refuse a momentum buffer whose strides differ from the
    parameter's (found resuming a channels_last model from an in-memory snapshot on an H100)."""
    return tuple(torch.empty_like(t, device="meta").stride())


def _rebuild(o: Any, memo: dict[int, torch.Tensor]) -> Any:
    # A module function, not a closure: a recursive closure is a reference cycle that would keep
    # the copies (and so the pool's buffers) alive until the cyclic GC happens to run.
    if isinstance(o, torch.Tensor):
        return memo[id(o)]
    if isinstance(o, dict):
        return (OrderedDict if isinstance(o, OrderedDict) else dict)((k, _rebuild(v, memo)) for k, v in o.items())
    if isinstance(o, list):
        return [_rebuild(v, memo) for v in o]
    if type(o) is tuple:
        return tuple(_rebuild(v, memo) for v in o)
    return copy.deepcopy(o)


def _walk_tensors(o: Any, visit: Callable[[torch.Tensor], Any]) -> None:
    if isinstance(o, torch.Tensor):
        visit(o)
    elif isinstance(o, dict):
        for v in o.values():
            _walk_tensors(v, visit)
    elif isinstance(o, list) or type(o) is tuple:
        for v in o:
            _walk_tensors(v, visit)


class _SnapshotPool:
    """CPU buffers reused by snapshot(). Fresh memory costs a page fault per 4 KiB (~22k for
    resnet18 + SGD momentum: 100-1000 ms on a busy VM); reused memory costs none (~10 ms).
    A buffer set goes out again only when nothing but the pool holds any of its storages (the
    write finished and the caller dropped the snapshot). At most 2 sets per layout (shapes,
    strides and dtypes) and 8 layouts are kept. Pinned copies are left to torch's caching host allocator."""

    SETS_PER_LAYOUT, LAYOUTS = 2, 8  # layouts: e.g. model.pt, optimizer.pt, trainer.pt, rank-R.pt

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sets: OrderedDict[tuple, list[list[torch.Tensor]]] = OrderedDict()
        self._enabled: bool | None = None  # decided on first use

    def take(self, layout: tuple) -> list[torch.Tensor] | None:
        with self._lock:
            if self._enabled is None:
                self._enabled = _use_count_works()
            if not self._enabled or not layout:
                return None
            sets = self._sets.setdefault(layout, [])
            self._sets.move_to_end(layout)
            while len(self._sets) > self.LAYOUTS:
                self._sets.popitem(last=False)
            chosen = next((b for b in sets if all(_use_count(t) == 2 for t in b)), None)
            if chosen is None:
                if len(sets) >= self.SETS_PER_LAYOUT:
                    return None  # the caller keeps old snapshots alive: do not grow
                chosen = [torch.empty_strided(shape, strides, dtype=dtype) for shape, strides, dtype in layout]
                sets.append(chosen)
            # Hand out views: each holds a reference to its storage, which is what marks it busy.
            return [t.view(t.shape) for t in chosen]


def _use_count(t: torch.Tensor) -> int:
    """References to t's storage, counting the temporary one made to ask (so 2 = only t)."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


def _use_count_works() -> bool:
    """The pool relies on a private torch counter: check it behaves before trusting it."""
    try:
        t = torch.empty(1)
        alone = _use_count(t)
        view = t.view(1)
        busy = _use_count(t)
        del view
        return (alone, busy, _use_count(t)) == (2, 3, 2)
    except (AttributeError, RuntimeError, TypeError):
        return False


_POOL = _SnapshotPool()
