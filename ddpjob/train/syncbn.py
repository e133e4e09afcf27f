"""SyncBatchNorm for every device: trainer.py converts the model here before DDP wraps it.

On GPUs this is torch's nn.SyncBatchNorm. torch's version refuses CPU tensors (and DDP refuses
it on CPU modules), so CPU (gloo) jobs get GlobalBatchNorm: the same statistics over the
global batch, from two differentiable all-reduces per layer. State-dict keys are BatchNorm's,
so checkpoints and final weights load into the plain model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ddpjob.node import dist, gradsync


class GlobalBatchNorm(_BatchNorm):
    """BatchNorm whose training-mode statistics cover all ranks' samples (any dimension >= 2).

    Forward: mean = all_reduce(sum x) / N, var = all_reduce(sum (x - mean)^2) / N (two passes:
    no cancellation as with E[x^2] - E[x]^2). Backward: the all-reduces are autograd functions,
    so each rank receives the gradient of every rank's loss through the shared statistics,
    exactly as torch's CUDA SyncBatchNorm computes it.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group: Any = None,
                 **factory: Any) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, **factory)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.process_group or None  # None: the job's (default) group
        if not (self.training and dist.group_active(group)):
            return super().forward(x)  # eval, or one process: plain BatchNorm
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        xf = x.float()  # statistics in fp32 also under autocast
        local = torch.cat([xf.sum(dims), xf.new_full((1,), x.numel() / x.size(1))])
        total = gradsync.all_reduce_sum_autograd(local, group)
        count, mean = total[-1], total[:-1] / total[-1]
        centered = xf - mean.view(shape)
        var = gradsync.all_reduce_sum_autograd((centered * centered).sum(dims), group) / count
        if self.track_running_stats:
            assert self.num_batches_tracked is not None and self.running_mean is not None
            assert self.running_var is not None
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                unbiased = var.detach() * count / (count - 1).clamp(min=1)
                self.running_var.mul_(1 - m).add_(unbiased, alpha=m)
        y = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def convert(model: nn.Module, device: torch.device) -> nn.Module:
    """Every BatchNorm layer -> the synchronised one for `device` (weights, stats and hooks kept).

    torch's convert_sync_batchnorm drops the replaced layers' hooks, among them
    models.freeze_backbone_'s eval-mode pre-hook (frozen BN statistics would drift on GPUs):
    they are carried over here, matched by module path."""
    if device.type != "cpu":
        old = {name: m for name, m in model.named_modules(remove_duplicate=False)
               if isinstance(m, _BatchNorm)}
        out = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        new = dict(out.named_modules(remove_duplicate=False))
        for name, module in old.items():
            if new[name] is not module:
                _carry_hooks(module, new[name])
        return out
    return _convert_cpu(model)


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _carry_hooks(old: nn.Module, new: nn.Module) -> None:
    """The forward (pre-)hooks of `old` on its replacement `new`, in their order."""
    for attr in _HOOK_DICTS:
        if hasattr(old, attr) and hasattr(new, attr):
            getattr(new, attr).update(getattr(old, attr))


def _convert_cpu(module: nn.Module) -> nn.Module:
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, GlobalBatchNorm):
        out = GlobalBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                              module.track_running_stats)
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
        # Hooks on the old layer (e.g. models.freeze_backbone_'s eval-mode hook) must survive.
        _carry_hooks(module, out)
    for name, child in module.named_children():
        out.add_module(name, _convert_cpu(child))
    return out
