"""Sharded state (`[train] strategy = "fsdp"`): a state dict's models and optimizers through
torch.distributed.checkpoint (DCP), every rank writing its own shards into the store's staging
folder, next to the `<key>.pt` files state.py writes for the rest.

The rule (docs/api.md): with fsdp, every nn.Module and every torch.optim.Optimizer of the state
goes through DCP, each optimizer together with the module that holds all its parameters
(optimizer state keyed by parameter name, so it reshards to any world size). A save leaves
`__<rank>_0.distcp` per rank and `dcp.metadata` (rank 0; DCP's own name is the hidden
`.metadata`), which the store's manifest lists and hashes like any file. Loading reshards:
each rank reads the byte ranges its shards need. Nothing is unpickled freely: the metadata
goes through an unpickler that knows DCP's few metadata classes, plain values through
torch.load(weights_only=True), and both only after rank 0 verified every sha256 (state.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpjob.errors import DDPJobError
from ddpjob.node import dist, modelsync
from ddpjob.store import manifest
from ddpjob.store.snapshot import snapshot_tree

METADATA = manifest.DCP_METADATA

# DCP's readers and writers (store/dcpio.py) are imported when a sharded state is saved or
# loaded: torch.distributed.checkpoint imports DTensor and its ops, ~2 s of every rank's start
# (and so of every restart after a crash) that a DDP job never uses.
_HINT = "build the optimizer after `model = job.wrap(model)` and put both in the state dict"


@dataclass
class Unit:
    """One model of the state and the optimizers over its parameters."""

    key: str
    module: nn.Module
    optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)


def units(state: Mapping[str, Any]) -> list[Unit]:
    """The state's models with their optimizers (values already unwrapped: statecheck._target).
    Every rank computes the same answer, so an error here stops every rank alike."""
    found = [Unit(k, v) for k, v in state.items() if isinstance(v, nn.Module)]
    owner = {id(p): u for u in found for p in u.module.parameters()}
    for key, opt in state.items():
        if not isinstance(opt, torch.optim.Optimizer):
            continue
        mine = {id(owner[id(p)]) if id(p) in owner else None
                for g in opt.param_groups for p in g["params"]}
        if None in mine:
            raise DDPJobError(f"optimizer '{key}' has parameters that no model of the state holds, "
                              "expected with train.strategy = \"fsdp\" an optimizer over one model's "
                              "parameters (fully_shard replaces them: one built before wrap() "
                              "holds the old ones)", _HINT)
        if len(mine) > 1:
            raise DDPJobError(f"optimizer '{key}' spans the parameters of several models of the state, "
                              "expected one model per optimizer with train.strategy = \"fsdp\"",
                              "give each model its own optimizer, or make them one module")
        unit = next(u for u in found if id(u) in mine)
        unit.optimizers[key] = opt
    return found


def keys(found: list[Unit]) -> list[str]:
    return sorted([u.key for u in found] + [k for u in found for k in u.optimizers])


def state_dicts(found: list[Unit]) -> dict[str, Any]:
    """{key: its state dict} as DCP saves it: DTensors stay sharded, optimizer state is keyed
    by parameter name. An optimizer without state yet (a resume before the first step) is
    given zero state by torch (one step at lr 0, exact), so that the load has tensors to fill."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict[str, Any] = {}
    for u in found:
        out[u.key] = get_model_state_dict(u.module)
        for key, opt in u.optimizers.items():
            out[key] = get_optimizer_state_dict(u.module, opt)
    return out


def set_state_dicts(found: list[Unit], loaded: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    for u in found:
        set_model_state_dict(u.module, loaded[u.key])
        for key, opt in u.optimizers.items():
            set_optimizer_state_dict(u.module, opt, loaded[key])


def stage(state: dict[str, Any], staging: Path) -> dict[str, Any]:
    """A host copy of the state dicts, DTensors wrapped again around copies of their local
    shards: after this, training may change the parameters while a background thread writes
    the copy. On CPU the copies come from the store's pooled buffers (snapshot.py): DCP's own
    stager allocates every tensor afresh (and deep-copies each DTensor first), 8x slower. GPU
    shards take DCP's stager: DTensor.from_local would move a host copy back to the GPU."""
    from torch.distributed.tensor import DTensor

    from ddpjob.store.dcpio import writer

    flat: list[Any] = []
    _walk(state, flat)
    if any(isinstance(t, DTensor) and t.to_local().device.type != "cpu" for t in flat):
        return dict(writer(staging).stage(state))
    return _rewrap(state, snapshot_tree(_locals(state)))


def _walk(o: Any, out: list[Any]) -> None:
    if isinstance(o, dict):
        for v in o.values():
            _walk(v, out)
    elif isinstance(o, (list, tuple)):
        for v in o:
            _walk(v, out)
    else:
        out.append(o)


def _locals(o: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(o, DTensor):
        return o.to_local()
    if isinstance(o, dict):
        return {k: _locals(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return type(o)(_locals(v) for v in o)
    return o


def _rewrap(orig: Any, copy: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(orig, DTensor):  # same mesh, placements and global shape: no communication
        return DTensor.from_local(copy, orig.device_mesh, orig.placements, run_check=False,
                                  shape=orig.shape, stride=orig.stride())
    if isinstance(orig, dict):
        return {k: _rewrap(v, copy[k]) for k, v in orig.items()}
    if isinstance(orig, (list, tuple)):
        return type(orig)(_rewrap(v, c) for v, c in zip(orig, copy))
    return copy


def save(staging: Path, state: dict[str, Any], control: dist.Control, rank: int,
         known: Callable[[dict[str, tuple[int, int, str]]], None], *, background: bool = False) -> None:
    """Every rank: its shards into `staging`, rank 0 also dcp.metadata. Then each rank hashes
    the files it wrote (in parallel, from the page cache) and rank 0 gets every digest for the
    manifest (`known`), instead of reading all ranks' shards back alone. Collective."""
    from ddpjob.store.dcpio import planner, writer

    group = control.io_group()
    modelsync.dcp_save(state, writer(staging), planner(), group,
                       what="the sharded checkpoint's write", background=background)
    mine = sorted(staging.glob(f"__{rank}_*.distcp")) + ([staging / METADATA] if rank == 0 else [])
    digests = {p.name: (p.stat().st_size, p.stat().st_mtime_ns, manifest.sha256(p)) for p in mine}
    every = dist.all_gather_object(digests, what="the sharded checkpoint's digests", group=group,
                                   background=background)
    if rank == 0:
        known({name: d for part in every for name, d in part.items()})


def load(path: Path, found: list[Unit], control: dist.Control) -> None:
    """Every rank: the checkpoint's models and optimizers into `found`, resharded to this world
    size. Collective; call it only on a checkpoint whose manifest verified."""
    from ddpjob.store.dcpio import LoadPlanner, Reader

    target = state_dicts(found)
    try:
        modelsync.dcp_load(target, Reader(path), LoadPlanner(), control.io_group(),
                           what="the sharded checkpoint's read")
        set_state_dicts(found, target)
    except DDPJobError:
        raise
    except Exception as err:  # DCP wraps each rank's failure (a shape, a missing key) its own way
        raise DDPJobError(f"the sharded state {', '.join(keys(found))} in {path} does not fit this "
                          f"run's models and optimizers ({' '.join(str(err).split())[:300]})",
                          "resume with the same model and optimizer setup, or use a new run dir") from None
