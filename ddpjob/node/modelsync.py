"""A model's whole state across the ranks: rank 0's weights everywhere at the start (FSDP),
its buffers everywhere before an evaluation, a sharded model's state saved and loaded with DCP
at each checkpoint and gathered whole at the end. The owner of those collectives, as dist.py is
of the rest (its guard bounds each one); callers reach them only through the helpers below.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
import torch.distributed as tdist

from ddpjob.node import dist

# DCP warns at every save and load of a single process that it assumes one process: ddpjob asks
# for exactly that (no_dist with one rank). Process-wide: catch_warnings is not thread-safe.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")


def broadcast_buffers(model: torch.nn.Module) -> None:
    """Rank 0's buffers (BatchNorm statistics) everywhere. DDP broadcasts them at the start of
    each forward, so after the last step every other rank still holds its own update: without
    this, the ranks would evaluate slightly different models."""
    if dist.group_active():
        with dist.guard("the broadcast of rank 0's buffers"):
            for buf in model.buffers():
                tdist.broadcast(buf, src=0)


def broadcast_module(model: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank, as DDP does when it wraps a model: FSDP's
    fully_shard cuts each rank's own tensors, so ranks that built different weights (another
    seed) would otherwise train shards of different models."""
    if dist.group_active():
        with dist.guard("the broadcast of rank 0's weights"), torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                tdist.broadcast(t.data, src=0)


def dcp_save(state: dict[str, Any], writer: Any, planner: Any, group: Any, *, what: str,
             background: bool = False) -> None:
    """torch.distributed.checkpoint.save on `group` (None: one process): every rank writes its
    own shards, rank 0 the metadata. `background`: called from the writer thread, outside the
    hang watch (which follows the main thread); the group's own timeout bounds it."""
    import torch.distributed.checkpoint as dcp

    with contextlib.nullcontext() if background else dist.guard(what):
        dcp.save(state, storage_writer=writer, planner=planner, process_group=group,
                 no_dist=group is None)


def dcp_load(state: dict[str, Any], reader: Any, planner: Any, group: Any, *, what: str) -> None:
    """torch.distributed.checkpoint.load into `state` in place, resharded to this world size."""
    import torch.distributed.checkpoint as dcp

    with dist.guard(what):
        dcp.load(state, storage_reader=reader, planner=planner, process_group=group,
                 no_dist=group is None)


def full_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """A sharded model's whole state dict, gathered from every rank's shards: plain CPU tensors
    on rank 0, {} on the others. A collective (all-gathers on the model's own group)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with dist.guard("the gather of the whole model"):
        return dict(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                          cpu_offload=True)))


def load_full_state_dict(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """A whole (plain) state dict, present on every rank, into a sharded model: each rank keeps
    its shard of rank 0's tensors (distribute_tensor scatters from rank 0). A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    with dist.guard("the load of a whole model into its shards"):
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
