"""Sharded training (`[train] strategy = "fsdp"`): how `job.wrap()` applies FSDP2.

Called by Job.wrap (rank/job.py) once the model is on its device: rank 0's weights go to every rank (as
DDP does), then `fully_shard` cuts each unit's parameters into one shard per rank: every child
module that holds parameters (torchtitan style: one all-gather per block in the forward, one
reduce-scatter per block in the backward) and the root for whatever is left. The checkpoints of
such a model go through DCP (store/sharded.py).
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import torch
from torch import nn

from ddpjob.node import modelsync

# containers without a forward of their own: FSDP gathers a unit's parameters in its forward
# hooks, so a ModuleList as a unit would never be gathered; its children are the units
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def is_sharded(obj: Any) -> bool:
    """A module whose parameters are DTensors (what fully_shard leaves), or an optimizer over
    such parameters."""
    # No DTensor exists before its module is imported (fully_shard imports it); importing it
    # here would cost every DDP rank's start ~1 s (DTensor's ops), so every restart too.
    loaded = sys.modules.get("torch.distributed.tensor")
    DTensor = getattr(loaded, "DTensor", None)
    if DTensor is None:
        return False
    if isinstance(obj, nn.Module):
        params = list(obj.parameters())
    elif isinstance(obj, torch.optim.Optimizer):
        params = [p for g in obj.param_groups for p in g["params"]]
    else:
        return False
    return any(isinstance(p, DTensor) for p in params)


def mixed_precision(amp: str) -> Any:
    """The policy from `train.amp`. Only an explicit "bf16" (or "fp16", which validate.py refuses
    with fsdp) casts: "auto" is the built-in trainer's autocast choice and depends on the
    hardware, and a user script that never asked for low precision must not get it from the
    strategy (fp32 on CPU with amp off). When the compute is cast, gradients are still reduced
    in fp32 (torchtitan's default): a bf16 sum over many ranks loses too much."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)


def units(model: nn.Module) -> list[nn.Module]:
    """The submodules sharded as units of their own: each direct child with parameters (a
    ModuleList's/ModuleDict's children instead of the container). A child sharing a parameter
    with another one (tied weights: embedding and head) stays in the root's unit: one parameter
    cannot live in two units."""
    found: list[nn.Module] = []
    for child in model.children():
        found += list(child.children()) if isinstance(child, _CONTAINERS) else [child]
    found = [m for m in found if next(m.parameters(), None) is not None]
    owners = Counter(id(p) for m in found for p in m.parameters())
    return [m for m in found if all(owners[id(p)] == 1 for p in m.parameters())]


def shard(model: nn.Module, amp: str) -> nn.Module:
    """`model` (on its device) sharded in place over the job's ranks; returns it. Its class
    becomes FSDP<Class>, its parameters DTensors: build the optimizer after this."""
    from torch.distributed.fsdp import fully_shard

    if is_sharded(model):
        return model  # wrapped twice (e.g. the trainer and a plugin): nothing more to cut
    modelsync.broadcast_module(model)
    policy = mixed_precision(amp)
    for unit in units(model):
        fully_shard(unit, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model
