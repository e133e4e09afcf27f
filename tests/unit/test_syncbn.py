"""ddpjob.train.syncbn.convert keeps the replaced BatchNorm layers' hooks: a frozen backbone's
eval-mode pre-hook (models.freeze_backbone_) must survive the conversion on both paths.

The CUDA path is torch's nn.SyncBatchNorm.convert_sync_batchnorm, which works on CPU modules
(only SyncBatchNorm's distributed forward needs CUDA; without a process group it runs plain
batch norm), so both paths are checked here on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpjob.train import syncbn
from ddpjob.train.models import _keep_eval, build_model, freeze_backbone_


def _frozen_model() -> nn.Module:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    freeze_backbone_(model)
    return model


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_convert_keeps_the_frozen_bn_pre_hook(device: str) -> None:
    torch.manual_seed(0)
    model = _frozen_model()
    assert _keep_eval in model[1]._forward_pre_hooks.values()
    converted = syncbn.convert(model, torch.device(device))
    bn = converted[1]
    expected = nn.SyncBatchNorm if device == "cuda" else syncbn.GlobalBatchNorm
    assert type(bn) is expected
    assert _keep_eval in bn._forward_pre_hooks.values()
    # ... and it still does its job: train() on the whole model, yet the statistics stay frozen
    before = (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked))
    converted.train()
    converted(torch.randn(5, 3, 8, 8) * 3 + 1)
    assert not bn.training
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])
    assert int(bn.num_batches_tracked) == before[2]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_convert_keeps_forward_hooks_and_unfrozen_bn_still_learns(device: str) -> None:
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Sequential(nn.BatchNorm1d(3)))
    seen: list[str] = []
    model[0].register_forward_hook(lambda m, i, o: seen.append("post"))
    converted = syncbn.convert(model, torch.device(device))
    assert len(converted[0]._forward_hooks) == 1 and not converted[1][0]._forward_hooks
    converted.train()
    converted(torch.randn(4, 3) + 5)
    assert seen == ["post"]
    assert converted[0].training and int(converted[0].num_batches_tracked) == 1  # not frozen: learns
    assert float(converted[0].running_mean.mean()) > 0.1


def test_resnet_with_frozen_backbone_keeps_every_bn_frozen_after_cuda_conversion() -> None:
    model = build_model("resnet8", num_classes=3, freeze_backbone=True)
    frozen = [n for n, m in model.named_modules()
              if isinstance(m, nn.modules.batchnorm._BatchNorm) and _keep_eval in m._forward_pre_hooks.values()]
    assert frozen
    converted = syncbn.convert(model, torch.device("cuda"))
    modules = dict(converted.named_modules())
    for name in frozen:
        assert isinstance(modules[name], nn.SyncBatchNorm)
        assert _keep_eval in modules[name]._forward_pre_hooks.values(), name
