"""Which DDP comm hook a model gets (Job.wrap registers it): DDP's own all-reduce, the sum in
rank order (dist.ordered_sum_hook: bit-reproducible across bucket layouts) or bfloat16 on the
wire; and, around it, the straggler watch's stamp of when this rank handed DDP its last bucket
(rank/straggler.py). The collectives themselves stay in dist.py."""

from __future__ import annotations

import time
from typing import Any

import torch

from ddpjob.node import dist


def register_comm_hook(ddp: Any, *, ordered: bool, compression: str = "none", stamp: Any = None) -> None:
    """How DDP all-reduces the gradients: as it does (ring, fp32), summed in rank order
    (`ordered`: bit-reproducible across bucket layouts), and/or sent as bfloat16
    (`compression = "bf16"`: half the bytes on the wire, each gradient rounded to 8 bits of
    mantissa before the mean).

    `stamp` (rank/straggler.StepTimer): each bucket handed to the hook sets its `arrived` to
    now, so the last one marks when this rank's own backward was done, before it waits for the
    others. With no hook of ours, DDP's own all-reduce is taken as a hook that stamps only where
    that gives the same bits: divided by a power-of-two world size before the sum, as after it
    (else the rank's busy time is its whole step, and it is never flagged)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    wire = torch.bfloat16 if compression == "bf16" else None
    if ordered:
        hook, state = dist.ordered_sum_hook, wire
    elif wire is not None:
        hook, state = default_hooks.bf16_compress_hook, None
    elif stamp is not None and stamp.world_size and _power_of_two(ddp.process_group.size()):
        hook, state = default_hooks.allreduce_hook, None
    else:
        return
    if stamp is None or not stamp.world_size:
        ddp.register_comm_hook(state, hook)
        return
    clock = time.perf_counter

    def stamped(inner_state, bucket):  # no annotations: DDP checks them (see ordered_sum_hook)
        stamp.arrived = clock()
        return hook(inner_state, bucket)

    ddp.register_comm_hook(state, stamped)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
