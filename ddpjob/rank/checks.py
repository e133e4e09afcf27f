"""The mistakes ddpjob can see in a user's own loop, said once instead of passing in silence.

A new user writing a loop from docs/api.md left an LR scheduler, a plain DistributedSampler or a
GradScaler out of `state`, made a DataLoader iterator before `job.resume()`, or put a rank's own
generator into `state` (rank 0's is saved and loaded into every rank): each run finished, and
the resumed result was not what an uninterrupted run gives. `job.resume()` looks once, at its
first call; `job.log()` refuses values that are not one number and says a second record of a
kind for one step; the first checkpoint says the [user] keys the script never read (Job).
"""

from __future__ import annotations

import difflib
import gc
import hashlib
import io
import numbers
from collections.abc import Iterable
from typing import Any

from ddpjob.errors import DDPJobError


def state_gaps(state: dict[str, Any]) -> list[str]:
    """One warning line per gap in `state` that would make a resume differ."""
    import torch
    from torch.amp import GradScaler
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
    loaders, iterators, scalers, optimizers = [], [], [], []
    for obj in gc.get_objects():
        kind = type(obj)
        if issubclass(kind, DataLoader):
            loaders.append(obj)
        elif issubclass(kind, _BaseDataLoaderIter):
            iterators.append(obj)
        elif issubclass(kind, GradScaler):
            scalers.append(obj)
        elif issubclass(kind, torch.optim.Optimizer):
            optimizers.append(obj)
    # A GradScaler (fp16 autocast) outside state restarts its scale at 65536 after every resume:
    # the first steps' gradients overflow and are skipped again. One held by a state value (an
    # attribute of the user's own trainer object) is saved with it.
    held_ids = {id(v) for v in values} | {id(a) for v in values for a in getattr(v, "__dict__", {}).values()}
    # An optimizer over the model's parameters outside state restarts with no moments (and its
    # lr schedule's position) at every resume: the first steps after it are not the run's.
    params = {id(p) for v in values if isinstance(v, torch.nn.Module) for p in v.parameters()}
    for opt in optimizers:
        if id(opt) not in held_ids and any(id(p) in params for g in opt.param_groups for p in g["params"]):
            out.append(f"an optimizer ({type(opt).__name__}) over the model's parameters is not in state: after a "
                       "resume it starts again without its moments and step counts. Hint: add it, e.g. "
                       "state['optimizer'] = optimizer")
            break
    for scaler in scalers:
        if scaler.is_enabled() and id(scaler) not in held_ids:
            out.append("an enabled GradScaler is not in state: after a resume its scale starts again "
                       "at its initial value and the first steps are skipped as overflows again. "
                       "Hint: add it, e.g. state['scaler'] = scaler")
            break
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


def own_digests(state: dict[str, Any]) -> dict[str, str]:
    """sha256 of the state_dict() of each of the user's own objects in `state` (not torch's or
    ddpjob's, whose state every rank holds alike): gathered from every rank at the first
    resume(), where one that differs between the ranks is a rank's own object that the
    checkpoint would save from rank 0 only (differing())."""
    import torch

    out = {}
    for key, obj in state.items():
        module = type(obj).__module__ or ""
        if module.split(".")[0] in ("torch", "ddpjob") or not callable(getattr(obj, "state_dict", None)):
            continue
        if not callable(getattr(obj, "load_state_dict", None)) or isinstance(obj, torch.nn.Module):
            continue
        buf = io.BytesIO()
        try:
            torch.save(obj.state_dict(), buf)
        except Exception:  # noqa: BLE001 - not saveable: the checkpoint says so in its own line
            continue
        out[key] = hashlib.sha256(buf.getvalue()).hexdigest()
    return out


def differing(every_rank: list[dict[str, str]]) -> list[str]:
    """One warning line per state key whose own_digests() differ between the ranks."""
    out = []
    for key in every_rank[0]:
        other = [r for r, d in enumerate(every_rank) if d.get(key) != every_rank[0][key]]
        if other:
            out.append(f"state[{key!r}] differs between the ranks (rank {other[0]}'s is not rank 0's): a "
                       "checkpoint saves rank 0's and loads it into every rank, so after a resume every "
                       "rank continues from rank 0's. Hint: a rank's own object (a generator seeded by "
                       f"rank): state[{key!r}] = ddpjob.PerRank(obj), saved and resumed per rank")
    return out


def unread_user_keys(keys: Iterable[str], read: set[str]) -> str | None:
    """The warning line for [user] keys the script never read by its first checkpoint, with the
    key it did ask for that each is closest to (a typo: `leraning_rate` for `learning_rate`)."""
    unread = [k for k in keys if k not in read]
    if not unread:
        return None
    said = []
    for key in unread:
        near = difflib.get_close_matches(key, sorted(read), n=1, cutoff=0.75)
        said.append(f"{key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    return (f"[user] {', '.join(said)} {'was' if len(unread) == 1 else 'were'} never read by the script "
            "before its first checkpoint: a typo trains at the script's default. Hint: correct the name "
            "in the job file or drop it; a key used only later (after training): read it before the loop")
