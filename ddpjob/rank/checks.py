"""The mistakes ddpjob can see in a user's own loop, said once instead of passing in silence.

A new user writing a loop from docs/api.md left an LR scheduler or a plain DistributedSampler
out of `state`, or made a DataLoader iterator before `job.resume()`: each run finished, and the
resumed result was not what an uninterrupted run gives (a warmup restarted, the data order began
again at epoch 0, the first batches came from the old position). `job.resume()` looks once, at
its first call; `job.log()` refuses values that are not one number.
"""

from __future__ import annotations

import gc
import numbers
from typing import Any

from ddpjob.errors import DDPJobError


def state_gaps(state: dict[str, Any]) -> list[str]:
    """One warning line per gap in `state` that would make a resume differ."""
    import torch
    from torch.optim.lr_scheduler import LRScheduler
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    from ddpjob.node.sampler import StepSampler

    values = list(state.values())
    out: list[str] = []
    # An LR scheduler wraps its optimizer's step (torch's patch_track_step_called): one in the
    # process whose optimizer is in state, but which is not, restarts from its first epoch.
    held = {id(v.optimizer) for v in values if isinstance(v, LRScheduler)}
    for name, opt in state.items():
        if isinstance(opt, torch.optim.Optimizer) and hasattr(opt.step, "_wrapped_by_lr_sched") \
                and id(opt) not in held:
            out.append(f"state[{name!r}] is an optimizer with an LR scheduler, but the scheduler "
                       "is not in state: after a resume its schedule starts again (a warmup "
                       "repeats). Hint: add it, e.g. state['scheduler'] = scheduler")
    samplers_ok = any(isinstance(v, StepSampler) for v in values)
    # The DataLoaders and their live iterators, found once through the garbage collector (they
    # are not in state, which is the mistake): ~0.1 s at a start with a ResNet-50 loaded. By
    # type(), not isinstance(): that would read __class__ of deprecated module proxies (warnings).
    loaders, iterators = [], []
    for obj in gc.get_objects():
        kind = type(obj)
        if issubclass(kind, DataLoader):
            loaders.append(obj)
        elif issubclass(kind, _BaseDataLoaderIter):
            iterators.append(obj)
    if not samplers_ok:
        for loader in loaders:
            sampler = getattr(loader, "sampler", None)
            if isinstance(loader.batch_sampler, StepSampler):
                continue
            # shuffled: a training loader (an evaluation's sequential order has nothing to resume)
            if isinstance(sampler, RandomSampler) or (isinstance(sampler, DistributedSampler)
                                                      and getattr(sampler, "shuffle", False)):
                name = type(sampler).__name__
                out.append(f"a DataLoader draws its batches from a {name}, which has no position to "
                           "resume from: after a resume the data order starts again at epoch 0. "
                           "Hint: use batch_sampler=ddpjob.StepSampler(...) and put it in state")
                break
    for it in iterators:
        if isinstance(getattr(it, "_index_sampler", None), StepSampler) and getattr(it, "_num_workers", 0) > 0:
            out.append("a DataLoader iterator with workers was made before job.resume(): its first "
                       "batches come from the position before the resume. Hint: call iter(loader) "
                       "after job.resume(), e.g. inside the epoch loop")
            break
    return out


def scalars(values: dict[str, Any]) -> None:
    """job.log() takes one number per name (a Python number, a one-element tensor or array)."""
    for name, v in values.items():
        if isinstance(v, (numbers.Number, str)) and not isinstance(v, complex):
            continue
        numel = getattr(v, "numel", None) or getattr(v, "size", None)
        count = numel() if callable(numel) else numel
        if isinstance(count, int) and count == 1 and hasattr(v, "item"):
            continue
        what = (f"a {type(v).__name__} of {count} values" if isinstance(count, int)
                else f"a {type(v).__name__}")
        raise DDPJobError(f"job.log({name}=...) got {what}, expected one number per name",
                          f"log a reduction such as {name}={name}.mean(), or one name per value")
