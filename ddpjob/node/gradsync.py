"""How the gradients cross the ranks at every step: the DDP communication hook job.wrap
registers (ring, rank-ordered sum, bf16 on the wire) and SyncBatchNorm's differentiable sum.
The owner of those collectives, as dist.py is of the rest; run inside DDP's backward and the
model's forward, they are bounded by the process group's timeout, not dist.guard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn


def register_comm_hook(ddp: Any, *, ordered: bool, compression: str = "none") -> None:
    """How DDP all-reduces the gradients: as it does (ring, fp32), summed in rank order
    (`ordered`: bit-reproducible across bucket layouts), and/or sent as bfloat16
    (`compression = "bf16"`: half the bytes on the wire, each gradient rounded to 8 bits of
    mantissa before the mean). Otherwise no hook: a user's own `register_comm_hook` after
    `job.wrap` stays possible."""
    wire = torch.bfloat16 if compression == "bf16" else None
    if ordered:
        ddp.register_comm_hook(wire, ordered_sum_hook)
    elif wire is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)


def ordered_sum_hook(wire, bucket):
    """DDP comm hook: mean of the ranks' gradients, summed in rank order (bit-reproducible);
    `wire` (the hook's state): the dtype sent, None for the gradients' own.

    Ring all-reduce (gloo and NCCL) adds the ranks' values in an order that depends on the
    element's offset in its bucket, and DDP rebuilds its buckets after the first iteration of
    every process: a resumed process would sum (a+b)+c where the uninterrupted one summed
    a+(b+c). Summing an all-gather in rank order makes the result independent of bucket layout.
    (No annotations: DDP checks them against the real classes, and this module's annotations
    are strings under `from __future__ import annotations`.)"""
    buf = bucket.buffer()
    send = buf if wire is None else buf.to(wire)
    world = dist.get_world_size()
    parts = [torch.empty_like(send) for _ in range(world)]
    fut = dist.all_gather(parts, send, async_op=True).get_future()

    def reduce(_: Any) -> torch.Tensor:
        acc = parts[0].to(buf.dtype, copy=True)
        for p in parts[1:]:
            acc.add_(p)  # in the gradients' dtype, whatever was sent
        return buf.copy_(acc.div_(world))

    return fut.then(reduce)


def all_reduce_sum_autograd(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Differentiable sum over the ranks of `group` (default: the job's): the backward pass
    all-reduces the gradient too. Returns a new tensor."""
    return dist_nn.all_reduce(t, group=group if group is not None else dist.group.WORLD)
